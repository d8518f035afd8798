"""A backend's process groups, made and ended in the same order on every rank.

Separate communicators: delivery and reduction run in their own threads, so each needs
collectives that are ordered only among themselves. Across nodes (slidedp/nodes.py): each local
rank's shard (the update thread), the totals and checksums (the compute thread, on the host).
With the host state sharded across the nodes (slidedp/node_shards.py), delivery and reduction
span every rank instead, and so do the totals.
"""

import torch
import torch.distributed as dist

from slidedp.layout import NodeShards
from slidedp.nodes import Nodes, add_other_nodes_loss


class RankGroups:
    """The node's gloo group of the host (barriers, broadcasts, totals), then the runtime
    threads' groups (`open`)."""

    def __init__(self, nodes: Nodes, shards: NodeShards, *, distributed: bool):
        """`shards`: the node's part of the host state; one that holds part of every unit
        shards it over every node's ranks (slidedp/node_shards.py)."""
        self.nodes, self.distributed, self.sharded = nodes, distributed, not shards.whole
        self.host = nodes.local_group(backend="gloo") if distributed else None
        self.gather: dist.ProcessGroup | None = None  # the delivery thread's
        self.reduce: dist.ProcessGroup | None = None  # the update thread's
        self.cross: dist.ProcessGroup | None = None  # the update thread's, across nodes
        self.cross_host: dist.ProcessGroup | None = None  # the host's, across nodes
        self.everyone: dist.ProcessGroup | None = None  # the host's, every rank (sharded)

    def open(self, device: torch.device) -> None:
        """The runtime threads' groups, each created now, from one thread, rather than lazily
        inside two worker threads at once."""
        owners = dist.new_group if self.sharded else self.nodes.local_group
        self.gather = owners() if self.distributed else None
        self.reduce = owners() if self.distributed else None
        if self.sharded:
            self.everyone = dist.new_group(backend="gloo")
        else:
            self.cross = self.nodes.cross_group()
            self.cross_host = self.nodes.cross_group(backend="gloo")
        for group in (self.gather, self.reduce, self.cross):
            if group is not None:
                dist.all_reduce(torch.zeros(1, device=device), group=group)

    def barrier(self) -> None:
        if self.nodes.local_world > 1:
            dist.barrier(group=self.host)

    def share(self, value: str) -> str:
        """Rank 0's `value` on every local rank."""
        box = [value]
        if self.nodes.local_world > 1:
            dist.broadcast_object_list(box, group_src=0, group=self.host)
        return box[0]

    def sum_totals(self, totals: torch.Tensor) -> torch.Tensor:
        """A step's host totals (squared norm, loss) summed over the node's ranks, and the other
        nodes' losses added; sharded, summed over every rank (each shard counted once)."""
        if self.everyone is not None:
            dist.all_reduce(totals, group=self.everyone)
            return totals
        if self.nodes.local_world > 1:
            dist.all_reduce(totals, group=self.host)
        add_other_nodes_loss(totals, self.cross_host)
        return totals

    def destroy(self) -> None:
        """End the groups once no thread can issue a collective. Left alive, they live as long
        as the backend (reference cycles: often until interpreter exit), and a gloo worker thread
        that drops a finished collective's tensors after the caller has dropped its own needs the
        GIL; during interpreter finalization that aborts the process ("terminate called without
        an active exception"). Destroyed here, each group joins its threads now (torch releases
        the GIL for it), every rank in the same order."""
        groups = [g for g in (self.host, self.gather, self.reduce, self.cross, self.cross_host,
                              self.everyone) if g is not None]
        self.host = self.gather = self.reduce = self.cross = self.cross_host = None
        self.everyone = None
        for group in groups:
            dist.destroy_process_group(group)
