"""Gradient return (GPU->host, by route) and the layer-wise CPU AdamW update.

Three reduction routes over the same host layout:
  gpu     reduce-scatter on the GPUs, then each rank copies only its aggregated shard (1/R) home;
  cpu     every rank copies its full gradient home into its staging region and each owner sums
          the R copies of its shard on the host;
  locked  every rank adds its full gradient into one shared FP32 sum, one chunk at a time under
          one host lock (MegaTrain-style, slidedp/peer_styles.py); the sum is complete only when
          every rank's backward is, so its updates wait for the step's end.
Each way rank r ends up holding the summed gradient of its shard of the unit, chunk by chunk,
and updates that slice of the shared state (its own cores, no global lock). The D2H copies of all
chunks are issued up front so Adam starts on the first chunk while the rest are still in flight.
A return is split where the other ranks stop mattering (`GradientReturn.start`), so a rank
starts its returns in the order every rank shares and updates in an order of its own
(slidedp/update_order.py).
"""

from dataclasses import dataclass
from typing import get_args

import torch
import torch.distributed as dist

from slidedp import cpu_adam
from slidedp.collectives import reduce_scatter_single
from slidedp.config import ReductionRoute
from slidedp.host_state import SharedHostState
from slidedp.layout import Unit
from slidedp.streams import Streams
from slidedp.traffic import Traffic


