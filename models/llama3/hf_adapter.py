"""Llama 3 config.json: transformers' LlamaConfig."""

from typing import Any

import torch

from models.hf_config import CausalLMNames, decoder_config, decoder_fields
from models.qwen.args import QwenArgs


def _check_supported(cfg: dict[str, Any], *, origin: str) -> None:
    """Reject LlamaConfig options the decoder does not implement (RoPE: models/rope.py)."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{origin}: {key}=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{origin}: hidden_act {cfg['hidden_act']!r} is not supported")


class LlamaHFAdapter(CausalLMNames):
    """Reads and writes the config.json of Llama 3 checkpoints."""

    model_types = ("llama",)

    def args_from_hf_config(self, cfg: dict[str, Any], *, origin: str) -> QwenArgs:
        """Llama 3 args from a parsed config.json; `origin` names the file in error messages."""
        _check_supported(cfg, origin=origin)
        return QwenArgs(family="llama3", qk_norm=False, qkv_bias=False,
                        **decoder_fields(cfg, origin=origin, head_dim_required=False,
                                         max_position_embeddings=2048))

    def to_hf_config(self, args: QwenArgs, *, dtype: torch.dtype = torch.bfloat16,
                     source_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """config.json contents for transformers' LlamaConfig. Extra keys of `source_config`
        are kept; architecture keys are always ours."""
        if args.qk_norm or args.qkv_bias:
            raise ValueError("Llama has no QK-norm or QKV bias")
        defaults = {"attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1,
                    "use_cache": True}
        ours = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "attention_bias": False, "mlp_bias": False}
        return decoder_config(args, dtype=dtype, source_config=source_config,
                              defaults=defaults, ours=ours)
