"""What a forward keeps for backward: the bytes of the distinct storages autograd saves.

Counted through saved_tensors_hooks, so it sees what every op and custom kernel saves (liger's
autograd Functions included), not an estimate. Storages are counted whole and once: a saved view
keeps its whole storage alive, and a tensor saved by several ops exists once.
"""

from collections.abc import Callable, Iterable

import torch


def saved_bytes(fn: Callable[..., torch.Tensor], *args: torch.Tensor,
                exclude: Iterable[torch.Tensor] = ()) -> tuple[int, torch.Tensor]:
    """(bytes autograd saves while `fn(*args)` runs, fn's output). Tensors sharing storage with
    `exclude` (the parameters: resident, or references under SlideDP's WeightRefs) are not
    counted."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(seen.values()), out
