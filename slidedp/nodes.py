"""SlideDP over several nodes: torchrun's node groups, one host state per node, replicas kept
bit-identical.

A node is torchrun's node group (GROUP_RANK, with LOCAL_RANK of LOCAL_WORLD_SIZE inside it), never
a guess from host names: two nodes may share a machine. Each node maps a host state of its own
(its local rank 0 creates it and shares it over the node's group) and shards it over its local
ranks exactly as a node alone would. Gradients reduce hierarchically: reduce-scatter within the
node, then an all-reduce of each local rank's shard across the nodes, in a group per local rank
(`Nodes.cross_group`). Every node's owner of a shard then holds the same summed gradient and
updates its replica with the same inputs, so the replicas stay bit-identical. The step's
squared norm summed over a node's ranks is already the global one (each shard counted once);
only the loss is summed across the nodes as well (`add_other_nodes_loss`).

Nodes that differ are refused at start (`check_same`: ranks per node, model, configuration), and
`ReplicaCheck` compares a checksum of every replica's optimizer state across the nodes.
"""

import os
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from slidedp.host_state import STATE_LABEL, SharedHostState
from slidedp.run_config import RunConfig



class NodeMismatch(ValueError):
    """The nodes of a run differ (every rank raises it alike, before anything is allocated)."""


class ReplicaDiverged(RuntimeError):
    """A node's replica of the host state differs from node 0's (every rank raises it alike)."""


