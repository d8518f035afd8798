"""Activation policy per block: keep on GPU, recompute in backward, or recompute selectively.

Keeping a block's activations normally pins its weights too (autograd saves them for the
backward matmuls). `WeightRefs` breaks that tie: while a block runs forward, saved tensors that
live in a GPU parameter buffer are stored as (unit, offset, size, stride) references and resolved
in backward against whichever buffer holds that unit then. The weights can leave the window and
be re-delivered; the kept activations stay. (Offload to host memory is the next policy to plug in
here: it is another pack/unpack pair.)

"recompute" and "selective" run the block under torch's non-reentrant checkpoint, whose replay
stops once backward's last saved tensor is rebuilt (the block's final projection is not re-run).
"selective" is full recompute except attention: the attention kernel's outputs are saved in
forward (torch's selective activation checkpointing), so backward replays only the cheap
projections, norms and MLP, not the attention itself.
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable, get_args

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from slidedp.config import ActivationPolicy

POLICIES: tuple[str, ...] = get_args(ActivationPolicy)

_aten = torch.ops.aten
_SAVED_OPS = {getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name)}


def _save_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


save_attention_context = partial(create_selective_checkpoint_contexts, _save_attention)
"""`context_fn` for torch.utils.checkpoint that keeps attention outputs."""


@dataclass(frozen=True)
class _WeightRef:
    unit: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class WeightRefs:
    """saved_tensors_hooks that swap parameter-buffer tensors for references."""

    def __init__(self, buffers: list[torch.Tensor], resolve: Callable[[int], torch.Tensor]):
        self._ptrs = {b.untyped_storage().data_ptr() for b in buffers}
        self._resolve = resolve

    def during_forward_of(self, unit: int):
        """Context for one block's forward: pack weights of `unit` as references."""

        def pack(t: torch.Tensor):
            if t.device.type != "meta" and t.untyped_storage().data_ptr() in self._ptrs:
                return _WeightRef(unit, t.storage_offset(), t.size(), t.stride())
            return t

        def unpack(x):
            if isinstance(x, _WeightRef):
                return torch.as_strided(self._resolve(x.unit), x.size, x.stride, x.offset)
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def block_policies(n_blocks: int, *, default: ActivationPolicy,
                   keep_blocks: int) -> list[ActivationPolicy]:
    """Per-block policy: the first `keep_blocks` keep activations, the rest use `default`."""
    if default not in POLICIES:
        raise ValueError(f"slidedp.activation must be one of {POLICIES}, got {default!r}")
    return ["keep" if i < keep_blocks else default for i in range(n_blocks)]
