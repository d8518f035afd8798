"""A run's parameter and gradient routes: the checks a switch of routes must pass, and the
route objects (slidedp/delivery.py, slidedp/update.py) built over one chunk size."""

from dataclasses import replace

from slidedp.config import SlideDPConfig
from slidedp.delivery import Delivery
from slidedp.gpu_update import check_gpu_updates
from slidedp.host_state import SharedHostState
from slidedp.node_shards import check_sharded_routes
from slidedp.nodes import Nodes
from slidedp.peer_styles import RuntimeStyle
from slidedp.rank_groups import RankGroups
from slidedp.streams import Streams
from slidedp.traffic import Traffic
from slidedp.update import GradientReturn


def check_routes(cfg: SlideDPConfig, *, delivery: str, reduction: str, style: RuntimeStyle,
                 nodes: Nodes, state: SharedHostState, grad_accum_steps: int, n_layers: int,
                 deferred: bool) -> None:
    """Refuse routes the run cannot switch to: a peer runtime style runs its own routes only,
    several nodes reduce on the GPUs (and deliver sharded when they shard the state), the GPU
    updates need theirs, the host state is untouched (the cpu route needs its staging region,
    allocated when slidedp.reduction = "cpu") and must have a place for a step's gradients."""
    style.check_routes(delivery, reduction)
    nodes.check_reduction(reduction)
    if not state.shards.whole:
        check_sharded_routes(delivery=delivery, reduction=reduction)
    check_gpu_updates(replace(cfg, delivery=delivery, reduction=reduction),
                      grad_accum_steps=grad_accum_steps, n_layers=n_layers, world=state.world)
    if reduction == "cpu" and not state.plan.cpu_staging:
        raise ValueError("reduction='cpu' needs the host staging region: start with "
                         "slidedp.reduction = 'cpu'")
    state.plan.hold(n_micro=1, reduction=reduction, deferred=deferred)


def build_routes(state: SharedHostState, streams: Streams, *, delivery: str, reduction: str,
                 chunk_elems: int, groups: RankGroups, traffic: Traffic, threads: int,
                 style: RuntimeStyle) -> tuple[Delivery, GradientReturn]:
    """The delivery and reduction routes of this rank, on the delivery and update threads'
    groups."""
    rank, world = state.rank, state.world
    return (Delivery(state, streams, route=delivery, rank=rank, world=world, group=groups.gather,
                     chunk_elems=chunk_elems, traffic=traffic),
            GradientReturn(state, streams, route=reduction, rank=rank, world=world,
                           group=groups.reduce, cross=groups.cross, chunk_elems=chunk_elems,
                           traffic=traffic, max_unit=max(u.padded for u in state.layout.units),
                           threads=threads, barrier_per_chunk=style.barrier_per_chunk))
