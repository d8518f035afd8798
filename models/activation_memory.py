"""What a forward keeps for backward: the bytes of the distinct storages autograd saves.

Counted through saved_tensors_hooks, so it sees what every op and custom kernel saves (liger's
autograd Functions included), not an estimate. Storages are counted whole and once: a saved view
keeps its whole storage alive, and a tensor saved by several ops exists once.
"""

from collections.abc import Callable, Iterable

import torch


class SavedStorages(torch.autograd.graph.saved_tensors_hooks):
    """While active, records `sizes`: data pointer -> bytes of each distinct storage autograd
    saves. Storages shared with `exclude` (the parameters: resident, or references under
    SlideDP's WeightRefs) are not recorded."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.sizes: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip and storage.nbytes():
                self.sizes[storage.data_ptr()] = storage.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self) -> "SavedStorages":
        super().__enter__()
        return self

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())


def saved_bytes(fn: Callable[..., torch.Tensor], *args: torch.Tensor,
                exclude: Iterable[torch.Tensor] = ()) -> tuple[int, torch.Tensor]:
    """(bytes autograd saves while `fn(*args)` runs, fn's output), `exclude` not counted."""
    with SavedStorages(exclude) as saved:
        out = fn(*args)
    return saved.nbytes, out
