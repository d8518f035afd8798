"""A rank's gradients from backward to the update: returns, holds, updates, settling.

The update thread runs gradient returns (reduce + copy home, in the order backward hands them
over), then CPU AdamW on the rank's shard, chunk by chunk, one unit at a time in the order
slidedp/update_order.py picks; overlapped with backward of earlier blocks and with the next
step's forward. With slidedp.embedding_update != "host" the embedding's AdamW, and with
slidedp.gpu_state_blocks the first blocks', is issued on the GPU instead (slidedp/gpu_update.py),
ahead of any host update. Where each returned gradient waits for its update is the step's hold
(slidedp/holds.py).

Updates that wait for the step's global norm (updates_deferred: clipping, the non-finite guard,
the locked route) run once the step's finish queues them; the others run during backward, unit
by unit, as soon as each gradient is home, and what backward leaves over runs in the next step's
order. Non-finite guard (training.nonfinite != "off"): whether a step's loss and gradient are
finite is known only from the global norm, after backward, so with the guard on every update
waits for it as clipped ones do (the gradients wait on the host, in the shadow or +2 B/param
without one, and the updates overlap the next step's forward instead of this step's backward;
the cost is in docs/PERFORMANCE.md). A step whose global norm or loss is not finite updates
nothing: it only restores what held its gradients and opens its version gates. Speculative updates (slidedp/speculative.py) run
before the norm is known and are settled after it.
"""

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from slidedp import speculative as speculative_state
from slidedp.gpu_update import STATE_REGIONS, GpuUpdate, GradScale, device_clip
from slidedp.holds import Chunks, Hold
from slidedp.host_state import SharedHostState, StepAborted
from slidedp.layout import Unit
from slidedp.save_gate import SaveGate
from slidedp.step_metrics import StepTimes, UpdateTail
from slidedp.streams import Streams
from slidedp.traffic import Traffic
from slidedp.routes.reduction import GradientReturn, Returned
from slidedp.update import HostOptimizer
from slidedp.update_order import UpdateOrder, UpdateQueue

if TYPE_CHECKING:
    from slidedp.rank_groups import RankGroups


@dataclass(frozen=True)
class StepUpdate:
    """What every update of one step is given."""

    lr: float
    """The step's learning rate."""
    adam_step: int
    """Adam's step count of the update (bias correction)."""
    version: int
    """The version gate value the update opens."""
    tail: UpdateTail
    """Counts the step's updates down."""


@dataclass(frozen=True)
class Settled:
    """A step's global outcome (GradientFlow.settle)."""

    grad_norm: float
    """The global gradient norm."""
    loss_sum: float
    """The loss summed over the step's tokens, every rank's."""
    skipped: bool
    """The non-finite guard skipped the step's updates."""
    coef: float
    """The host updates' clipping coefficient (1: none; GPU-taken norms scale on the GPU)."""
    update_wait_s: float
    """Seconds the step waited, after its compute, for its gradients to come home."""


