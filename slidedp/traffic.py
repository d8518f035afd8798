"""Per-rank byte counters for the routes, reset every step (checked against the paper's table)."""

from dataclasses import dataclass, fields


@dataclass
class Traffic:
    """Bytes this rank moved during one step."""

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
    offload_d2h: int = 0
    """Saved-activation bytes offloaded to host memory in forward (PCIe)."""
    offload_h2d: int = 0
    """Offloaded activation bytes brought back to the GPU for backward (PCIe)."""

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_metrics(self) -> dict[str, float]:
        return {f"traffic_{f.name}_mb": getattr(self, f.name) / 2**20 for f in fields(self)}
