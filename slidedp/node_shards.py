"""SlideDP over several nodes with the host state sharded across them
(slidedp.nodes_state = "sharded").

The owners are every rank of every node: rank g of W owns shard g of every unit, and a node's
host state holds only its ranks' shards (`NodeShards`, one span per unit), so a node's host
memory is the state's 1/N and the largest model grows with the node count. The mapping keeps
the whole layout's offsets; a node never touches the other nodes' spans, so their pages never
exist (slidedp/host_state.py). Delivery copies a rank's shard home->GPU and all-gathers the unit
over every rank (the inter-node all-gather); the gradient's reduce-scatter runs over every rank
too, so each shard's update runs on the node that holds it and no cross-node all-reduce is
needed. The step's totals sum over every rank once (each shard counted once). Every rank saves
its own shard; there are no replicas to compare (`ReplicaCheck` stays off).
"""

from typing import Iterator

import torch
import torch.distributed as dist

from slidedp import state_io
from slidedp.config import SlideDPConfig
from slidedp.host_state import SharedHostState
from slidedp.layout import NodeShards
from slidedp.nodes import Nodes


def node_shards(nodes: Nodes, cfg: SlideDPConfig) -> NodeShards:
    """What this node's host state holds: every shard of its ranks alone in sharded mode on
    several nodes, else every shard of the node's ranks (one node's layout). Refuses what the
    sharded mode cannot run, before anything is allocated."""
    if cfg.nodes_state == "replicated" or nodes.nnodes == 1:
        return NodeShards(first=0, count=nodes.local_world, world=nodes.local_world)
    for option, value, needed in (("runtime", cfg.runtime, "slidedp"),
                                  ("embedding_update", cfg.embedding_update, "host"),
                                  ("gpu_state_blocks", cfg.gpu_state_blocks, 0)):
        if value != needed:
            raise ValueError(f'slidedp.nodes_state = "sharded" needs slidedp.{option} = '
                             f"{needed!r}, not {value!r}")
    check_sharded_routes(delivery=cfg.delivery, reduction=cfg.reduction)
    first = nodes.node * nodes.local_world
    if nodes.ranks[nodes.node] != tuple(range(first, first + nodes.local_world)):
        raise ValueError(f'slidedp.nodes_state = "sharded" needs each node\'s ranks numbered '
                         f"together (torchrun's node-major ranks); node {nodes.node} runs "
                         f"{list(nodes.ranks[nodes.node])}")
    return NodeShards(first=first, count=nodes.local_world,
                      world=nodes.nnodes * nodes.local_world)


def check_sharded_routes(*, delivery: str, reduction: str) -> None:
    """A node holds its ranks' shards only: each rank delivers its own and all-gathers the
    rest, and reduces its shard on the GPUs."""
    if (delivery, reduction) != ("sharded", "gpu"):
        raise ValueError('slidedp.nodes_state = "sharded" runs slidedp.delivery = "sharded" and '
                         f'slidedp.reduction = "gpu", not {delivery!r} and {reduction!r}: a node '
                         "holds only its ranks' shards of the host state")


def master_parameters(state: SharedHostState, everyone: dist.ProcessGroup | None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The full master by parameter name. A node that holds part of every unit gathers each
    unit from every rank (`everyone`, a gloo group: a collective, every rank calls it)."""
    if state.shards.whole:
        yield from state_io.master_parameters(state)
        return
    for unit in state.layout.units:
        mine = state.shard_view("master", unit)
        parts = [torch.empty_like(mine) for _ in range(state.world)]
        dist.all_gather(parts, mine, group=everyone)
        flat = torch.cat(parts)
        for p in unit.params:
            yield p.name, flat[p.offset:p.offset + p.numel].view(p.shape)
