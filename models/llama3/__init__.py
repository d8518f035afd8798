"""Llama 3.1 / 3.2: its flavors and Hugging Face adapter on Qwen's decoder, which without QK-norm
and QKV bias is Llama's block (the same parameter names, RMSNorm, SwiGLU and rotate-half RoPE)."""

from dataclasses import replace

from models.llama3.flavors import FLAVORS, PUBLISHED_BILLIONS
from models.llama3.hf_adapter import LlamaHFAdapter
from models.qwen import model_spec as qwen_spec
from protocols.model_spec import ModelSpec

__all__ = ["FLAVORS", "model_spec"]


def model_spec() -> ModelSpec:
    """Llama 3's spec, as models.SUPPORTED_MODELS registers it."""
    return replace(qwen_spec(), name="llama3", families=("llama3",), flavors=FLAVORS,
                   published_billions=PUBLISHED_BILLIONS, hf=LlamaHFAdapter())
