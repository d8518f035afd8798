"""The cpu reduction route: every rank copies its full gradient home into its staging region and
each owner sums the R copies of its shard on the host (SlideFormer's, with one owner)."""

import torch
import torch.distributed as dist

from slidedp import cpu_adam
from slidedp.layout import chunks
from slidedp.routes.reduction import GradientReturn, Returned
from slidedp.streams import Streams


class CpuReturn(GradientReturn):
    """Every rank's full gradient into its staging region; each owner sums its shard of the R
    copies on the host."""

    name = "cpu"

    @classmethod
    def regions(cls, *, deferred, accumulate, shadow, redo):
        return super().regions(deferred=deferred, accumulate=accumulate, shadow=shadow,
                               redo=redo) | {"staging"}

    @classmethod
    def _one_micro_hold(cls, plan, *, deferred):
        # Deferred, the staging copies wait and are summed again at the update.
        return "staging" if deferred else "none"

    @classmethod
    def simulate(cls, b, unit, host, gpu, micro, update):
        if b.style.sole_owner:
            return cls._simulate_sole_owner(b, unit, host, gpu, micro, update)
        spec, R = b.spec, b.spec.world
        elems = spec.unit_elems[unit]
        # Wait until every owner consumed our previous copy, return the whole gradient, wait
        # until every rank's is home, sum our shard of the R copies chunk by chunk.
        homes = []
        for r in range(R):
            consumed = [b.ranks[o].returned.get(unit) for o in range(R)]
            start = b.add(f"uthread:{r}", deps=[host[r], *consumed], kind="issue")
            homes.append(b.copy(f"rstream:{r}", r, 2 * cls.home_elems(elems, R), "d2h",
                                [start, gpu[r]], kind="d2h",
                                n_chunks=len(chunks(elems, spec.chunk_elems))))
        for r in range(R):
            prev = homes
            for n in chunks(elems // R, spec.chunk_elems):
                prev = [b.host_pass(r, n, kind="sum", deps=prev, sources=R)]
                prev = b.accumulate_and_update(r, n, prev, micro, update, summed=True)
            b.ranks[r].returned[unit] = prev[0]
            b.job_done(r, unit, prev[0], update)

    @classmethod
    def _simulate_sole_owner(cls, b, unit, host, gpu, micro, update):
        """Every rank copies its full gradient home chunk by chunk; rank 0 sums the R copies of
        each chunk and updates it; the ranks meet before each chunk's copy and after its update
        (the style's barrier per chunk)."""
        spec, R = b.spec, b.spec.world
        consumed = b.ranks[0].returned.get(unit)
        starts = [b.add(f"uthread:{r}", deps=[host[r], consumed], kind="issue") for r in range(R)]
        barrier = None
        for n in chunks(spec.unit_elems[unit], spec.chunk_elems):
            copies = [b.copy(f"rstream:{r}", r, 2 * n, "d2h", [starts[r], gpu[r], barrier],
                             kind="d2h") for r in range(R)]
            done = [b.host_pass(0, n, kind="sum", deps=copies, sources=R)]
            barrier = b.accumulate_and_update(0, n, done, micro, update, summed=True)[0]
        b.ranks[0].returned[unit] = barrier
        for r in range(R):
            b.ranks[r].jobs.append(barrier)
        if update:
            b.ranks[0].updated[unit] = barrier

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sum_buf = torch.empty(self.chunk, dtype=torch.float32)  # the host sum's chunk

    def _start(self, unit, flat_grad, token, *, norm, home):
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
        return Returned(unit, token, shard=None, norm=norm)

    def _chunks(self, returned, lo, hi, *, release):
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
        if release:
            self.release(returned)

    def release(self, returned: Returned) -> None:
        """This rank is done with every rank's staging copy of the unit."""
        self.state.consumed[returned.unit.index, self.rank] = returned.token
