"""Host memory bandwidth, measured as STREAM's triad: a[i] = b[i] + s * c[i] over FP32 arrays
far larger than the caches, counted as STREAM counts it (12 bytes per element: two reads and
one write; write-allocate traffic is not counted).

torch runs the triad as one fused pass (`torch.add(b, c, alpha=s, out=a)`) on its intra-op
threads; the best of a few repetitions is the figure, as in STREAM. A plain copy (torch
`copy_`) is not a bandwidth figure: on the 16-core H200 host it reached 68 GB/s while the Adam
kernel moved 144 GB/s (docs/PERFORMANCE.md).
"""

import time

import torch

TRIAD_BYTES_PER_ELEM = 12
"""Bytes STREAM counts per element of the triad (read b and c, write a; FP32)."""


def triad_gbs(*, threads: int, elems: int = 1 << 26, repeats: int = 5) -> float:
    """STREAM triad GB/s (10^9 bytes/s) with `threads` threads over arrays of `elems` FP32
    (default 64 Mi elements: 768 MiB in all)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, c = torch.empty(elems), torch.rand(elems), torch.rand(elems)
        torch.add(b, c, alpha=3.0, out=a)  # first touch: page faults out of the timing
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return elems * TRIAD_BYTES_PER_ELEM / best / 1e9
