"""The gpu reduction route: reduce-scatter on the GPUs (all-reduced across the nodes), then each
rank copies only its aggregated shard (1/R) home, or a GPU update reads it where it is."""

import torch
import torch.distributed as dist

from slidedp.collectives import reduce_scatter_single
from slidedp.holds import HOLDS
from slidedp.layout import chunks
from slidedp.routes.reduction import GradientReturn, Returned
from slidedp.streams import Streams


class GpuReturn(GradientReturn):
    """Reduce-scatter on the GPUs (all-reduce across the nodes), then this rank's shard home."""

    name = "gpu"
    keeps_on_gpu = True

    @classmethod
    def regions(cls, *, deferred, accumulate, shadow, redo):
        # One micro-batch: the BF16 gradient waits as reduced, in the shadow (its unit is not
        # read again before the update) or, without one or beside speculation's, in its own.
        bf16 = deferred and not accumulate and (redo or not shadow)
        return super().regions(deferred=deferred, accumulate=accumulate, shadow=shadow,
                               redo=redo) | ({"grad_bf16"} if bf16 else set())

    @classmethod
    def hold(cls, plan, *, n_micro, deferred):
        if n_micro == 1 and plan.redo:  # the shadow takes the speculative update's weights
            if not plan.grad_bf16:
                raise ValueError('SlideDP: speculative updates need slidedp.reduction = "gpu" '
                                 "and one micro-batch per step")
            return HOLDS["grad_bf16"]
        return super().hold(plan, n_micro=n_micro, deferred=deferred)

    @classmethod
    def _one_micro_hold(cls, plan, *, deferred):
        if plan.bf16_shadow:
            return "shadow"
        if plan.grad_bf16:
            return "grad_bf16"
        if not deferred:
            return "device"
        if plan.grad_accum:
            return "grad_accum"
        raise ValueError("SlideDP: updates that wait for the step's norm need a host gradient "
                         "buffer on reduction='gpu': start with slidedp.reduction = 'gpu' or "
                         "with slidedp.bf16_shadow")

    @staticmethod
    def home_elems(elems, owners):
        return elems // owners

    @classmethod
    def simulate(cls, b, unit, host, gpu, micro, update):
        spec, R = b.spec, b.spec.world
        elems = spec.unit_elems[unit]
        starts = [b.add(f"uthread:{r}", deps=[host[r]], kind="issue") for r in range(R)]
        if b.owners > 1:  # every rank's update thread must have issued it: one collective
            reduced = [b.collective(2 * elems, b.rates.reduce_scatter_gbs, [*starts, *gpu],
                                    lane="rstream", kind="collective")] * R
        else:
            reduced = [b.add("rstream:0", deps=[starts[0], gpu[0]], kind="issue")]
        if spec.nodes > 1 and not spec.sharded_nodes:
            reduced = [b.across_nodes(r, 2 * elems // R, [reduced[r]]) for r in range(R)]
        home = cls.home_elems(elems, b.owners)
        for r in range(R):
            if b.on_gpu(unit):  # the reduced shard waits on the GPU for its update
                end = b.gpu_update(r, unit, [reduced[r]])[0] if update else reduced[r]
                b.ranks[r].jobs.append(end)
                continue
            copies = [b.copy(f"rstream:{r}", r, 2 * n, "d2h", [reduced[r]], kind="d2h")
                      for n in chunks(home, spec.chunk_elems)]  # issued at once
            prev: list = []
            for n, landed in zip(chunks(home, spec.chunk_elems), copies):
                prev = b.accumulate_and_update(r, n, [landed, *prev], micro, update)
            b.job_done(r, unit, prev[0], update)

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        # The pinned receive buffer of chunks(), made when first needed (a gradient copied home
        # into a host region needs none).
        self._recv: torch.Tensor | None = None

    def _start(self, unit, flat_grad, token, *, norm, home):
        lo, hi = unit.shard(self.rank, self.world)
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

    def take_device_normsq(self) -> torch.Tensor:
        """What `take_normsq` returns, as a device tensor that the current stream waits for on
        the device, not the host: for a step whose every gradient stays on the GPU."""
        normsq, self._normsq = self._normsq, None
        self.streams.wait(self._norm_done)
        return normsq

    def copy_home(self, returned: Returned, into: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the reduced shard into `into` (registered host memory of its size) without
        waiting; returns the event that marks its arrival."""
        with self.streams.use(self.stream):
            into.copy_(returned.shard, non_blocking=True)
            returned.shard = None  # the stream-ordered allocator keeps it until the copy is done
            return self.streams.record(self.stream)

    def _chunks(self, returned, lo, hi, *, release):
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
