"""Saved weights as references into the streamed GPU buffers.

Keeping a block's activations normally pins its weights too: autograd saves them for the
backward matmuls (and a replayed region saves them as its inputs). `WeightRefs` breaks that tie:
while a block runs forward, saved tensors that live in a GPU parameter buffer are stored as
(unit, offset, size, stride) references and resolved in backward against whichever buffer holds
that unit then. The weights can leave the window and be re-delivered; the kept activations stay.
Weights read in place (a resident unit's own copy, `keep`) are saved as they are. Every other
saved tensor goes to the block's offload (slidedp/activations/offload.py) if it has
one, else it is kept as it is.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from slidedp.activations.offload import BlockOffload, Offloaded


@dataclass(frozen=True)
class _WeightRef:
    unit: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class WeightRefs:
    """The saved_tensors_hooks of a block's forward."""

    def __init__(self, buffers: list[torch.Tensor], resolve: Callable[[int], torch.Tensor]):
        self._ptrs = {b.untyped_storage().data_ptr() for b in buffers}
        self._kept: set[int] = set()
        self._resolve = resolve

    def keep(self, weights: torch.Tensor) -> None:
        """Weights computed from outside the buffers (a resident unit's own copy): saved as they
        are, never offloaded (they stay on the GPU anyway)."""
        self._kept.add(weights.untyped_storage().data_ptr())

    def during_forward_of(self, unit: int, offload: BlockOffload | None = None):
        """Context for one block's forward: weights of `unit` as references, the rest to
        `offload` (None: kept as they are)."""

        def pack(t: torch.Tensor):
            ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else None
            if ptr in self._ptrs:
                return _WeightRef(unit, t.storage_offset(), t.size(), t.stride())
            return t if offload is None or ptr in self._kept else offload.pack(t)

        def unpack(x):
            if isinstance(x, _WeightRef):
                return torch.as_strided(self._resolve(x.unit), x.size, x.stride, x.offset)
            return x.tensor() if isinstance(x, Offloaded) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
