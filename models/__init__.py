"""Model families, one package each; protocols/model_spec.py looks a family's ModelSpec up here.
Shared pieces beside them: the kernels switch, RoPE, the chunked loss, Hugging Face I/O."""

SUPPORTED_MODELS = ("qwen", "llama3")
"""The packages under models/ whose `model_spec()` the registry returns (one line per family)."""