@dataclass(frozen=True)
class Nodes:
    """Where this rank sits: node `node` of `nnodes`, local rank `local_rank` of `local_world`;
    `ranks[n]` are node n's global ranks by local rank."""

    node: int
    """torchrun's GROUP_RANK."""
    nnodes: int
    """How many nodes run."""
    local_rank: int
    """This rank within its node (LOCAL_RANK)."""
    local_world: int
    """Ranks per node (LOCAL_WORLD_SIZE), the same on every node."""
    ranks: tuple[tuple[int, ...], ...]
    """Each node's global ranks, by local rank."""

    @classmethod
    def discover(cls, *, rank: int, world: int) -> "Nodes":
        """The node groups, as torchrun's environment gives them to each rank (a collective over
        the default group); raises NodeMismatch where nodes run different numbers of ranks."""
        if world == 1:
            return cls(node=0, nnodes=1, local_rank=0, local_world=1, ranks=((0,),))
        mine = (int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", rank)))
        table: list = [None] * world
        dist.all_gather_object(table, mine)
        nnodes = max(node for node, _ in table) + 1
        ranks = tuple(tuple(r for _, r in sorted((local, r) for r, (node, local) in enumerate(table)
                                                 if node == n)) for n in range(nnodes))
        for n, members in enumerate(ranks):
            if len(members) != len(ranks[0]):
                raise NodeMismatch(f"node {n} runs {len(members)} ranks and node 0 runs "
                                   f"{len(ranks[0])}: every node must run the same number (NGPU)")
        return cls(node=mine[0], nnodes=nnodes, local_rank=mine[1], local_world=len(ranks[0]),
                   ranks=ranks)

    @property
    def label(self) -> str:
        """The name of this node's host state (its memfd)."""
        return STATE_LABEL if self.nnodes == 1 else f"{STATE_LABEL}-node{self.node}"

    def local_group(self, backend: str | None = None) -> dist.ProcessGroup:
        """A new group of this node's ranks (every rank calls it, in the same order)."""
        if self.nnodes == 1:
            return dist.new_group(backend=backend)
        return dist.new_subgroups_by_enumeration([list(r) for r in self.ranks], backend=backend)[0]

    def cross_group(self, backend: str | None = None) -> dist.ProcessGroup | None:
        """A new group of the ranks with this local rank, one per node (None on one node)."""
        if self.nnodes == 1:
            return None
        return dist.new_subgroups_by_enumeration(
            [[node[local] for node in self.ranks] for local in range(self.local_world)],
            backend=backend)[0]

    def check_same(self, fields: dict[str, object]) -> None:
        """Refuse nodes whose `fields` (model, configuration) differ from node 0's: one
        NodeMismatch, the same on every rank, naming the first field that differs."""
        if self.nnodes == 1:
            return
        table: list = [None] * sum(len(r) for r in self.ranks)
        dist.all_gather_object(table, fields)
        for n in range(1, self.nnodes):
            theirs = table[self.ranks[n][0]]
            for key, ours in table[self.ranks[0][0]].items():
                if theirs.get(key) != ours:
                    raise NodeMismatch(f"node {n} runs {key} = {theirs.get(key)!r} and node 0 "
                                       f"runs {ours!r}: every node must run the same model, "
                                       "ranks per node and configuration")

    def check_reduction(self, reduction: str) -> None:
        check_nodes_reduction(self.nnodes, reduction)


def node_fields(config: RunConfig, model_args) -> dict[str, object]:
    """What every node must run alike (`Nodes.check_same`), by `section.key`."""
    sections = {"model": model_args, "training": config.training,
                "optimizer": config.optimizer, "slidedp": config.slidedp}
    return {f"{name}.{key}": value for name, section in sections.items()
            for key, value in asdict(section).items()}


def check_nodes_reduction(nnodes: int, reduction: str) -> None:
    """Across nodes the shards reduce on the GPUs (the hierarchical all-reduce): the runtime's
    rule, and the planner's for a plan over several nodes."""
    if nnodes > 1 and reduction != "gpu":
        raise ValueError(f'SlideDP on {nnodes} nodes reduces with slidedp.reduction = '
                         f'"gpu", not {reduction!r} (the runtime styles that set it too)')


def add_other_nodes_loss(totals: torch.Tensor, cross: dist.ProcessGroup | None) -> None:
    """`totals` = [squared norm, loss] summed over this node's ranks: the loss summed over every
    node's too. The norm is the step's already (each node holds every shard of the sum)."""
    if cross is None:
        return
    loss = totals[1:].clone()
    dist.all_reduce(loss, group=cross)
    totals[1:] = loss


class ReplicaCheck:
    """Every `every` steps, compares a CRC-32 of this rank's shards of the optimizer state with
    the same local rank's on every other node, and raises ReplicaDiverged on every rank if any
    node's differs from node 0's (`cross` and `local`: gloo groups of nodes.py)."""

    def __init__(self, nodes: Nodes, *, every: int, cross: dist.ProcessGroup | None,
                 local: dist.ProcessGroup | None):
        self.nodes, self.every, self.cross, self.local = nodes, every, cross, local

    def due(self, step: int) -> bool:
        """A check after `step`: never without replicas (one node, or sharded across nodes)."""
        return self.cross is not None and self.every > 0 and step % self.every == 0

    def check(self, state: SharedHostState, *, step: int) -> None:
        """Compares this rank's shards of `state`'s optimizer regions."""
        crc = 0
        for unit in state.layout.units:
            for region in state.plan.state_regions():
                crc = zlib.crc32(state.shard_view(region, unit).view(torch.uint8).numpy(), crc)
        crcs = [torch.zeros(1, dtype=torch.int64) for _ in range(self.nodes.nnodes)]
        dist.all_gather(crcs, torch.tensor([crc], dtype=torch.int64), group=self.cross)
        differ = (torch.cat(crcs) != crcs[0]).to(torch.int64)
        if self.local is not None:  # every local rank learns what any of them found
            dist.all_reduce(differ, op=dist.ReduceOp.MAX, group=self.local)
        if differ.any():
            nodes = ", ".join(str(n) for n in differ.nonzero().flatten().tolist())
            raise ReplicaDiverged(f"after step {step} the host state of node(s) {nodes} differs "
                                  "from node 0's (a checksum of the master weights and Adam "
                                  "moments): a replica diverged; resume from the last complete "
                                  "save (--checkpoint.resume_from=latest)")
