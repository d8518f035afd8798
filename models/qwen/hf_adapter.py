"""Qwen3 / Qwen2.5 config.json: transformers' Qwen3Config and Qwen2Config."""

from typing import Any

import torch

from models.hf_config import CausalLMNames, decoder_config, decoder_fields
from models.qwen.args import QwenArgs

_FAMILY_OF_MODEL_TYPE = {"qwen3": "qwen3", "qwen2": "qwen2.5"}
_MODEL_TYPE_OF_FAMILY = {"qwen3": "qwen3", "qwen2.5": "qwen2"}
_ARCHITECTURE_OF_FAMILY = {"qwen3": "Qwen3ForCausalLM", "qwen2.5": "Qwen2ForCausalLM"}


def _check_supported(cfg: dict[str, Any], family: str, *, origin: str) -> None:
    """Reject HF options that QwenModel does not implement, rather than train a different net
    (RoPE scalings are checked by models/rope.py)."""
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{origin}: use_sliding_window=true is not supported")
    if family == "qwen3" and cfg.get("attention_bias"):
        raise ValueError(f"{origin}: attention_bias=true is not supported for qwen3")


class QwenHFAdapter(CausalLMNames):
    """Reads and writes the config.json of Qwen3 and Qwen2.5 checkpoints."""

    model_types = tuple(_FAMILY_OF_MODEL_TYPE)

    def args_from_hf_config(self, cfg: dict[str, Any], *, origin: str) -> QwenArgs:
        """QwenArgs from a parsed config.json; `origin` names the file in error messages."""
        family = _FAMILY_OF_MODEL_TYPE[cfg["model_type"]]
        _check_supported(cfg, family, origin=origin)
        qwen3 = family == "qwen3"
        # Qwen2 configs carry no head_dim (HF derives it); Qwen3 decouples it, so it must be given.
        return QwenArgs(family=family, qk_norm=qwen3, qkv_bias=not qwen3,
                        **decoder_fields(cfg, origin=origin, head_dim_required=qwen3,
                                         max_position_embeddings=32768))

    def to_hf_config(self, args: QwenArgs, *, dtype: torch.dtype = torch.bfloat16,
                     source_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """config.json contents for transformers' Qwen3Config / Qwen2Config. Extra keys of
        `source_config` are kept; architecture keys are always ours."""
        qwen3 = args.family == "qwen3"
        hf_layout = (args.qk_norm, args.qkv_bias) == (qwen3, not qwen3)
        if args.family not in _MODEL_TYPE_OF_FAMILY or not hf_layout:
            raise ValueError(f"{args.family} with qk_norm={args.qk_norm}, "
                             f"qkv_bias={args.qkv_bias} has no Hugging Face architecture")
        defaults = {"attention_dropout": 0.0, "initializer_range": 0.02,
                    "max_window_layers": args.n_layers, "sliding_window": None,
                    "use_cache": True}
        ours = {"architectures": [_ARCHITECTURE_OF_FAMILY[args.family]],
                "model_type": _MODEL_TYPE_OF_FAMILY[args.family], "use_sliding_window": False}
        if qwen3:
            ours["attention_bias"] = False
        return decoder_config(args, dtype=dtype, source_config=source_config,
                              defaults=defaults, ours=ours)
