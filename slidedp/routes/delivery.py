"""Parameter delivery: host BF16 shadow (or the FP32 master, cast on the GPU; or a BF16 master
as it is) -> a GPU buffer; the delivery routes, one class each, that the runtime runs and the
step-time model simulates.

Without the shadow each chunk of the FP32 master goes over PCIe as it is (the mapping is
registered, so the copy is DMA from the shared bytes) into a device staging buffer and is cast to
BF16 there: twice the bytes of the shadow, but no CPU pass, whose one-thread cast would bound the
copy instead.

Two routes over the same host layout:
  replicated  every rank copies the whole unit over its own PCIe link (R x host traffic);
  sharded     rank r copies only its shard, then one all-gather over NVLink rebuilds the unit
              (aggregate host traffic independent of R).
Each declares, without an instance: the span of a unit each rank copies (`span`, and its length
`copy_elems`), the ranks whose updates a rank's delivery waits for (`gate_ranks`), and how the
rebuild adds itself to the step-time model's graph (`simulate_rebuild`, on
slidedp/plan/steptime.py's builder).
"""

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from slidedp.collectives import all_gather_single
from slidedp.layout import Unit
from slidedp.streams import Streams
from slidedp.traffic import Traffic

if TYPE_CHECKING:
    from slidedp.host_state import SharedHostState
    from slidedp.plan.steptime import StepBuilder


class Delivery:
    """Issues one unit's host->device copy (and its rebuild) on the delivery stream."""

    name: ClassVar[str]
    """The slidedp.delivery value."""

    @staticmethod
    def span(unit: Unit, rank: int, world: int) -> tuple[int, int]:
        """The elements [lo, hi) of `unit` that `rank` copies."""
        raise NotImplementedError

    @staticmethod
    def copy_elems(elems: int, owners: int) -> int:
        """Elements of a unit of `elems` that each rank copies (`owners` ranks own a shard)."""
        raise NotImplementedError

    @staticmethod
    def gate_ranks(rank: int, world: int) -> range:
        """The ranks whose update of a unit `rank`'s delivery of it waits for (the shards it
        reads)."""
        raise NotImplementedError

    @staticmethod
    def simulate_rebuild(b: "StepBuilder", elems: int, out: list[tuple[int, int]]
                         ) -> list[tuple[int, int]]:
        """After every rank's copy (`out[r]`: its delivery thread's last task, its copy's
        arrival): the unit's arrival on each rank."""
        return out

    def __init__(self, state: "SharedHostState", streams: Streams, *, rank: int, world: int,
                 group: dist.ProcessGroup | None, chunk_elems: int, traffic: Traffic):
        self.state, self.streams = state, streams
        self.rank, self.world, self.group = rank, world, group
        self.chunk, self.traffic = chunk_elems, traffic
        self.stream = streams.new_stream()
        self.fp32_staging: torch.Tensor | None = None
        # The BF16 copy to read: the shadow, or a BF16 master itself.
        self.source = "shadow" if state.plan.bf16_shadow else "master"
        if not state.plan.bf16_shadow and not state.plan.bf16_master:
            # One buffer suffices: the copy of chunk k+1 queues behind the cast of chunk k on the
            # delivery stream, and the cast takes a few percent of the copy's time.
            with streams.use(self.stream):
                self.fp32_staging = torch.empty(chunk_elems, dtype=torch.float32,
                                                device=streams.device)

    def wait_version(self, unit: Unit, version: int) -> None:
        """Version gate: the unit's step-(version-1) update must be finished on every shard this
        rank reads (its own for sharded delivery, all of them for replicated)."""
        gate = self.gate_ranks(self.rank, self.world)
        counters = self.state.version[unit.index][gate.start:gate.stop]
        self.state.wait_counter(counters, version, what=f"version of unit {unit.index}")

    def deliver(self, unit: Unit, dst: torch.Tensor,
                on_gpu: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
                ) -> tuple[torch.cuda.Event | None, torch.Tensor]:
        """Copy `unit` into `dst` (flat bf16, unit.padded elements); returns the event that marks
        its arrival on the device and the tensor to compute from, `dst`. `on_gpu`: this rank's
        shard already on the GPU in BF16 (a resident unit, slidedp/gpu_update.py) and the event
        it is complete at, copied on the device instead of from the host; on one rank, where
        that shard is the whole unit, nothing is copied: compute reads it where it is, once it is
        complete (a device copy would move 4 B/param per use for nothing)."""
        if on_gpu is not None and self.world == 1:
            return on_gpu[1], on_gpu[0]
        lo, hi = self.span(unit, self.rank, self.world)
        with self.streams.use(self.stream):
            if on_gpu is not None:  # sharded: the shard is all this rank copies
                source, ready = on_gpu
                self.streams.wait(ready, self.stream)
                if self.streams.is_cuda:  # freed by an invalidate, it waits for this copy
                    source.record_stream(self.stream)
                dst[lo:hi].copy_(source)
            else:
                self._copy_from_host(unit, dst, lo, hi)
            self._rebuild(unit, dst, lo, hi)
            return self.streams.record(self.stream), dst

    def _rebuild(self, unit: Unit, dst: torch.Tensor, lo: int, hi: int) -> None:
        """The whole unit in `dst` from this rank's copied span [lo, hi)."""

    def _copy_from_host(self, unit: Unit, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Elements [lo, hi) of `unit` from host memory into `dst`, chunk by chunk, on the
        delivery stream (the caller's current one)."""
        for start in range(lo, hi, self.chunk):
            end = min(start + self.chunk, hi)
            if self.fp32_staging is None:
                dst[start:end].copy_(self.state.unit_view(self.source, unit.index, start, end),
                                     non_blocking=True)
                continue
            staged = self.fp32_staging[:end - start]
            staged.copy_(self.state.unit_view("master", unit.index, start, end),
                         non_blocking=True)
            dst[start:end].copy_(staged)  # the cast, on the device
        self.traffic.h2d += (hi - lo) * (2 if self.fp32_staging is None else 4)


class ReplicatedDelivery(Delivery):
    """Every rank copies the whole unit."""

    name = "replicated"

    @staticmethod
    def span(unit, rank, world):
        return 0, unit.padded

    @staticmethod
    def copy_elems(elems, owners):
        return elems

    @staticmethod
    def gate_ranks(rank, world):
        return range(world)


class ShardedDelivery(Delivery):
    """Every rank copies its shard; an all-gather rebuilds the unit."""

    name = "sharded"

    @staticmethod
    def span(unit, rank, world):
        return unit.shard(rank, world)

    @staticmethod
    def copy_elems(elems, owners):
        return elems // owners

    @staticmethod
    def gate_ranks(rank, world):
        return range(rank, rank + 1)

    @staticmethod
    def simulate_rebuild(b, elems, out):
        if b.owners == 1:
            return out
        gathered = b.collective(2 * elems, b.rates.all_gather_gbs, [a for _, a in out],
                                lane="dstream", kind="collective")
        return [(t, gathered) for t, _ in out]

    def _rebuild(self, unit, dst, lo, hi):
        if self.world > 1:
            all_gather_single(dst[:unit.padded], dst[lo:hi], group=self.group)
            self.traffic.all_gather += (unit.padded - (hi - lo)) * 2
