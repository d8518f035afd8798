"""Per-rank byte counters for the routes, reported per step (checked against the paper's table)."""

from dataclasses import asdict, dataclass


@dataclass
class Traffic:
    """Bytes this rank moved since start, by route."""

    h2d: int = 0
    """Host -> GPU parameter bytes (PCIe)."""
    d2h: int = 0
    """GPU -> host gradient bytes (PCIe)."""
    all_gather: int = 0
    """Parameter bytes received from peers over the GPU interconnect (sharded delivery)."""
    reduce_scatter: int = 0
    """Gradient bytes sent to peers over the GPU interconnect (GPU-side reduction)."""
    host_reduce: int = 0
    """Gradient bytes this rank read from host memory to sum peers' gradients (CPU reduction)."""
    inter_node: int = 0
    """Gradient bytes of this rank's shard all-reduced across the nodes (several nodes)."""
    offload_d2h: int = 0
    """Saved-activation bytes offloaded to host memory in forward (PCIe)."""
    offload_h2d: int = 0
    """Offloaded activation bytes brought back to the GPU for backward (PCIe)."""
    gpu_update_h2d: int = 0
    """FP32 master and moments copied to the GPU for its update of the embedding (PCIe)."""
    gpu_update_d2h: int = 0
    """The embedding's state copied home after its update on the GPU (PCIe)."""

    def __post_init__(self) -> None:
        self._reported = asdict(self)

    def take(self) -> dict[str, float]:
        """MiB moved since the previous call, per route. The counters only grow (each has one
        writing thread), so work that runs between two steps (a step's updates may) is counted
        once, by the next report, and never lost to a reset."""
        totals = asdict(self)
        since = {f"traffic_{name}_mb": (total - self._reported[name]) / 2**20
                 for name, total in totals.items()}
        self._reported = totals
        return since
