"""RoPE frequencies with the scalings Hugging Face configs declare (`rope_scaling`).

transformers' `modeling_rope_utils.ROPE_INIT_FUNCTIONS` is the definition: `inv_frequencies`
computes the same inverse frequencies and attention factor for each type (tests compare both and
the logits of transformers' Qwen3 / Qwen2 models), without importing transformers. The factor
multiplies cos and sin, so it scales q·k by its square (YaRN's "mscale"). Dynamic NTK depends on
the sequence: as transformers does when a sequence is longer than max_position_embeddings, the
base grows with seq_len; shorter sequences use plain RoPE.
"""

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from protocols.model_spec import ModelArgs

logger = logging.getLogger(__name__)

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
        for f in dataclasses.fields(self):
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


_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def _exponents(head_dim: int, device: torch.device | str) -> torch.Tensor:
    """2i / head_dim for i < head_dim / 2, as transformers builds it (FP32)."""
    return torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim


def _yarn(s: RopeScaling, *, theta: float, head_dim: int,
          device: torch.device | str) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attention = mscale(s.factor)

    def dimension(rotations: float) -> float:
        """The dimension that turns `rotations` times over the original positions."""
        original = s.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(device)  # 1: extrapolate (unchanged), 0: interpolate (/ factor)
    pos_freqs = theta ** _exponents(head_dim, device)
    inv = (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv, attention


def _llama3(s: RopeScaling, inv: torch.Tensor) -> torch.Tensor:
    original = s.original_max_position_embeddings
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_frequencies(args: ModelArgs, *, seq_len: int,
                    device: torch.device | str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of shape (head_dim / 2,) in FP32, factor on cos and sin) for
    sequences of `seq_len` tokens."""
    s, theta, head_dim = args.rope_scaling, args.rope_theta, args.head_dim
    if s is None:
        return 1.0 / theta ** _exponents(head_dim, device), 1.0
    if s.rope_type == "yarn":
        return _yarn(s, theta=theta, head_dim=head_dim, device=device)
    if s.rope_type == "dynamic":
        original = args.max_position_embeddings
        growth = s.factor * max(seq_len, original) / original - (s.factor - 1)
        theta = theta * growth ** (head_dim / (head_dim - 2))
    inv = 1.0 / theta ** _exponents(head_dim, device)
    if s.rope_type == "linear":
        return inv / s.factor, 1.0
    if s.rope_type == "llama3":
        return _llama3(s, inv), 1.0
    if s.rope_type == "longrope":
        original = s.original_max_position_embeddings
        divisors = s.long_factor if seq_len > original else s.short_factor
        attention = s.attention_factor
        if attention is None:
            attention = 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) /
                                                             math.log(original))
        return inv / torch.tensor(divisors, dtype=torch.float32, device=device), attention
    return inv, 1.0  # dynamic


def rope_tables(args: ModelArgs, seq_len: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) in FP32 (HF's rotate-half layout), with
    args.rope_scaling's frequencies and attention factor."""
    inv, attention_factor = inv_frequencies(args, seq_len=seq_len, device=device)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


_KINDS = {"truncate": "true or false", "original_max_position_embeddings": "an integer",
          "short_factor": "a list of numbers", "long_factor": "a list of numbers"}


def _typed(key: str, value: Any) -> Any:
    """A config.json value as its RopeScaling field's type (TypeError if it is not one)."""
    def number(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(key)
        return float(v)

    if key == "truncate":
        if not isinstance(value, bool):
            raise TypeError(key)
        return value
    if key in ("short_factor", "long_factor"):
        return tuple(number(v) for v in value)
    if key == "original_max_position_embeddings":
        if number(value) != int(value):
            raise TypeError(key)
        return int(value)
    return number(value)


def rope_scaling_from_hf(cfg: dict[str, Any], *, max_position_embeddings: int,
                         origin: str) -> RopeScaling | None:
    """The scaling of a parsed config.json (`rope_scaling`, or transformers 5's
    `rope_parameters`), with transformers' defaults; None for plain RoPE. Keys a type does not
    read are ignored with a warning, as transformers does."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_FIELDS:
        raise ValueError(f"{origin}: rope scaling {rope_type!r} is not supported (choose one of "
                         f"default, {', '.join(ROPE_FIELDS)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{origin}: rope partial_rotary_factor != 1 is not supported")
    used = ROPE_FIELDS[rope_type]
    ignored = sorted(set(params) - set(used) - _COMMON_KEYS)
    if ignored:
        logger.warning("%s: rope_scaling %s ignores %s", origin, rope_type, ", ".join(ignored))
    values = {}
    for key in (k for k in used if params.get(k) is not None):
        try:
            values[key] = _typed(key, params[key])
        except TypeError:
            raise ValueError(f"{origin}: rope_scaling {key} must be "
                             f"{_KINDS.get(key, 'a number')}, got {params[key]!r}") from None
    if "original_max_position_embeddings" in used:
        # transformers: a top-level original_max_position_embeddings wins (Phi-3's), else the
        # nested one, else max_position_embeddings.
        values["original_max_position_embeddings"] = (
            cfg.get("original_max_position_embeddings")
            or values.get("original_max_position_embeddings") or max_position_embeddings)
    if "factor" not in values and rope_type in ("yarn", "longrope"):
        values["factor"] = max_position_embeddings / values["original_max_position_embeddings"]
    if "factor" not in values:
        raise ValueError(f"{origin}: rope_scaling {rope_type} needs a factor")
    try:
        return RopeScaling(rope_type=rope_type, **values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{origin}: rope_scaling: {e}") from None


def rope_scaling_to_hf(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """config.json's `rope_scaling` for `scaling`: its type, factor and the fields it sets
    beyond their defaults (so Qwen's model-card dicts come back as written)."""
    if scaling is None:
        return None
    out: dict[str, Any] = {"rope_type": scaling.rope_type}
    for f in dataclasses.fields(scaling):
        value = getattr(scaling, f.name)
        if f.name in ROPE_FIELDS[scaling.rope_type] and (f.name == "factor" or value != f.default):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
