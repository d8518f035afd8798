"""Gradient return: what every reduction route (slidedp/routes/gpu.py, cpu.py, locked.py) is, a
class that the runtime runs and the step-time model simulates.

On every route rank r ends up holding the summed gradient of its shard of the unit, chunk by chunk,
and updates that slice of the shared state (its own cores, no global lock). The D2H copies of all
chunks are issued up front so Adam starts on the first chunk while the rest are still in flight.
A return is split where the other ranks stop mattering (`GradientReturn.start`), so a rank
starts its returns in the order every rank shares and updates in an order of its own
(slidedp/update_order.py).

Each route declares, as class attributes and class methods (no instance needed): the host
regions it needs (`regions`), where a step's gradients wait for their updates (`hold`, a
slidedp/holds.py strategy), whether its sum makes every update wait for the step's end
(`defers_updates`), the elements each rank copies home per unit (`home_elems`) and how a
returned gradient adds itself to the step-time model's graph (`simulate`, on
slidedp/plan/steptime.py's builder).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from slidedp.holds import HOLDS, Hold
from slidedp.layout import Unit
from slidedp.streams import Streams
from slidedp.traffic import Traffic

if TYPE_CHECKING:
    from slidedp.host_state import HostStatePlan, SharedHostState
    from slidedp.plan.steptime import StepBuilder


@dataclass
class Returned:
    """One micro-batch's gradient of a unit on its way home (this rank's shard)."""

    unit: Unit
    """The unit."""
    token: int
    """The micro-batch's token (the cpu route's staging handshake)."""
    shard: torch.Tensor | None
    """gpu route: the reduced shard on the GPU until it is copied home."""
    norm: bool
    """cpu route: the host sum still owes the step's squared norm."""


class GradientReturn:
    """Brings a unit's summed gradient shard home in two parts: `start` (the part that involves
    the other ranks), then `chunks` (the summed shard, chunk by chunk, in unit-local
    coordinates) or, on the gpu route, `copy_home` (the whole shard into a host region). Every
    rank must start the returns in the same order; what follows touches only this rank's shard,
    in any order, except that the cpu route's first `chunks` of a unit waits until every rank
    has started its return."""

    name: ClassVar[str]
    """The slidedp.reduction value."""
    defers_updates: ClassVar[bool] = False
    """The sum is complete only when every rank's backward is: every update waits for the step's
    end (slidedp/host_state.py's updates_deferred)."""
    shared_sum: ClassVar[bool] = False
    """The ranks add into one FP32 sum under one host lock (HostStatePlan.grad_lock)."""
    keeps_on_gpu: ClassVar[bool] = False
    """The reduced shard is on the GPU before it goes home: a GPU update can read it there."""
    autopolicy: ClassVar[bool] = True
    """AutoPolicy weighs it (a peer style's own route is not offered to SlideDP runs)."""

    @classmethod
    def regions(cls, *, deferred: bool, accumulate: bool, shadow: bool,
                redo: bool) -> frozenset[str]:
        """The optional host regions (slidedp/host_state.py) the route needs; accumulated
        micro-batches are summed in FP32."""
        return frozenset({"grad_accum"} if accumulate else ())

    @classmethod
    def hold(cls, plan: "HostStatePlan", *, n_micro: int, deferred: bool) -> Hold:
        """Where a step of `n_micro` micro-batches keeps its gradients until their updates
        (raises if `plan`'s regions have no place for them)."""
        if n_micro > 1:
            if not plan.grad_accum:
                raise ValueError(f"SlideDP: {n_micro} micro-batches per step need the FP32 "
                                 "accumulation buffer: start with training.grad_accum_steps > 1")
            return HOLDS["grad_accum"]
        if plan.redo:
            raise ValueError('SlideDP: speculative updates need slidedp.reduction = "gpu" and '
                             "one micro-batch per step")
        return HOLDS[cls._one_micro_hold(plan, deferred=deferred)]

    @classmethod
    def _one_micro_hold(cls, plan: "HostStatePlan", *, deferred: bool) -> str:
        raise NotImplementedError

    @staticmethod
    def home_elems(elems: int, owners: int) -> int:
        """Elements of a unit of `elems` that each rank copies home (`owners` ranks own a
        shard)."""
        return elems

    @classmethod
    def simulate(cls, b: "StepBuilder", unit: int, host: list[int], gpu: list[int], micro: int,
                 update: bool) -> None:
        """The update threads' job for one returned gradient on every rank (gradient_flow.py's
        return job): `host[r]`, `gpu[r]` are rank r's tasks that issued and computed the unit's
        backward; `update`: the unit's AdamW follows at once."""
        raise NotImplementedError

    def __init__(self, state: "SharedHostState", streams: Streams, *, rank: int, world: int,
                 group: dist.ProcessGroup | None, chunk_elems: int, traffic: Traffic,
                 max_unit: int, threads: int, barrier_per_chunk: bool = False,
                 cross: dist.ProcessGroup | None = None):
        """`barrier_per_chunk`: on the cpu route every rank waits for every other after each
        chunk it copied home (SlideFormer-style). `cross` (gpu route, several nodes): the ranks
        of this local rank on every node, whose shards are all-reduced after the node's
        reduce-scatter (slidedp/nodes.py)."""
        self.state, self.streams = state, streams
        self.rank, self.world, self.group, self.cross = rank, world, group, cross
        self.chunk, self.traffic, self.threads = chunk_elems, traffic, threads
        self.barrier_per_chunk = barrier_per_chunk and world > 1
        self.stream = streams.new_stream()
        self._normsq: torch.Tensor | None = None
        self._norm_done: torch.cuda.Event | None = None
        self._host_normsq = 0.0
        self._max_shard = max_unit // world

    def take_normsq(self) -> float:
        """Squared norm of the shards returned with `norm=True` since the last call: summed on
        the GPU by the gpu route, where it costs nothing, and inside the host sum's single pass
        by the cpu route; the locked route takes it once its sum is complete."""
        value, self._host_normsq = self._host_normsq, 0.0
        if self._normsq is not None:
            Streams.synchronize(self._norm_done)
            value, self._normsq = value + float(self._normsq), None
        return value

    def start(self, unit: Unit, flat_grad: torch.Tensor, ready: torch.cuda.Event | None,
              token: int, *, norm: bool, home: bool = True) -> Returned:
        """The part of the return that involves the other ranks, issued on the return stream.
        With `norm` the shard's squared norm joins `take_normsq` (the cpu route's at its first
        sum). `home=False` (gpu route): the shard is used on the GPU and never copied home."""
        with self.streams.use(self.stream):
            self.streams.wait(ready, self.stream)
            # The caching allocator must not hand flat_grad's memory out again before we're done.
            if self.streams.is_cuda:
                flat_grad.record_stream(self.stream)
            return self._start(unit, flat_grad, token, norm=norm, home=home)

    def _start(self, unit: Unit, flat_grad: torch.Tensor, token: int, *, norm: bool,
               home: bool) -> Returned:
        raise NotImplementedError

    def chunks(self, returned: Returned, *, release: bool = True) -> Iterator:
        """The summed gradient of this rank's shard, chunk by chunk: (start, end, host chunk)
        in unit-local coordinates, each valid until the next. On the cpu route the sum waits for
        every rank's staging copy; `release=False` keeps the copies for a second pass (then
        `release` them)."""
        lo, hi = returned.unit.shard(self.rank, self.world)
        with self.streams.use(self.stream):
            yield from self._chunks(returned, lo, hi, release=release)

    def _chunks(self, returned: Returned, lo: int, hi: int, *, release: bool) -> Iterator:
        raise NotImplementedError