@dataclass(frozen=True)
class AdamHyper:
    """AdamW hyper-parameters of the host optimizer."""

    beta1: float
    """First-moment decay."""
    beta2: float
    """Second-moment decay."""
    eps: float
    """Added after the square root."""
    weight_decay: float
    """Decoupled weight decay."""


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
    """Brings a unit's summed gradient shard home in two parts: `start` (gpu: the
    reduce-scatter; cpu: this rank's full gradient into its staging region), then `chunks` (the
    summed shard, chunk by chunk, in unit-local coordinates) or, on the gpu route, `copy_home`
    (the whole shard into a host region). Every rank must start the returns in the same order;
    what follows touches only this rank's shard, in any order, except that the cpu route's first
    `chunks` of a unit waits until every rank has started its return."""

    def __init__(self, state: SharedHostState, streams: Streams, *, route: ReductionRoute,
                 rank: int, world: int, group: dist.ProcessGroup | None, chunk_elems: int,
                 traffic: Traffic, max_unit: int, threads: int, barrier_per_chunk: bool = False,
                 cross: dist.ProcessGroup | None = None):
        """`barrier_per_chunk`: on the cpu route every rank waits for every other after each
        chunk it copied home (SlideFormer-style). `cross` (gpu route, several nodes): the ranks
        of this local rank on every node, whose shards are all-reduced after the node's
        reduce-scatter (slidedp/nodes.py)."""
        if route not in get_args(ReductionRoute):
            raise ValueError(f"slidedp.reduction must be one of {get_args(ReductionRoute)}, "
                             f"got {route!r}")
        self.state, self.streams, self.route = state, streams, route
        self.rank, self.world, self.group, self.cross = rank, world, group, cross
        self.chunk, self.traffic, self.threads = chunk_elems, traffic, threads
        self.barrier_per_chunk = barrier_per_chunk and world > 1
        self.stream = streams.new_stream()
        self._normsq: torch.Tensor | None = None
        self._norm_done: torch.cuda.Event | None = None
        self._host_normsq = 0.0
        self._summed: dict[int, tuple[Unit, int]] = {}  # locked route: unit -> its last token
        self._max_shard = max_unit // world
        # gpu route: the pinned receive buffer of chunks(), made when first needed (a gradient
        # copied home into a host region needs none); cpu route: the host sum's chunk.
        self._recv: torch.Tensor | None = None
        self.sum_buf = torch.empty(chunk_elems, dtype=torch.float32) if route == "cpu" else None
        # locked route on a GPU: one chunk of a gradient on its way to the shared sum.
        self._send_buf = (torch.empty(chunk_elems, dtype=torch.bfloat16, pin_memory=True)
                          if route == "locked" and streams.is_cuda else None)

    def take_normsq(self) -> float:
        """Squared norm of the shards returned with `norm=True` since the last call: summed on
        the GPU by the gpu route, where it costs nothing, and inside the host sum's single pass
        by the cpu route. The locked route's shared sum is complete once every rank has added to
        it, so it waits for that and takes the norm of this rank's shards then, always."""
        self._locked_normsq()
        value, self._host_normsq = self._host_normsq, 0.0
        if self._normsq is not None:
            Streams.synchronize(self._norm_done)
            value, self._normsq = value + float(self._normsq), None
        return value

    def take_device_normsq(self) -> torch.Tensor:
        """gpu route: what `take_normsq` returns, as a device tensor that the current stream
        waits for on the device, not the host: for a step whose every gradient stays on the
        GPU."""
        normsq, self._normsq = self._normsq, None
        self.streams.wait(self._norm_done)
        return normsq

    def start(self, unit: Unit, flat_grad: torch.Tensor, ready: torch.cuda.Event | None,
              token: int, *, norm: bool, home: bool = True) -> Returned:
        """The part of the return that involves the other ranks, issued on the return stream.
        With `norm` the shard's squared norm joins `take_normsq` (the cpu route's at its first
        sum). `home=False` (gpu route): the shard is used on the GPU and never copied home."""
        lo, hi = unit.shard(self.rank, self.world)
        with self.streams.use(self.stream):
            self.streams.wait(ready, self.stream)
            # The caching allocator must not hand flat_grad's memory out again before we're done.
            if self.streams.is_cuda:
                flat_grad.record_stream(self.stream)
            if self.route == "cpu":
                self._send(unit, flat_grad, token)
                return Returned(unit, token, shard=None, norm=norm)
            if self.route == "locked":
                self._add_locked(unit, flat_grad, token)
                return Returned(unit, token, shard=None, norm=False)
            shard = flat_grad  # one rank: its gradient is the sum
            if self.world > 1:
                shard = torch.empty(hi - lo, dtype=flat_grad.dtype, device=flat_grad.device)
                reduce_scatter_single(shard, flat_grad, group=self.group)
                self.traffic.reduce_scatter += (unit.padded - (hi - lo)) * 2
            if self.cross is not None:  # the other nodes' sums of the same shard
                dist.all_reduce(shard, group=self.cross)
                self.traffic.inter_node += (hi - lo) * 2
            if norm:
                sq = torch.linalg.vector_norm(shard, dtype=torch.float32).square()
                self._normsq = sq if self._normsq is None else self._normsq + sq
                self._norm_done = self.streams.record(self.stream)
            if home:  # it goes home once, by chunks() or copy_home()
                self.traffic.d2h += (hi - lo) * 2
            return Returned(unit, token, shard=shard, norm=False)

    def copy_home(self, returned: Returned, into: torch.Tensor) -> torch.cuda.Event | None:
        """gpu route: copy the reduced shard into `into` (registered host memory of its size)
        without waiting; returns the event that marks its arrival."""
        with self.streams.use(self.stream):
            into.copy_(returned.shard, non_blocking=True)
            returned.shard = None  # the stream-ordered allocator keeps it until the copy is done
            return self.streams.record(self.stream)

    def chunks(self, returned: Returned, *, release: bool = True):
        """The summed gradient of this rank's shard, chunk by chunk: (start, end, host chunk)
        in unit-local coordinates, each valid until the next. On the cpu route the sum waits for
        every rank's staging copy; `release=False` keeps the copies for a second pass (then
        `release` them)."""
        lo, hi = returned.unit.shard(self.rank, self.world)
        with self.streams.use(self.stream):
            if self.route == "gpu":
                yield from self._copy_chunks(returned, lo, hi)
            elif self.route == "locked":
                yield from self._take_locked(returned.unit, lo, hi)
            else:
                yield from self._sum_chunks(returned, lo, hi)
                if release:
                    self.release(returned)

    def release(self, returned: Returned) -> None:
        """cpu route: this rank is done with every rank's staging copy of the unit."""
        self.state.consumed[returned.unit.index, self.rank] = returned.token

    def _copy_chunks(self, returned: Returned, lo: int, hi: int):
        if self._recv is None:
            self._recv = torch.empty(self._max_shard, dtype=torch.bfloat16,
                                     pin_memory=self.streams.is_cuda)
        events = []
        for start in range(0, hi - lo, self.chunk):
            end = min(start + self.chunk, hi - lo)
            self._recv[start:end].copy_(returned.shard[start:end], non_blocking=True)
            events.append((start, end, self.streams.record(self.stream)))
        returned.shard = None
        for start, end, ev in events:
            Streams.synchronize(ev)
            yield lo + start, lo + end, self._recv[start:end]

    def _send(self, unit: Unit, flat_grad: torch.Tensor, token: int) -> None:
        st = self.state
        # Buffer release: every owner must have consumed our previous return of this unit, whose
        # token is the one we last marked ready (not token - 1: micro-batches that took the gpu
        # route in between returned nothing here).
        previous = int(st.ready[unit.index, self.rank])
        st.wait_counter(st.consumed[unit.index], previous,
                        what=f"consumption of unit {unit.index}")
        mine = st.staging_view(self.rank, unit.index)
        events = []
        for start in range(0, unit.padded, self.chunk):
            end = min(start + self.chunk, unit.padded)
            mine[start:end].copy_(flat_grad[start:end], non_blocking=True)
            events.append(self.streams.record(self.stream))
            if self.barrier_per_chunk:  # every rank's chunk is home before any goes on
                Streams.synchronize(events[-1])
                dist.barrier(group=self.group)
        for ev in events:
            Streams.synchronize(ev)
        self.traffic.d2h += unit.padded * 2
        st.ready[unit.index, self.rank] = token

    def _sum_chunks(self, returned: Returned, lo: int, hi: int):
        st, unit, token = self.state, returned.unit, returned.token
        st.wait_counter(st.ready[unit.index], token, what=f"gradients of unit {unit.index}")
        norm, returned.norm = returned.norm, False
        for start in range(lo, hi, self.chunk):
            end = min(start + self.chunk, hi)
            acc = self.sum_buf[:end - start]
            for owner in range(self.world):
                self._host_normsq += cpu_adam.grad_accumulate(
                    acc, st.staging_view(owner, unit.index, start, end), assign=owner == 0,
                    want_sumsq=norm and owner == self.world - 1, num_threads=self.threads)
            self.traffic.host_reduce += (end - start) * 2 * self.world
            yield start, end, acc


    def _add_locked(self, unit: Unit, flat_grad: torch.Tensor, token: int) -> None:
        """locked route: add the whole gradient into the shared sum, chunk by chunk, each add
        under the one lock; then announce it (`ready`)."""
        st = self.state
        for start in range(0, unit.padded, self.chunk):
            end = min(start + self.chunk, unit.padded)
            src = flat_grad[start:end]
            if self._send_buf is not None:
                src = self._send_buf[:end - start]
                src.copy_(flat_grad[start:end], non_blocking=True)
                Streams.synchronize(self.streams.record(self.stream))
            with st.grad_lock:
                cpu_adam.grad_accumulate(st.unit_view("grad_accum", unit.index, start, end), src,
                                         assign=False, want_sumsq=False, num_threads=self.threads)
        self.traffic.d2h += unit.padded * 2
        self.traffic.host_reduce += unit.padded * 2
        st.ready[unit.index, self.rank] = token
        self._summed[unit.index] = (unit, token)

    def _locked_normsq(self) -> None:
        """locked route: wait until every rank has added its gradients of this step into the
        sum, then add the squared norm of this rank's shards of it."""
        st = self.state
        for unit, token in self._summed.values():
            st.wait_counter(st.ready[unit.index], token, what=f"gradients of unit {unit.index}")
            lo, hi = unit.shard(self.rank, self.world)
            shard = st.unit_view("grad_accum", unit.index, lo, hi)
            self._host_normsq += float(torch.dot(shard, shard))
        self._summed.clear()

    def _take_locked(self, unit: Unit, lo: int, hi: int):
        """locked route: this rank's shard of the complete sum, chunk by chunk, each zeroed for
        the next step once used (no rank adds to the unit again before its next delivery, which
        waits for this update)."""
        for start in range(lo, hi, self.chunk):
            end = min(start + self.chunk, hi)
            chunk = self.state.unit_view("grad_accum", unit.index, start, end)
            yield start, end, chunk
            chunk.zero_()