class GradientFlow:
    """The gradient returns and updates of one rank, queued on its update thread."""

    def __init__(self, state: SharedHostState, streams: Streams, optimizer: HostOptimizer, *,
                 updater: ThreadPoolExecutor, order: UpdateOrder, save_gate: SaveGate,
                 times: StepTimes, device: torch.device, deferred: bool):
        """`updater`: the update thread; `order`: the updates' (reconfigurable as
        `queue.order`); `deferred`: the updates wait for the step's norm
        (host_state.updates_deferred)."""
        self.state, self.streams, self.optimizer = state, streams, optimizer
        self.times, self.device, self.deferred = times, device, deferred
        # A failed job stops every wait of this rank (version gates included), so nothing hangs.
        self.queue = UpdateQueue(updater, order, on_failure=state.aborted.set)
        self._save_gate = save_gate
        self.rank, self.world = state.rank, state.world
        self.units = state.layout.units
        self.route: GradientReturn | None = None  # the reduction route (reconfigurable)
        self.gpu_updates: dict[int, GpuUpdate] = {}  # by unit index
        self.pending: list[Future] = []  # updates queued and not yet reaped
        # The current step's gradient returns, and the last one of each unit (by index).
        self._returns: list[Future] = []
        self._returned: dict[int, Future] = {}
        self._speculated: dict[int, Future] = {}  # this step's speculative updates, by unit
        self._normsq = 0.0  # accumulated micro-batches' squared norm (the grad_accum hold's)
        self._token = 0  # the micro-batch's (the cpu route's staging handshake)
        self._hold: Hold | None = None
        self._step: StepUpdate | None = None
        self._micro = self._n_micro = 0

    # ---- the compute thread -------------------------------------------------------------------

    def begin_step(self, hold: Hold, step: StepUpdate, *, n_micro: int) -> None:
        self._hold, self._step, self._n_micro = hold, step, n_micro
        self._returns, self._returned, self._speculated = [], {}, {}

    def begin_micro_batch(self, micro: int) -> None:
        self._token += 1
        self._micro = micro

    def submit(self, unit: Unit, leaves: dict[str, torch.Tensor]) -> None:
        """The unit's gradient of this micro-batch, flattened, goes home (and, once the last
        micro-batch's is home, to its update unless that waits for the step's norm)."""
        flat = torch.empty(unit.padded, dtype=torch.bfloat16, device=self.device)
        grads = [(leaves[p.local_name].grad if leaves[p.local_name].grad is not None
                  else torch.zeros(p.shape, dtype=torch.bfloat16, device=self.device)).reshape(-1)
                 for p in unit.params]
        torch.cat(grads, out=flat[:unit.numel])
        flat[unit.numel:].zero_()
        ready = self.streams.record()
        hold, step, micro, n_micro = self._hold, self._step, self._micro, self._n_micro
        job = self._gpu_return_job if self.updated_on_gpu(unit) else self._return_job
        returned = self.queue.add_return(partial(
            job, self.route, unit, flat, ready, self._token, micro=micro, n_micro=n_micro,
            hold=hold, step=step))
        self._returns.append(returned)
        if micro < n_micro - 1:
            return
        self._returned[unit.index] = returned
        # Runnable once the gradient is home (the GPU's update runs in its return job);
        # speculative ones too, their gates left closed until the step's norm is known.
        speculate = self.state.plan.redo
        if ((not self.deferred or speculate) and not hold.update_on_return
                and not self.updated_on_gpu(unit)):
            done = self._queue_update(unit, hold, returned, coef=1.0, skip=False,
                                      speculative=speculate, step=step)
            if speculate:
                self._speculated[unit.index] = done

    # ---- the step's finish --------------------------------------------------------------------

    @property
    def norm_on_device(self) -> bool:
        """The step's updates wait for its norm and every unit's runs on the GPU (one micro-batch,
        the gpu route): the norm, the clipping coefficient and the non-finite test are taken
        there too (gpu_update.device_clip)."""
        return self.deferred and len(self.gpu_updates) == len(self.units)

    @property
    def speculated(self) -> bool:
        """This step's updates ran speculatively."""
        return bool(self._speculated)

    def wait_returns(self) -> None:
        """Every gradient of the step is home (or, on the GPU, its norm issued)."""
        for returned in self._returns:
            returned.result()

    def take_normsq(self) -> float:
        """The step's squared gradient norm of this rank's shards (after `wait_returns`)."""
        self._normsq += self.route.take_normsq()
        value, self._normsq = self._normsq, 0.0
        return value

    def settle(self, loss: torch.Tensor, *, groups: "RankGroups", max_norm: float, guard: bool,
               global_tokens: int, tail: UpdateTail) -> Settled:
        """The step's finish once its micro-batches are issued (`loss`: this rank's summed loss
        over `global_tokens`): the global norm and loss, the clipping coefficient and the
        non-finite decision, which every rank takes alike from the same totals, and the updates
        that waited for them queued."""
        device_totals = None
        if self.norm_on_device:
            # Every update reads its gradient on the GPU: they are queued now, behind backward,
            # scaled and skipped there as the step's norm says, while the host waits below.
            self.wait_returns()  # every unit's norm is issued
            device_totals, scale = device_clip(
                self.route.take_device_normsq(), loss, max_norm=max_norm, guard=guard,
                group=groups.reduce, cross=groups.cross, streams=self.streams)
            self.queue_updates(scale, skip=False)
        # What the step waits for after the GPUs finish its compute: its gradients coming home
        # (and on the cpu route without deferral their updates, which take the norm).
        Streams.synchronize(self.streams.record())
        tail.compute_end = t_compute = time.perf_counter()
        self.wait_returns()
        t_returned = time.perf_counter()
        if device_totals is not None:
            totals = device_totals.cpu()
        else:
            totals = groups.sum_totals(
                torch.tensor([self.take_normsq(), float(loss)], dtype=torch.float64))
        grad_norm, loss_sum = math.sqrt(totals[0].item()), totals[1].item() * global_tokens
        skipped = guard and not (math.isfinite(grad_norm) and math.isfinite(loss_sum))
        coef = 1.0
        if self.deferred and device_totals is None:
            # Skipped: nothing is updated, the next step may read every unit.
            coef = min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 else 1.0
            self.queue_updates(coef, skip=skipped)
        return Settled(grad_norm=grad_norm, loss_sum=loss_sum, skipped=skipped, coef=coef,
                       update_wait_s=t_returned - t_compute)

    def queue_updates(self, coef: float | GradScale, *, skip: bool) -> None:
        """The step's updates that waited for its norm, scaled by `coef` (a skipped step's
        restore what held the gradients); speculative ones are settled."""
        hold, step = self._hold, self._step
        for unit in self.units:
            returned = self._returned[unit.index]
            if unit.index in self._speculated:
                job = partial(self._settle_job, self.route, unit, hold, returned, coef=coef,
                              skip=skip, step=step)
                self.pending.append(self.queue.add_update(
                    unit.index, job, after=self._speculated[unit.index]))
            else:
                self._queue_update(unit, hold, returned, coef=coef, skip=skip, step=step)

    # ---- outside the step ---------------------------------------------------------------------

    def reap(self) -> None:
        """Forget the updates that ended; one that failed since the last step fails this one."""
        for fut in self.pending:
            if fut.done():
                fut.result()
        self.pending = [fut for fut in self.pending if not fut.done()]

    def drain(self) -> None:
        for fut in self.pending:
            fut.result()
        self.pending.clear()
        for g in self.gpu_updates.values():
            g.wait_home()

    def failed_job(self) -> BaseException | None:
        """The first error of an update-thread job, other than the stops it caused."""
        for fut in (*self.pending, *self._returns):
            if fut.done() and not isinstance(fut.exception(), (type(None), StepAborted)):
                return fut.exception()
        return None

    def set_gpu_updates(self, units: dict[int, bool], traffic: Traffic) -> None:
        """The units the GPU updates (gpu_update.gpu_updated_units: resident or not), after the
        pending updates finished."""
        self.state.pin_units(sorted(units), STATE_REGIONS)
        self.gpu_updates = {
            index: GpuUpdate(self.state, self.streams, self.optimizer.hyper, self.units[index],
                             rank=self.rank, world=self.world, traffic=traffic,
                             resident=resident)
            for index, resident in units.items()}

    def updated_on_gpu(self, unit: Unit) -> bool:
        return unit.index in self.gpu_updates

    # ---- the update thread --------------------------------------------------------------------

    def _queue_update(self, unit: Unit, hold: Hold, returned: Future, **kw) -> Future:
        job = partial(self._update_job, self.route, unit, hold, returned, **kw)
        done = self.queue.add_update(unit.index, job, after=returned,
                                     first=self.updated_on_gpu(unit))
        self.pending.append(done)
        return done

    def _return_job(self, route: GradientReturn, unit: Unit, flat: torch.Tensor, ready,
                    token: int, *, micro: int, n_micro: int, hold: Hold, step: StepUpdate):
        """One micro-batch's gradient of the unit comes home and waits where `hold` says (or is
        applied as it arrives); returns what the unit's update needs."""
        with self.times.timed("grad_job_s"):
            # One micro-batch: the route's gradient is the step's, so the route takes its norm
            # (on the GPU, or inside the host sum). Accumulated: the last accumulation pass.
            returned = route.start(unit, flat, ready, token, norm=n_micro == 1)
            held = hold.land(self, route, unit, returned, micro=micro, n_micro=n_micro)
        if not hold.update_on_return:
            return held
        self._update(unit, hold.chunks(route, unit, held), coef=1.0, step=step)
        return None

    def _gpu_return_job(self, route: GradientReturn, unit: Unit, flat: torch.Tensor, ready,
                        token: int, *, step: StepUpdate, **_) -> Returned:
        """The return of a unit the GPU updates (one micro-batch): reduced there, never copied
        home, and updated at once, ahead of any host update left over (the next forward needs
        it first), or, deferred, by its update job after the step's norm."""
        with self.times.timed("grad_job_s"):
            returned = route.start(unit, flat, ready, token, norm=True, home=False)
        if not self.deferred:
            self._update_on_gpu(route, returned, coef=1.0, step=step)
        return returned

    def _update_job(self, route: GradientReturn, unit: Unit, hold: Hold, returned: Future, *,
                    coef: float | GradScale, skip: bool, step: StepUpdate,
                    speculative: bool = False) -> None:
        """The unit's update from where its gradient waited (scaled by `coef`, a GradScale for
        a unit updated on the GPU only); a skipped step's only restores what held the gradient
        and opens the version gate. A speculative one keeps the state it starts from and leaves
        the gate to `_settle_job`."""
        held = returned.result()
        if speculative:
            speculative_state.keep(self.state, unit)
            self._update(unit, hold.chunks(route, unit, held), coef=1.0, step=step,
                         open_gate=False)
            return
        if self.updated_on_gpu(unit):
            if skip:
                self.gpu_updates[unit.index].drop()
                self._set_version(unit, step)
            else:
                self._update_on_gpu(route, held, coef=coef, step=step)
            return
        if not skip:
            self._update(unit, hold.chunks(route, unit, held), coef=coef, step=step)
            return
        hold.skip(route, unit, held)
        self._set_version(unit, step)

    def _update(self, unit: Unit, grads: Chunks, *, coef: float, step: StepUpdate,
                open_gate: bool = True) -> None:
        """AdamW on this rank's shard of the unit, chunk by chunk, then its version gate."""
        self._wait_save(unit, step.version)
        with self.times.timed("clipped_update_s" if self.deferred else "update_s"):
            for lo, hi, g in grads:
                self.optimizer.update(unit.host_offset + lo, unit.host_offset + hi, g,
                                      step=step.adam_step, lr=step.lr, grad_scale=coef)
        if open_gate:
            self._set_version(unit, step)

    def _settle_job(self, route: GradientReturn, unit: Unit, hold: Hold, returned: Future, *,
                    coef: float, skip: bool, step: StepUpdate) -> None:
        """After the unit's speculative update, once the step's norm is known: it stands
        (coefficient 1, a finite step), or the state is restored and the update redone scaled,
        or not at all for a skipped step (the shadow rounded again from the restored master);
        then the version gate opens."""
        if coef == 1.0 and not skip:
            self._set_version(unit, step)
            return
        with self.times.timed("redo_s"):
            speculative_state.restore(self.state, unit)
        if not skip:
            self._update(unit, hold.chunks(route, unit, returned.result()), coef=coef,
                         step=step)
            return
        if self.state.plan.bf16_shadow:
            self.state.shadow_from_master(unit)
        self._set_version(unit, step)

    def _update_on_gpu(self, route: GradientReturn, returned: Returned, *,
                       coef: float | GradScale, step: StepUpdate) -> None:
        """The unit's AdamW on the GPU (slidedp/gpu_update.py); its version gate opens once the
        delivery source is home (resident: once the update is issued)."""
        unit = returned.unit
        self._wait_save(unit, step.version)
        with self.times.timed("gpu_update_s"):
            self.gpu_updates[unit.index].update(returned.shard, self.streams.record(route.stream),
                                                scale=coef, lr=step.lr, step=step.adam_step)
        returned.shard = None
        self._set_version(unit, step)

    def _set_version(self, unit: Unit, step: StepUpdate) -> None:
        self.state.version[unit.index, self.rank] = step.version
        step.tail.unit_done()

    def _wait_save(self, unit: Unit, version: int) -> None:
        """The background save must have written the unit before this update (`host_save_wait_s`:
        the time it held the update up)."""
        waited = self._save_gate.wait(unit.index, version, self.state.aborted)
        if waited:
            self.times.add("save_wait_s", waited)

    def add_normsq(self, value: float) -> None:
        """Part of the step's squared norm, taken by a hold as it lands a gradient."""
        self._normsq += value
