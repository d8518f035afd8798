"""Where a step's returned gradients wait for their updates: one strategy object per hold.

With one micro-batch a gradient is BF16 as reduced, so it waits as BF16: in the shadow, whose
unit is not read again before its update; without a shadow in the BF16 gradient buffer when
updates are deferred, or on the GPU. Accumulated micro-batches are summed in the FP32 buffer.
The cpu route's host sum feeds the update as it arrives, or, deferred, its staging copies wait
and are summed again at the update; the locked route's one sum of every rank's gradients waits
where the ranks added it.

The reduction route's `hold` (slidedp/routes/reduction.py) picks a step's hold. The gradient flow (slidedp/gradient_flow.py) calls it
at the three points where holds differ: a gradient arrives (`land`), the update reads it
(`chunks`), a skipped step leaves it (`skip`).
"""

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch

from slidedp import cpu_adam
from slidedp.layout import Unit
from slidedp.streams import Streams

if TYPE_CHECKING:
    from slidedp.gradient_flow import GradientFlow
    from slidedp.routes.reduction import GradientReturn, Returned

Chunks = Iterable[tuple[int, int, torch.Tensor]]
"""A unit's summed gradient shard: (start, end, chunk) in unit-local coordinates."""


class Hold:
    """A hold that keeps what the route returned (a reduced shard on the GPU, the cpu route's
    staging copies, the locked route's shared sum), read back through the route."""

    name: ClassVar[str]
    """What the start-up report and the planner call it."""
    region: ClassVar[str | None] = None
    """The host region the gradient waits in; None: none of its own."""
    update_on_return: ClassVar[bool] = False
    """The update runs in the return job, as the gradient arrives (nothing waits)."""
    on_device: ClassVar[bool] = False
    """The reduced shards wait in GPU memory (the planner counts them there)."""

    def land(self, flow: "GradientFlow", route: "GradientReturn", unit: Unit,
             returned: "Returned", *, micro: int, n_micro: int) -> object:
        """One micro-batch's gradient of the unit has started home; returns what the unit's
        update reads it from (`held`)."""
        return returned

    def chunks(self, route: "GradientReturn", unit: Unit, held) -> Chunks:
        """The unit's summed gradient shard where it waited, chunk by chunk."""
        return route.chunks(held)

    def skip(self, route: "GradientReturn", unit: Unit, held) -> None:
        """A skipped step updates nothing: what held the gradient is restored or released."""

    def __repr__(self) -> str:
        return self.name


class NoHold(Hold):
    """The cpu route's host sum feeds the update as it arrives."""

    name = "none"
    update_on_return = True


class DeviceHold(Hold):
    """The reduced shard waits on the GPU and is copied home at the update."""

    name = "device"
    on_device = True


class StagingHold(Hold):
    """The cpu route's staging copies wait, summed once now for the norm and again at the
    update."""

    name = "staging"

    def land(self, flow, route, unit, returned, *, micro, n_micro):
        for _ in route.chunks(returned, release=False):
            pass  # the sum, for the norm; the copies stay until the update sums again
        return returned

    def skip(self, route, unit, held):
        route.release(held)


class SharedAccumHold(Hold):
    """The locked route's one sum of every rank's gradients, which serves any number of
    micro-batches."""

    name = "shared_accum"

    def skip(self, route, unit, held):
        for _ in route.chunks(held):
            pass  # zeroes the sum for the next step


class RegionHold(Hold):
    """The gradient waits in a host region of this rank's shard; `held` is the event of its
    arrival."""

    def chunks(self, route, unit, held):
        Streams.synchronize(held)  # the copy home has landed
        lo, hi = unit.shard(route.rank, route.world)
        region, base, step = route.state.regions[self.region], unit.host_offset, route.chunk
        return ((a, min(a + step, hi), region[base + a:base + min(a + step, hi)])
                for a in range(lo, hi, step))


class Bf16RegionHold(RegionHold):
    """The reduced BF16 shard is copied home into the region."""

    def land(self, flow, route, unit, returned, *, micro, n_micro):
        lo, hi = unit.shard(route.rank, route.world)
        return route.copy_home(returned, route.state.unit_view(self.region, unit.index, lo, hi))


class ShadowHold(Bf16RegionHold):
    """The BF16 shadow, whose unit is not read again before the unit's update."""

    name = region = "shadow"

    def skip(self, route, unit, held):
        Streams.synchronize(held)  # it holds the gradient: the weights come back from the master
        route.state.shadow_from_master(unit)


class GradBf16Hold(Bf16RegionHold):
    """The BF16 gradient buffer: without a shadow, or beside one that speculative updates
    overwrite."""

    name = region = "grad_bf16"


class GradAccumHold(RegionHold):
    """The FP32 accumulation buffer: each micro-batch's summed shard is added into it, and the
    last pass takes the step's squared norm."""

    name = region = "grad_accum"

    def land(self, flow, route, unit, returned, *, micro, n_micro):
        last = micro == n_micro - 1
        for lo, hi, g in route.chunks(returned):
            with flow.times.timed("accumulate_s"):
                flow.add_normsq(cpu_adam.grad_accumulate(
                    route.state.grad_accum[unit.host_offset + lo:unit.host_offset + hi], g,
                    assign=micro == 0, want_sumsq=last and n_micro > 1,
                    num_threads=flow.optimizer.threads))
        return None


HOLDS: dict[str, Hold] = {h.name: h for h in (
    NoHold(), DeviceHold(), StagingHold(), SharedAccumHold(), ShadowHold(), GradBf16Hold(),
    GradAccumHold())}
"""Every hold, by name."""
