"""Parameter delivery: host BF16 (or FP32 cast chunk by chunk) -> a GPU buffer.

Two routes over the same host layout:
  replicated  every rank copies the whole unit over its own PCIe link (R x host traffic);
  sharded     rank r copies only its shard, then one all-gather over NVLink rebuilds the unit
              (aggregate host traffic independent of R).
"""

from typing import get_args

import torch
import torch.distributed as dist

from slidedp.collectives import all_gather_single
from slidedp.config import DeliveryRoute
from slidedp.host_state import SharedHostState
from slidedp.layout import Unit
from slidedp.streams import Streams
from slidedp.traffic import Traffic


class Delivery:
    """Issues one unit's host->device copy (and all-gather) on the delivery stream."""

    def __init__(self, state: SharedHostState, streams: Streams, *, route: DeliveryRoute,
                 rank: int, world: int, group: dist.ProcessGroup | None, chunk_elems: int,
                 traffic: Traffic):
        if route not in get_args(DeliveryRoute):
            raise ValueError(f"slidedp.delivery must be one of {get_args(DeliveryRoute)}, "
                             f"got {route!r}")
        self.state, self.streams, self.route = state, streams, route
        self.rank, self.world, self.group = rank, world, group
        self.chunk, self.traffic = chunk_elems, traffic
        self.stream = streams.new_stream()
        self.cast_staging: list[torch.Tensor] = []
        self._staging_events: list[torch.cuda.Event | None] = [None, None]
        if not state.plan.bf16_shadow:
            # Two pinned buffers: the CPU casts chunk k+1 while chunk k is in flight.
            pin = streams.is_cuda
            self.cast_staging = [torch.empty(chunk_elems, dtype=torch.bfloat16, pin_memory=pin)
                                 for _ in range(2)]

    def wait_version(self, unit: Unit, version: int) -> None:
        """Version gate: the unit's step-(version-1) update must be finished on every shard this
        rank reads (its own for sharded delivery, all of them for replicated)."""
        counters = self.state.version[unit.index]
        if self.route == "sharded":
            counters = counters[self.rank:self.rank + 1]
        self.state.wait_counter(counters, version, what=f"version of unit {unit.index}")

    def _source(self, unit: Unit, start: int, end: int, k: int) -> torch.Tensor:
        if self.state.plan.bf16_shadow:
            return self.state.unit_view("shadow", unit.index, start, end)
        buf = self.cast_staging[k % 2][:end - start]
        Streams.synchronize(self._staging_events[k % 2])  # its previous copy has left the buffer
        buf.copy_(self.state.unit_view("master", unit.index, start, end))
        return buf

    def deliver(self, unit: Unit, dst: torch.Tensor) -> torch.cuda.Event | None:
        """Copy `unit` into `dst` (flat bf16, unit.padded elements); returns the event that marks
        its arrival on the device."""
        lo, hi = (0, unit.padded) if self.route == "replicated" else unit.shard(self.rank, self.world)
        with self.streams.use(self.stream):
            for k, start in enumerate(range(lo, hi, self.chunk)):
                end = min(start + self.chunk, hi)
                dst[start:end].copy_(self._source(unit, start, end, k), non_blocking=True)
                if self.cast_staging:
                    self._staging_events[k % 2] = self.streams.record(self.stream)
            self.traffic.h2d += (hi - lo) * 2
            if self.route == "sharded" and self.world > 1:
                all_gather_single(dst[:unit.padded], dst[lo:hi], group=self.group)
                self.traffic.all_gather += (unit.padded - (hi - lo)) * 2
            return self.streams.record(self.stream)
