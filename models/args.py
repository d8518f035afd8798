"""Architecture hyper-parameters shared by the Qwen3 and Qwen2.5 families."""

from dataclasses import dataclass, fields
from typing import Literal, get_args

RopeType = Literal["linear", "dynamic", "yarn", "longrope", "llama3"]

# The fields each type reads (transformers' modeling_rope_utils); every other field keeps its
# default, so one scaling has one representation.
ROPE_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
}

# Of those, the ones without a formula default: a type that reads one needs it.
_ROPE_REQUIRED = ("original_max_position_embeddings", "short_factor", "long_factor",
                  "low_freq_factor", "high_freq_factor")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling as a Hugging Face config.json's `rope_scaling` declares it; transformers'
    `modeling_rope_utils` is the definition, models/rope.py computes it. No scaling is None."""

    rope_type: RopeType
    """"linear" (positions / factor), "dynamic" (NTK: the base grows once seq_len exceeds
    max_position_embeddings), "yarn", "longrope" or "llama3"."""
    factor: float
    """How many times the original positions the scaling stretches RoPE over (>= 1)."""
    original_max_position_embeddings: int | None = None
    """yarn, longrope, llama3: the pre-training positions they scale (linear and dynamic scale
    max_position_embeddings)."""
    attention_factor: float | None = None
    """yarn, longrope: the factor on cos and sin; None: the type's formula of `factor`."""
    beta_fast: float = 32.0
    """yarn: frequencies with more rotations than this over the original positions stay."""
    beta_slow: float = 1.0
    """yarn: frequencies with fewer rotations than this are divided by factor."""
    mscale: float | None = None
    """yarn: attention_factor's numerator coefficient (with mscale_all_dim; DeepSeek's)."""
    mscale_all_dim: float | None = None
    """yarn: attention_factor's denominator coefficient (with mscale)."""
    truncate: bool = True
    """yarn: round the ramp's bounds to whole dimensions."""
    low_freq_factor: float | None = None
    """llama3: wavelengths above original / low_freq_factor are divided by factor."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below original / high_freq_factor stay."""
    short_factor: tuple[float, ...] | None = None
    """longrope: per-frequency divisors up to the original positions (head_dim / 2 of them)."""
    long_factor: tuple[float, ...] | None = None
    """longrope: per-frequency divisors beyond the original positions."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_FIELDS:
            raise ValueError(f"rope_type must be one of {', '.join(get_args(RopeType))}, "
                             f"got {self.rope_type!r}")
        if not self.factor >= 1:
            raise ValueError(f"{self.rope_type} factor must be >= 1, got {self.factor!r}")
        used = ROPE_FIELDS[self.rope_type]
        for f in fields(self):
            if f.name != "rope_type" and f.name not in used and getattr(self, f.name) != f.default:
                raise ValueError(f"{self.rope_type} scaling takes no {f.name}")
        missing = [name for name in used if getattr(self, name) is None
                   and name in _ROPE_REQUIRED]
        if missing:
            raise ValueError(f"{self.rope_type} scaling needs {', '.join(missing)}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 scaling needs high_freq_factor > low_freq_factor")

    def describe(self) -> str:
        """E.g. "yarn x8 over 32,768"."""
        over = self.original_max_position_embeddings
        return f"{self.rope_type} x{self.factor:g}" + (f" over {over:,}" if over else "")


@dataclass(frozen=True)
class QwenArgs:
    """One Qwen flavor: everything needed to build the network and count its size."""

    family: str
    """"qwen3" or "qwen2.5"; decides the Hugging Face `model_type` written on save."""
    dim: int
    """Hidden size (HF `hidden_size`)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Per-head size; Qwen3 decouples it from dim / n_heads."""
    hidden_dim: int
    """SwiGLU intermediate size (HF `intermediate_size`)."""
    vocab_size: int
    """Embedding rows (HF `vocab_size`, padded as published)."""
    qk_norm: bool
    """RMSNorm on queries and keys per head (Qwen3 yes, Qwen2.5 no)."""
    qkv_bias: bool
    """Bias on the q/k/v projections (Qwen2.5 yes, Qwen3 no)."""
    tie_embeddings: bool
    """LM head shares the embedding matrix."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 32768
    """Longest position the published model was trained for (written back to config.json)."""
    rope_scaling: RopeScaling | None = None
    """RoPE scaling for contexts beyond max_position_embeddings (HF `rope_scaling`); None: none."""

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            values = getattr(self.rope_scaling, name, None)
            if values is not None and len(values) != self.head_dim // 2:
                raise ValueError(f"longrope {name} needs head_dim / 2 = {self.head_dim // 2} "
                                 f"values, got {len(values)}")

    def max_positions(self) -> int:
        """The longest sequence the model takes: max_position_embeddings, or with a RoPE scaling
        factor x the positions it scales (the original ones, else max_position_embeddings) where
        that is more."""
        scaling = self.rope_scaling
        if scaling is None:
            return self.max_position_embeddings
        scaled = scaling.original_max_position_embeddings or self.max_position_embeddings
        return max(self.max_position_embeddings, int(scaling.factor * scaled))

    def describe_positions(self) -> str:
        """E.g. "262,144 positions (RoPE yarn x8 over 32,768)", "40,960 positions
        (max_position_embeddings)"."""
        how = f"RoPE {self.rope_scaling.describe()}" if self.rope_scaling else \
            "max_position_embeddings"
        return f"{self.max_positions():,} positions ({how})"

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q + 2 * self.dim * kv + q * self.dim
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn + 3 * self.dim * self.hidden_dim + 2 * self.dim

    def num_params(self) -> int:
        """Total parameter count, embeddings counted once when tied."""
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else emb
        return emb + head + self.n_layers * self.block_params() + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as docs/DESIGN.md §7.1 counts them: 6·N (all parameters)
        plus causal attention 6·L·seq·(n_heads·head_dim); recomputation is not counted."""
        attn = 6.0 * self.n_layers * seq_len * self.n_heads * self.head_dim
        return 6.0 * self.num_params() + attn
