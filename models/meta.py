"""Modules built on the meta device for their shapes, without running their random init."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# What the reset_parameters of the torch modules in our models call (Linear, Embedding).
_INITS = frozenset({nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_})


class _SkipInit(TorchFunctionMode):
    """Returns an nn.init function's meta tensor untouched. On meta tensors the random fills run
    torch._refs' Python kernels, and the first of them imports torch._dynamo: over a second per
    process (launcher, each rank) for values that a meta tensor does not hold anyway."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _INITS:
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:  # a tensor put elsewhere on purpose keeps its init
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """`with torch.device("meta")` that skips nn.init: parameters have shapes and no values,
    to be materialized (to_empty) and initialized or loaded by the caller."""
    with torch.device("meta"), _SkipInit():
        yield