class HostOptimizer:
    """AdamW on slices of the shared FP32 state, writing the BF16 shadow in the same pass (over
    the gradient, when the shadow held it); a BF16 master (MegaTrain-style) is widened, updated
    and rounded back in place by the same pass."""

    def __init__(self, state: SharedHostState, hyper: AdamHyper, *, threads: int):
        self.state, self.hyper, self.threads = state, hyper, threads
        # Build (or load) the kernel now: a first build takes seconds, which would otherwise
        # land inside the first step's updates and stall its deliveries.
        cpu_adam.active_isa()

    def update(self, start: int, end: int, grad: torch.Tensor, *, step: int, lr: float,
               grad_scale: float = 1.0) -> None:
        """Update global elements [start, end) with `grad` (bf16 or fp32, same length)."""
        st, h = self.state, self.hyper
        bf16_out = st.shadow[start:end] if st.plan.bf16_shadow else None
        scales = {}
        if st.plan.moments == "8bit":  # whole blocks: start is a shard or chunk boundary
            lo, hi = start // cpu_adam.MOMENT_BLOCK, cpu_adam.moment_scales(end)
            scales = {"exp_avg_scale": st.exp_avg_scale[lo:hi], "exp_avg_sq_scale": st.exp_avg_sq_scale[lo:hi]}
        cpu_adam.adam_update(
            st.master[start:end], grad, st.exp_avg[start:end], st.exp_avg_sq[start:end],
            step=step, lr=lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
            weight_decay=h.weight_decay, grad_scale=grad_scale, bf16_out=bf16_out,
            num_threads=self.threads, **scales)
