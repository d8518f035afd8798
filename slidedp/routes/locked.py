"""The locked reduction route: every rank adds its full gradient into one shared FP32 sum, one
chunk at a time under one host lock (MegaTrain-style, slidedp/peer_styles.py); the sum is
complete only when every rank's backward is, so its updates wait for the step's end."""

import torch

from slidedp import cpu_adam
from slidedp.holds import HOLDS
from slidedp.layout import Unit, chunks
from slidedp.routes.reduction import GradientReturn, Returned
from slidedp.streams import Streams


class LockedReturn(GradientReturn):
    """Every rank adds its whole gradient into one shared FP32 sum under one host lock; each
    rank updates its shard of the complete sum."""

    name = "locked"
    defers_updates = shared_sum = True
    autopolicy = False

    @classmethod
    def regions(cls, *, deferred, accumulate, shadow, redo):
        return frozenset({"grad_accum"})  # the one sum, for any number of micro-batches

    @classmethod
    def hold(cls, plan, *, n_micro, deferred):
        if not plan.grad_lock:
            raise ValueError("SlideDP: reduction='locked' needs the shared gradient sum: "
                             "start with slidedp.reduction = 'locked'")
        return HOLDS["shared_accum"]

    @classmethod
    def simulate(cls, b, unit, host, gpu, micro, update):
        # Each rank copies its whole gradient home and adds it into the one sum, chunk by chunk,
        # one rank at a time (the lock: one lane for every rank); the updates wait for the
        # step's end (defers_updates), then read this rank's shard of the sum.
        spec, R = b.spec, b.spec.world
        elems = spec.unit_elems[unit]
        for r in range(R):
            prev = b.add(f"uthread:{r}", deps=[host[r]], kind="issue")
            for n in chunks(cls.home_elems(elems, R), spec.chunk_elems):
                landed = b.copy(f"rstream:{r}", r, 2 * n, "d2h", [prev, gpu[r]], kind="d2h")
                prev = b.host_pass(r, n, kind="sum", deps=[landed], assign=False, locked=True)
            b.job_done(r, unit, prev, False)

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._summed: dict[int, tuple[Unit, int]] = {}  # unit -> its last token
        # On a GPU: one chunk of a gradient on its way to the shared sum.
        self._send_buf = (torch.empty(self.chunk, dtype=torch.bfloat16, pin_memory=True)
                          if self.streams.is_cuda else None)

    def take_normsq(self) -> float:
        self._locked_normsq()
        return super().take_normsq()

    def _start(self, unit, flat_grad, token, *, norm, home):
        """Add the whole gradient into the shared sum, chunk by chunk, each add under the one
        lock; then announce it (`ready`)."""
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
        return Returned(unit, token, shard=None, norm=False)

    def _locked_normsq(self) -> None:
        """Wait until every rank has added its gradients of this step into the sum, then add the
        squared norm of this rank's shards of it."""
        st = self.state
        for unit, token in self._summed.values():
            st.wait_counter(st.ready[unit.index], token, what=f"gradients of unit {unit.index}")
            lo, hi = unit.shard(self.rank, self.world)
            shard = st.unit_view("grad_accum", unit.index, lo, hi)
            self._host_normsq += float(torch.dot(shard, shard))
        self._summed.clear()

    def _chunks(self, returned, lo, hi, *, release):
        """This rank's shard of the complete sum, chunk by chunk, each zeroed for the next step
        once used (no rank adds to the unit again before its next delivery, which waits for
        this update)."""
        for start in range(lo, hi, self.chunk):
            end = min(start + self.chunk, hi)
            chunk = self.state.unit_view("grad_accum", returned.unit.index, start, end)
            yield start, end, chunk
            chunk.zero_()
