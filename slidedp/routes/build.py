"""A run's parameter and gradient routes: the checks a switch of routes must pass, and the
route objects (slidedp/routes/delivery.py, slidedp/routes/reduction.py) built over one chunk
size."""

from dataclasses import replace

from slidedp.config import SlideDPConfig
from slidedp.gpu_update import check_gpu_updates
from slidedp.host_state import HostStatePlan, SharedHostState
from slidedp.node_shards import check_sharded_routes
from slidedp.nodes import Nodes
from slidedp.peer_styles import RuntimeStyle
from slidedp.rank_groups import RankGroups
from slidedp.routes import DELIVERIES, REDUCTIONS, Delivery, GradientReturn
from slidedp.streams import Streams
from slidedp.traffic import Traffic


def check_routes(cfg: SlideDPConfig, *, delivery: str, reduction: str, style: RuntimeStyle,
                 nodes: Nodes, state: SharedHostState, grad_accum_steps: int, n_layers: int,
                 deferred: bool) -> None:
    """Refuse routes the run cannot switch to: a peer runtime style runs its own routes only,
    several nodes reduce on the GPUs (and deliver sharded when they shard the state), the GPU
    updates need theirs, the host state is untouched (the cpu route needs its staging region,
    allocated when slidedp.reduction = "cpu") and must have a place for a step's gradients."""
    route_classes(delivery, reduction)
    style.check_routes(delivery, reduction)
    nodes.check_reduction(reduction)
    if not state.shards.whole:
        check_sharded_routes(delivery=delivery, reduction=reduction)
    check_gpu_updates(replace(cfg, delivery=delivery, reduction=reduction),
                      grad_accum_steps=grad_accum_steps, n_layers=n_layers, world=state.world)
    if not has_regions(state.plan, reduction):
        raise ValueError(f"reduction={reduction!r} needs the host staging region: start with "
                         f"slidedp.reduction = {reduction!r}")
    REDUCTIONS[reduction].hold(state.plan, n_micro=1, deferred=deferred)


def build_routes(state: SharedHostState, streams: Streams, *, delivery: str, reduction: str,
                 chunk_elems: int, groups: RankGroups, traffic: Traffic, threads: int,
                 style: RuntimeStyle) -> tuple[Delivery, GradientReturn]:
    """The delivery and reduction routes of this rank, on the delivery and update threads'
    groups."""
    rank, world = state.rank, state.world
    delivery_route, reduction_route = route_classes(delivery, reduction)
    return (delivery_route(state, streams, rank=rank, world=world, group=groups.gather,
                           chunk_elems=chunk_elems, traffic=traffic),
            reduction_route(state, streams, rank=rank, world=world, group=groups.reduce,
                            cross=groups.cross, chunk_elems=chunk_elems, traffic=traffic,
                            max_unit=max(u.padded for u in state.layout.units), threads=threads,
                            barrier_per_chunk=style.barrier_per_chunk))


def route_classes(delivery: str, reduction: str) -> tuple[type[Delivery], type[GradientReturn]]:
    """The route classes of the names (raises for an unknown one)."""
    if delivery not in DELIVERIES:
        raise ValueError(f"slidedp.delivery must be one of {tuple(DELIVERIES)}, got {delivery!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"slidedp.reduction must be one of {tuple(REDUCTIONS)}, "
                         f"got {reduction!r}")
    return DELIVERIES[delivery], REDUCTIONS[reduction]


def searched_routes() -> list[tuple[str, str]]:
    """The (delivery, reduction) pairs AutoPolicy weighs on several ranks."""
    return [(d, r) for d in DELIVERIES for r, route in REDUCTIONS.items() if route.autopolicy]


def has_regions(plan: HostStatePlan, reduction: str) -> bool:
    """Whether the host state has the regions the route cannot run without, which exist only
    when a run starts with it (the cpu route's staging)."""
    needs = REDUCTIONS[reduction].regions(deferred=True, accumulate=False,
                                          shadow=plan.bf16_shadow, redo=plan.redo)
    return "staging" not in needs or plan.cpu_staging
