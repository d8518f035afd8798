"""An inter-node link's rates: what the step-time model (slidedp/plan/steptime.py) charges for
the cross-node all-reduce of a run over several nodes (slidedp/nodes.py).

One `Link` is one JSON file; `slidedp/plan/rates/links/*.json` ship the links we plan for (from
published line rates, labelled "spec": no multi-node machine has been lent to measure one).
The nodes are rail-optimised, as DGX-class H100/H200 nodes are: `nics` NICs per node and local
rank r on NIC r * nics // ranks, so the ranks of one local index meet over their own rail.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

LINKS = Path(__file__).parent / "rates" / "links"
"""The shipped links (`--link NAME` finds them by name)."""


@dataclass(frozen=True)
class Link:
    """One node's network to the others."""

    name: str
    """In words, e.g. "8 x 400 Gb/s InfiniBand NDR per node"."""
    source: Literal["measured", "spec"]
    """"measured": by nccl-tests on the nodes; "spec": from published line rates (not measured)."""
    nic_gbits: float
    """One NIC's line rate, Gb/s each way."""
    nics: int
    """NICs per node."""
    efficiency: float
    """Share of the line rate a large all-reduce reaches (NCCL's bus bandwidth / line rate)."""
    latency_s: float
    """Fixed cost of one step of a ring across the link, seconds."""
    note: str = ""
    """Where each figure comes from."""

    def __post_init__(self):
        if self.nic_gbits <= 0 or self.nics < 1 or not 0 < self.efficiency <= 1 or self.latency_s < 0:
            raise ValueError(f"link {self.name!r}: nic_gbits > 0, nics >= 1, 0 < efficiency <= 1 "
                             "and latency_s >= 0 are required")

    @property
    def nic_bytes_per_s(self) -> float:
        """What one NIC moves each way, bytes per second."""
        return self.nic_gbits / 8 * 1e9 * self.efficiency

    def nic_of(self, local_rank: int, ranks: int) -> int:
        """The NIC local rank `local_rank` of `ranks` sends on (ranks share one when fewer NICs)."""
        return local_rank * self.nics // ranks

    def all_reduce_s(self, nbytes: float, nodes: int) -> tuple[float, float]:
        """A ring all-reduce of `nbytes` over `nodes` (one rank per node): (fixed seconds, bytes
        each rank sends), 2 (N-1)/N of the buffer in 2 (N-1) steps."""
        return 2 * (nodes - 1) * self.latency_s, 2 * (nodes - 1) / nodes * nbytes


def load_link(name_or_path: str) -> Link:
    """A link file by path, or by the name of a shipped one (`ib400x8` for links/ib400x8.json)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = LINKS / f"{name_or_path}.json"
        if not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in LINKS.glob("*.json")))
            raise FileNotFoundError(f"no link file {name_or_path!r} (shipped: {shipped})")
    try:
        return Link(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a link file ({e})") from None
