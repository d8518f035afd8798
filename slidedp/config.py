"""The `[slidedp]` TOML section."""

from dataclasses import dataclass
from typing import Literal

DeliveryRoute = Literal["replicated", "sharded"]
"""Host->GPU parameter routes (slidedp/delivery.py)."""
ReductionRoute = Literal["gpu", "cpu"]
"""GPU->host gradient routes (slidedp/update.py)."""
ActivationPolicy = Literal["keep", "recompute", "selective"]
"""Per-block activation policies (slidedp/activations.py)."""


@dataclass
class SlideDPConfig:
    """Knobs of the host-resident streaming runtime (used when parallelism.mode = "slidedp")."""

    delivery: DeliveryRoute = "sharded"
    """Parameter route host->GPU: "replicated" (every rank copies the whole block) or "sharded"
    (each rank copies 1/R, then all-gather on the GPUs)."""
    reduction: ReductionRoute = "gpu"
    """Gradient route GPU->host: "gpu" (reduce-scatter on the GPUs, one aggregated shard per rank
    returns) or "cpu" (every rank returns its full gradient, the host sums)."""
    window_slots: int = 3
    """GPU parameter slots for transformer blocks (>= 2: one computing, one being delivered)."""
    chunk_mib: float = 32.0
    """Chunk size in MiB (at most 1024) for the cast/H2D and D2H/update pipelines inside a block."""
    activation: ActivationPolicy = "recompute"
    """Default activation policy per block: "keep" (on GPU), "recompute" (full recompute) or
    "selective" (recompute all but attention, whose outputs are kept)."""
    keep_blocks: int = 0
    """The first N blocks keep activations on GPU regardless of `activation` (seam for the
    per-block elastic policy)."""
    cpu_threads: int = 0
    """CPU Adam threads per rank; 0 = this rank's share of the host's cores."""
    bf16_shadow: bool = True
    """Keep a BF16 copy of the master weights in shared memory, written by the fused Adam pass,
    so delivery is a plain copy (2 bytes/param more host memory, half the cast work)."""
    check_host_memory: bool = True
    """Refuse to start when the host state exceeds MemAvailable (off for VMs whose memory grows
    on demand and under-reports at start)."""
