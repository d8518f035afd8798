"""GPU time of a call, by CUDA events around it (the GPU benches' one timer)."""

from collections.abc import Callable

import torch


def cuda_times(fn: Callable[[], object], *, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` on the current stream, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times
