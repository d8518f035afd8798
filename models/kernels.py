"""The model's memory-bound ops behind one switch: `[model] kernels` and `[model] attention`.

On an H200 the elementwise ops around the GEMMs (each RMSNorm, RoPE and SwiGLU is several eager
kernels, and the loss builds FP32 logits chunk by chunk) cost more than recomputation does.
liger-kernel's Triton kernels fuse each into one pass and save fewer, smaller tensors for
backward; we take them from that library rather than writing our own.

- "torch": plain eager ops with Hugging Face Qwen's numerics; runs everywhere (the CPU path).
- "liger": liger-kernel's RMSNorm (QK-norm too), RoPE, SwiGLU and fused linear + cross-entropy
  (the logits never exist beyond one chunk, gradients are computed in the forward). CUDA only.
- "auto": liger on CUDA when the package imports, else torch, with one line saying why.

Attention is torch's SDPA in both; `attention` picks its backend. Every mode (single, fsdp2,
the compute reference, SlideDP's streamed blocks) calls the model through these functions, so
the same choice gives the same kernels everywhere.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from models.loss import IGNORE_INDEX, chunked_cross_entropy_sum

KernelChoice = Literal["auto", "liger", "torch"]
AttentionChoice = Literal["auto", "cudnn", "flash", "efficient", "math"]

# Tried in this order until one supports the call's shapes and dtype.
_ATTENTION_BACKENDS: dict[str, list[SDPBackend]] = {
    # cuDNN first: at Qwen3's shapes (GQA, head_dim 128) its forward + backward is faster than
    # flash, which torch's own default order tries first (recipes/bench/attention.py times both).
    "auto": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


class KernelsUnavailable(ValueError):
    """The requested kernels cannot run here (missing package, or no GPU)."""


@dataclass(frozen=True)
class Kernels:
    """One implementation of each memory-bound op of the Qwen block and loss."""

    name: Literal["liger", "torch"]
    """Which implementation the ops below come from."""
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x, weight, eps) -> weight * normalized x; the variance in FP32, as Hugging Face does."""
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor]]
    """(q, k, cos, sin) -> rotated (q, k); q, k are (batch, heads, seq, head_dim), the tables FP32
    (seq, head_dim) in the rotate-half layout."""
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate, up) -> silu(gate) * up."""
    linear_cross_entropy_sum: Callable[..., torch.Tensor]
    """(hidden, head_weight, labels, *, chunk_tokens) -> FP32 sum of the token losses."""
    attention: AttentionChoice = "auto"
    """SDPA backend preference (see _ATTENTION_BACKENDS)."""
    rope_in_place: bool = False
    """`rope` overwrites q and k (when they are views of contiguous (batch, seq, heads, dim))."""
    note: str = ""
    """Why these kernels were chosen when it is not what was asked for (printed at start)."""

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal grouped-query attention on the configured backends."""
        if q.device.type != "cuda":  # the backend choice is a CUDA matter
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(_ATTENTION_BACKENDS[self.attention], set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def describe(self) -> str:
        ops = "RMSNorm, RoPE, SwiGLU, fused linear+cross-entropy" if self.name == "liger" else "eager"
        return f"kernels {self.name} ({ops}), attention {self.attention}"


# ---- torch: the plain path ---------------------------------------------------------------------

def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotated in x's dtype with the tables cast to it, as Hugging Face does: same numerics as the
    # published model, and no FP32 copies of q and k to save.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _torch_rope(q, k, cos, sin):
    return _torch_rotate(q, cos, sin), _torch_rotate(k, cos, sin)


def _torch_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


TORCH_KERNELS = Kernels(name="torch", rms_norm=_torch_rms_norm, rope=_torch_rope,
                        swiglu=_torch_swiglu, linear_cross_entropy_sum=chunked_cross_entropy_sum)


# ---- liger ---------------------------------------------------------------------------------------

def _liger_kernels(attention: AttentionChoice) -> Kernels:
    """liger-kernel's ops (imported here: the package loads Triton, seconds the CPU path skips)."""
    from liger_kernel.transformers.functional import (liger_fused_linear_cross_entropy,
                                                      liger_rms_norm, liger_rope, liger_swiglu)

    def rms_norm(x, weight, eps):
        # "llama" casting: the variance in FP32, the product in x's dtype (HF Qwen's RMSNorm).
        return liger_rms_norm(x, weight, eps, casting_mode="llama")

    def rope(q, k, cos, sin):
        # Rotates q and k in place (rope_in_place: Attention.rotate hands it tensors of its own).
        return liger_rope(q, k, cos.to(q.dtype), sin.to(q.dtype))

    def linear_cross_entropy_sum(hidden, head_weight, labels, *, chunk_tokens=4096):
        h = hidden.reshape(-1, hidden.shape[-1])
        (tokens, dim), vocab = h.shape, head_weight.shape[0]
        # The kernel bounds its logits chunk to chunk_mem_const x (tokens x dim) elements: pick
        # the constant that makes a chunk about chunk_tokens rows, as the plain path's are. Its
        # default (one hidden-sized block) gives chunks of 128-512 rows, each of which re-reads
        # and re-writes the whole FP32 head gradient.
        chunk_mem_const = max(1, math.ceil(vocab * min(chunk_tokens, tokens) / (dim * tokens)))
        # Under autocast (mode single: FP32 weights) compute in the autocast dtype, as F.linear
        # would, with autocast off inside so that no op re-casts.
        device_type = h.device.type
        dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                 else h.dtype)
        with torch.autocast(device_type, enabled=False):
            # FP32 accumulation of the head's gradient over the chunks, as the plain path's
            # single mode has it.
            return liger_fused_linear_cross_entropy(
                h.to(dtype), head_weight.to(dtype), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum", accum_dtype=torch.float32, chunk_mem_const=chunk_mem_const)

    return Kernels(name="liger", rms_norm=rms_norm, rope=rope, swiglu=liger_swiglu,
                   linear_cross_entropy_sum=linear_cross_entropy_sum, attention=attention,
                   rope_in_place=True)


def _liger_missing() -> str:
    """Empty if liger-kernel imports, else the reason."""
    try:
        import liger_kernel.ops  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not installed ({e})"
    return ""


def resolve_kernels(choice: KernelChoice, *, attention: AttentionChoice = "auto",
                    device_type: str) -> Kernels:
    """The kernels `choice` means on `device_type` ("cuda" or "cpu"); KernelsUnavailable (one
    line) when an explicit choice cannot run here."""
    if attention != "auto" and device_type != "cuda":
        raise KernelsUnavailable(f"model.attention = {attention!r} selects a CUDA SDPA backend; "
                                 f"this run has no GPU (use \"auto\")")
    if choice == "torch":
        return replace(TORCH_KERNELS, attention=attention)
    if device_type != "cuda":
        if choice == "liger":
            raise KernelsUnavailable('model.kernels = "liger" needs a CUDA GPU (Triton kernels); '
                                     'use "torch" or "auto" on the CPU')
        return TORCH_KERNELS  # auto on the CPU: the plain path, nothing to say
    missing = _liger_missing()
    if missing and choice == "liger":
        raise KernelsUnavailable(f'model.kernels = "liger": {missing}; pip install liger-kernel, '
                                 f'or use "torch"')
    if missing:
        return replace(TORCH_KERNELS, attention=attention,
                       note=f"{missing}: plain torch kernels instead (GPU steps 1.3-1.5x slower; "
                            f"pip install liger-kernel)")
    return _liger_kernels(attention)


class _SdpaOps(TorchDispatchMode):
    """Records the SDPA aten ops that run under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def sdpa_backend_used(kernels: Kernels, *, n_heads: int, n_kv_heads: int, head_dim: int,
                      seq_len: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The aten SDPA kernel these kernels' attention runs at these shapes (one sequence), e.g.
    "_scaled_dot_product_cudnn_attention": what the benchmark rows record as `attention_op`."""
    # Inputs that need gradients, as in training: some backends only take the call without.
    q = torch.randn(1, n_heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(1, n_kv_heads, seq_len, head_dim, device=device, dtype=dtype,
                     requires_grad=True)
    with _SdpaOps() as mode:
        kernels.sdpa(q, kv, kv)
    # The math backend is a composition of plain ops: no SDPA op of its own is dispatched.
    return mode.ops[-1] if mode.ops else "math"
