"""The layer-wise CPU AdamW update of the shared host state (the gradient's way home is
slidedp/routes/reduction.py)."""

from dataclasses import dataclass

import torch

from slidedp import cpu_adam
from slidedp.host_state import SharedHostState


@dataclass(frozen=True)
class AdamHyper:
    """AdamW hyper-parameters of the host optimizer."""

    beta1: float
    """First-moment decay."""
    beta2: float
    """Second-moment decay."""
    eps: float
    """Added after the square root."""
    weight_decay: float
    """Decoupled weight decay."""


class HostOptimizer:
    """AdamW on slices of the shared FP32 state, writing the BF16 shadow in the same pass (over
    the gradient, when the shadow held it); a BF16 master (MegaTrain-style) is widened, updated
    and rounded back in place by the same pass."""

    def __init__(self, state: SharedHostState, hyper: AdamHyper, *, threads: int):
        self.state, self.hyper, self.threads = state, hyper, threads
        # Build (or load) the kernel now: a first build takes seconds, which would otherwise
        # land inside the first step's updates and stall its deliveries.
        cpu_adam.active_isa()

    def update(self, start: int, end: int, grad: torch.Tensor, *, step: int, lr: float,
               grad_scale: float = 1.0) -> None:
        """Update global elements [start, end) with `grad` (bf16 or fp32, same length)."""
        st, h = self.state, self.hyper
        bf16_out = st.shadow[start:end] if st.plan.bf16_shadow else None
        scales = {}
        if st.plan.moments == "8bit":  # whole blocks: start is a shard or chunk boundary
            lo, hi = start // cpu_adam.MOMENT_BLOCK, cpu_adam.moment_scales(end)
            scales = {"exp_avg_scale": st.exp_avg_scale[lo:hi], "exp_avg_sq_scale": st.exp_avg_sq_scale[lo:hi]}
        cpu_adam.adam_update(
            st.master[start:end], grad, st.exp_avg[start:end], st.exp_avg_sq[start:end],
            step=step, lr=lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
            weight_decay=h.weight_decay, grad_scale=grad_scale, bf16_out=bf16_out,
            num_threads=self.threads, **scales)
