"""One pass of AdamW over a flat FP32 shard on the GPU, from its BF16 gradient, writing the
shard's BF16 copy in the same pass (the updates of slidedp/gpu_update.py).

torch's fused AdamW takes the gradient in the parameter's dtype, so a BF16 gradient must first be
cast to an FP32 temporary (read 2, write 4 B/param) and the BF16 copy that the next delivery
reads is a second pass (read 4, write 2): 40 B/param of HBM traffic for a 28 B/param update. That
traffic is GPU time the step cannot hide: with clipping the updates run after the norm, beside
the next forward. This Triton kernel reads the BF16 gradient and writes the copy in its one pass.
It computes torch's fused formula (aten's fused_adam_utils.cuh, ADAMW mode) in FP32 with IEEE
division and square root: the gradient divided by `divisor` (torch's grad_scale), nothing
written where `found_inf` is set, decoupled weight decay, bias corrections from the step count.
On the CPU, or without Triton, torch's fused AdamW runs, with the cast and the copy around it.
"""

import math

import torch
from torch.optim.adamw import adamw

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without it: torch's path serves every update
    triton = None

ELEMENTS_PER_THREAD = 8
"""A memory-bound pass: each thread loads and stores 8 elements of each tensor."""
WARPS = (1, 2, 4, 8, 16, 32)
"""The warps a program may have (`adamw_step`'s `warps`): Triton's powers of two."""


def block_elements(warps: int) -> int:
    """Elements per program of `warps` warps (32 threads each)."""
    return warps * 32 * ELEMENTS_PER_THREAD


BLOCK = block_elements(4)
"""Elements per program at the default 4 warps."""


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    @triton.jit
    def _adamw_block(index, param, exp_avg, exp_avg_sq, grad, out, divisor, n, lr_wd, beta1,
                     one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                     HAS_OUT: tl.constexpr, HAS_DIVISOR: tl.constexpr,
                     MOMENTS_BF16: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.cast(index, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DIVISOR:
            g = tl.div_rn(g, tl.load(divisor))
        p = tl.load(param + offs, mask=mask, other=0.0)
        m = tl.load(exp_avg + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0).to(tl.float32)
        p = p - lr_wd * p
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(param + offs, p, mask=mask)
        if MOMENTS_BF16:  # rounded to nearest even, as the CPU Adam stores BF16 moments
            tl.store(exp_avg + offs, m.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
            tl.store(exp_avg_sq + offs, v.to(tl.bfloat16, fp_downcast_rounding="rtne"),
                     mask=mask)
        else:
            tl.store(exp_avg + offs, m, mask=mask)
            tl.store(exp_avg_sq + offs, v, mask=mask)
        if HAS_OUT:
            tl.store(out + offs, p.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _adamw_kernel(param, exp_avg, exp_avg_sq, grad, out, divisor, found_inf, n,
                      lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size,
                      bc2_sqrt, eps, HAS_OUT: tl.constexpr, HAS_DIVISOR: tl.constexpr,
                      HAS_FOUND_INF: tl.constexpr, MOMENTS_BF16: tl.constexpr,
                      STRIDED: tl.constexpr, BLOCK: tl.constexpr):
        if HAS_FOUND_INF:  # a skipped step writes nothing (torch's fused kernel returns)
            n = tl.where(tl.load(found_inf) == 0, n, 0)
        if STRIDED:  # a capped grid: each program updates every num_programs-th block
            for index in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
                _adamw_block(index, param, exp_avg, exp_avg_sq, grad, out, divisor, n, lr_wd,
                             beta1, one_minus_beta1, beta2, one_minus_beta2, step_size,
                             bc2_sqrt, eps, HAS_OUT, HAS_DIVISOR, MOMENTS_BF16, BLOCK)
        else:
            _adamw_block(tl.program_id(0), param, exp_avg, exp_avg_sq, grad, out, divisor, n,
                         lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size,
                         bc2_sqrt, eps, HAS_OUT, HAS_DIVISOR, MOMENTS_BF16, BLOCK)


def adamw_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               grad: torch.Tensor, *, out: torch.Tensor | None, lr: float, beta1: float,
               beta2: float, weight_decay: float, eps: float, step: int,
               divisor: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
               programs: int = 0, warps: int = 4) -> None:
    """AdamW step `step` (from 1) of the flat FP32 `param` and its moments `exp_avg`,
    `exp_avg_sq` (both FP32, or both BF16: widened, updated in FP32 and rounded back, as the CPU
    Adam does) in place, with the BF16 `grad` divided by `divisor` (a device scalar; None: by 1),
    skipped where `found_inf` (a device scalar) is nonzero; `out` (BF16, or None) receives the
    new `param` rounded to BF16. Issued on the current stream; `grad` is left unchanged.
    `programs` > 0 caps the kernel's grid, each program striding over blocks of `warps` warps'
    elements, so that the update leaves the other SMs to kernels beside it; 0: a program a
    block. Only recipes/bench/gpu_adam.py --overlap sets a cap, to time that trade on a GPU: the
    runtime's updates take the full grid, which no cap beat beside the forward's GEMMs on an
    H100 (docs/PERFORMANCE.md)."""
    n = param.numel()
    if not all(t.numel() == n for t in (exp_avg, exp_avg_sq, grad)) or (
            out is not None and out.numel() != n):
        raise ValueError("adamw_step: param, moments, gradient and out differ in length")
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("adamw_step: the moments must be both FP32 or both BF16")
    if programs < 0 or warps not in WARPS:
        raise ValueError(f"adamw_step: programs must be >= 0 and warps a power of two up to 32, "
                         f"got {programs}, {warps}")
    if not _use_triton(param):
        torch_adamw_step(param, exp_avg, exp_avg_sq, grad, out=out, lr=lr, beta1=beta1,
                         beta2=beta2, weight_decay=weight_decay, eps=eps, step=step,
                         divisor=divisor, found_inf=found_inf)
        return
    bc1, block = 1 - beta1 ** step, block_elements(warps)
    blocks = triton.cdiv(n, block)
    _adamw_kernel[(min(blocks, programs) if programs else blocks,)](
        param, exp_avg, exp_avg_sq, grad, out if out is not None else param,
        divisor if divisor is not None else param, found_inf if found_inf is not None else param,
        n, lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, lr / bc1,
        math.sqrt(1 - beta2 ** step), eps, HAS_OUT=out is not None,
        HAS_DIVISOR=divisor is not None, HAS_FOUND_INF=found_inf is not None,
        MOMENTS_BF16=exp_avg.dtype == torch.bfloat16, STRIDED=0 < programs < blocks,
        BLOCK=block, num_warps=warps)


def torch_adamw_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     grad: torch.Tensor, *, out: torch.Tensor | None, lr: float, beta1: float,
                     beta2: float, weight_decay: float, eps: float, step: int,
                     divisor: torch.Tensor | None = None,
                     found_inf: torch.Tensor | None = None) -> None:
    """`adamw_step` by torch's fused AdamW: the gradient cast to an FP32 temporary (and BF16
    moments widened to FP32 ones), the update, then the BF16 copy and the moments rounded back
    (the CPU's path, and what recipes/bench/gpu_adam.py times the kernel against)."""
    g = grad.float()
    count = torch.full((), float(step - 1), device=param.device)  # the kernel adds one
    m, v = exp_avg.float(), exp_avg_sq.float()  # the tensors themselves when FP32
    adamw([param], [g], [m], [v], [], [count], fused=True,
          grad_scale=divisor, found_inf=found_inf, amsgrad=False, beta1=beta1, beta2=beta2,
          lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    if m is not exp_avg:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(param)
