"""The config.json fields every decoder of models/ shares with Hugging Face's (hidden_size,
num_hidden_layers, ..., rope_scaling); a family's adapter adds its own
(models/<name>/hf_adapter.py)."""

from typing import Any, Protocol

import torch

from models.rope import rope_scaling_from_hf, rope_scaling_to_hf
from protocols.model_spec import ModelArgs

REQUIRED = object()


class CausalLMNames:
    """Hugging Face *ForCausalLM tensor names: the model's behind a `model.` prefix, but the
    head's."""

    head = "lm_head.weight"
    """The output head, which a tied checkpoint omits (it is the embedding)."""

    def to_hf_name(self, name: str) -> str:
        return name if name == self.head else "model." + name

    def from_hf_name(self, key: str) -> str:
        return key.removeprefix("model.")


class DecoderArgs(ModelArgs, Protocol):
    """The args of a decoder whose config.json these fields describe."""

    hidden_dim: int
    """SwiGLU intermediate size (`intermediate_size`)."""
    norm_eps: float
    """RMSNorm epsilon (`rms_norm_eps`)."""


def field(cfg: dict[str, Any], key: str, *, origin: str, default: Any = REQUIRED) -> Any:
    """cfg[key], else `default`; an absent required key is a ValueError naming `origin`."""
    if cfg.get(key) is not None:
        return cfg[key]
    if default is REQUIRED:
        raise ValueError(f"{origin}: missing field {key!r}")
    return default


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers >= 5 nests it in `rope_parameters`; 10000 is HF's default when absent.
    nested = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or nested.get("rope_theta") or 10000.0)


def decoder_fields(cfg: dict[str, Any], *, origin: str, head_dim_required: bool,
                   max_position_embeddings: int) -> dict[str, Any]:
    """The shared args of a parsed config.json, with transformers' defaults; the family's config
    class says whether head_dim must be given (else hidden_size / num_attention_heads) and the
    default of max_position_embeddings."""
    dim = int(field(cfg, "hidden_size", origin=origin))
    n_heads = int(field(cfg, "num_attention_heads", origin=origin))
    head_dim = field(cfg, "head_dim", origin=origin,
                     default=REQUIRED if head_dim_required else dim // n_heads)
    max_positions = int(field(cfg, "max_position_embeddings", origin=origin,
                              default=max_position_embeddings))
    return dict(
        dim=dim,
        n_layers=int(field(cfg, "num_hidden_layers", origin=origin)),
        n_heads=n_heads,
        n_kv_heads=int(field(cfg, "num_key_value_heads", origin=origin)),
        head_dim=int(head_dim),
        hidden_dim=int(field(cfg, "intermediate_size", origin=origin)),
        vocab_size=int(field(cfg, "vocab_size", origin=origin)),
        tie_embeddings=bool(field(cfg, "tie_word_embeddings", origin=origin, default=False)),
        rope_theta=_rope_theta(cfg),
        norm_eps=float(field(cfg, "rms_norm_eps", origin=origin, default=1e-6)),
        max_position_embeddings=max_positions,
        rope_scaling=rope_scaling_from_hf(cfg, max_position_embeddings=max_positions,
                                          origin=origin),
    )


def decoder_config(args: DecoderArgs, *, dtype: torch.dtype, source_config: dict[str, Any] | None,
                   defaults: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """config.json contents: the family's `defaults`, then `source_config`'s keys (bos/eos ids,
    transformers_version, ...), then the shared architecture keys and the family's `ours`."""
    dtype_name = str(dtype).removeprefix("torch.")
    rope_scaling = rope_scaling_to_hf(args.rope_scaling)
    shared = {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.hidden_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        # transformers < 4.56 reads "torch_dtype", later versions "dtype"; write both.
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    config = {**defaults, **(source_config or {}), **shared, **ours}
    # transformers lets a top-level one override rope_scaling's; ours is in rope_scaling.
    config.pop("original_max_position_embeddings", None)
    if isinstance(config.get("rope_parameters"), dict):  # transformers 5's spelling, kept in step
        config["rope_parameters"] = {"rope_theta": args.rope_theta,
                                     **(rope_scaling or {"rope_type": "default"})}
    return dict(sorted(config.items()))
