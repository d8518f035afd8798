"""The route classes (slidedp/routes/): what the runtime runs and what the step-time model
simulates come from the same declarations."""

import pytest

from protocols.model_spec import get_flavor
from slidedp.config import SlideDPConfig
from slidedp.host_state import HostStatePlan, updates_deferred
from slidedp.layout import StateLayout
from slidedp.plan.steptime import simulate_step
from slidedp.routes import DELIVERIES, REDUCTIONS
from slidedp.routes.build import route_classes
from tests.test_steptime import rates, spec


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_delivery_declares_the_span_its_runtime_copies(world):
    """A route's simulated bytes per rank (copy_elems) are the span the runtime copies, and its
    gate covers exactly the ranks whose shards that span reads."""
    layout = StateLayout(get_flavor("qwen3-debug"), world=world)
    for route in DELIVERIES.values():
        for unit in layout.units:
            for rank in range(world):
                lo, hi = route.span(unit, rank, world)
                assert hi - lo == route.copy_elems(unit.padded, world), (route.name, rank)
                owners = [o for o in range(world)
                          if max(lo, unit.shard(o, world)[0]) < min(hi, unit.shard(o, world)[1])]
                assert owners == list(route.gate_ranks(rank, world)), (route.name, rank)


def test_each_reduction_declares_its_regions_hold_and_deferral():
    """HostStatePlan's regions and the hold come from the route; only the locked route makes
    every update wait for the step's end."""
    for name, route in REDUCTIONS.items():
        assert updates_deferred(max_norm=0.0, nonfinite="off", reduction=name) == (
            name == "locked")
        plan = HostStatePlan.for_run(SlideDPConfig(reduction=name), grad_accum_steps=1,
                                     max_norm=1.0, nonfinite="skip")
        hold = route.hold(plan, n_micro=1, deferred=True)
        assert hold.name == {"gpu": "shadow", "cpu": "staging", "locked": "shared_accum"}[name]
        assert plan.cpu_staging == (name == "cpu") and plan.grad_lock == (name == "locked")
    no_shadow = HostStatePlan.for_run(SlideDPConfig(bf16_shadow=False), grad_accum_steps=1,
                                      max_norm=0.0, nonfinite="off")
    assert REDUCTIONS["gpu"].hold(no_shadow, n_micro=1, deferred=False).on_device
    with pytest.raises(ValueError, match="accumulation buffer"):
        REDUCTIONS["cpu"].hold(no_shadow, n_micro=2, deferred=False)


def test_unknown_route_names_are_refused():
    with pytest.raises(ValueError, match="slidedp.delivery must be one of"):
        route_classes("both", "gpu")
    with pytest.raises(ValueError, match="slidedp.reduction must be one of"):
        route_classes("sharded", "nccl")


@pytest.mark.parametrize("delivery", list(DELIVERIES))
@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_every_route_pair_simulates_itself(delivery, reduction):
    """The model simulates every registered pair on 2 ranks; a host-bound pair takes longer than
    its GPU work."""
    r = rates(grad_sum_gelems={4: 1e-3}, adam_gparams={4: 1e-3})
    deferred = updates_deferred(max_norm=0.0, nonfinite="off", reduction=reduction)
    p = simulate_step(spec(world=2, delivery=delivery, reduction=reduction, deferred=deferred,
                           grad_accum=reduction == "locked", block_elems=100_000), r)
    assert p.step_s > spec().work.total


def test_the_locked_route_adds_one_rank_at_a_time():
    """Each rank adds its whole gradient into the one sum under the one lock: with the sum the
    only slow work, R ranks take R times one rank's adds, where the cpu route's owners sum their
    own shards at once."""
    elems, blocks, sum_s = 1_000_000, 4, 0.25  # seconds of one rank's add of a block
    r = rates(grad_sum_gelems={4: elems / sum_s / 1e9})
    common = dict(blocks=blocks, block_elems=elems, fwd=1e-4, bwd=1e-4, head=1e-4,
                  delivery="replicated", deferred=True, grad_accum=True)
    one = simulate_step(spec(world=1, reduction="locked", **common), r)
    two = simulate_step(spec(world=2, reduction="locked", **common), r)
    cpu = simulate_step(spec(world=2, reduction="cpu", **common), r)
    assert one.step_s == pytest.approx(blocks * sum_s, rel=0.05)
    assert two.step_s == pytest.approx(2 * blocks * sum_s, rel=0.05)
    assert cpu.step_s < two.step_s
