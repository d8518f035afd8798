"""Where every parameter lives in the flat host state, and which rank owns which slice.

The model is cut into *units* (its spec's `units`): the embedding, each transformer block, and
the head (final norm + untied LM head). A unit's parameters are concatenated into one flat range,
padded so that it splits into `world` equal, aligned shards; rank r owns shard r of every unit
(it reduces, returns and updates that slice), or with `sole_owner` (SlideFormer-style) rank 0 owns
every unit. The layout is independent of the delivery/reduction route, so routes can change per
run (or per layer) without touching the state.
"""

import math
from dataclasses import dataclass
from functools import cache

import torch

from protocols.model_spec import ModelArgs, spec_of

# Shard boundaries fall on 128 elements: 512 B of FP32, a multiple of the cache line and of
# every SIMD width the CPU Adam kernel uses.
SHARD_ALIGN = 128
NODE_ALIGN = 4096
"""A node's part of a unit, when each node holds part of every unit (`NodeShards`), is whole
4 KiB pages of every region (1-byte elements or wider): no page holds two nodes' parts."""


def chunk_elems(chunk_mib: float) -> int:
    """Elements per chunk of the copy and update pipelines: slidedp.chunk_mib of BF16, whole
    shard-alignment units (at least one)."""
    return max(SHARD_ALIGN, int(chunk_mib * 2**20 / 2) // SHARD_ALIGN * SHARD_ALIGN)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside its unit's flat range."""

    name: str
    """Full model parameter name (e.g. "layers.3.mlp.up_proj.weight")."""
    local_name: str
    """Name relative to the unit's module (e.g. "mlp.up_proj.weight")."""
    shape: torch.Size
    """Parameter shape."""
    offset: int
    """Element offset inside the unit's flat range."""

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class Unit:
    """A group of parameters delivered, reduced and updated together."""

    index: int
    """Position in forward order (0 = embedding, last = head)."""
    kind: str
    """"embed", "block" or "head"."""
    params: tuple[ParamSlot, ...]
    """Parameters in flat order."""
    numel: int
    """Real elements (without padding)."""
    padded: int
    """Elements including padding; divisible by world * SHARD_ALIGN (and nodes * NODE_ALIGN)."""
    host_offset: int
    """Element offset of this unit in the host state's flat arrays."""
    sole_owner: bool = False
    """Rank 0 owns the whole unit and the other ranks nothing (slidedp.runtime = "slideformer")."""

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """[start, end) of rank's shard, in elements relative to the unit."""
        if self.sole_owner:
            return (0, self.padded) if rank == 0 else (self.padded, self.padded)
        size = self.padded // world
        return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class NodeShards:
    """The part of every unit a node's host state holds: the shards of owners [first, first +
    count) of `world`, one contiguous span per unit (all of it when count = world)."""

    first: int
    """The node's first owner."""
    count: int
    """Owners on the node."""
    world: int
    """Owners in all."""

    @property
    def whole(self) -> bool:
        return self.count == self.world

    @property
    def nodes(self) -> int:
        return self.world // self.count

    def span(self, unit: Unit) -> tuple[int, int]:
        """[start, end) of the node's part of `unit`, in elements relative to the unit."""
        if self.whole:
            return 0, unit.padded
        size = unit.padded // self.world
        return self.first * size, (self.first + self.count) * size


@cache
def unit_params(args: ModelArgs) -> tuple:
    """The spec's `units(args)`, once per flavor: it builds the model on the meta device, which
    takes longer than the step-time model's whole simulation of a step, and the planner lays
    the same model out for every option it prices."""
    return tuple((kind, tuple(params)) for kind, params in spec_of(args).units(args))


class StateLayout:
    """The flat layout of one model's parameters for `world` owners."""

    def __init__(self, args: ModelArgs, *, world: int, sole_owner: bool = False, nodes: int = 1):
        """`sole_owner`: rank 0 owns every unit (the padding stays the same); `nodes`: the
        owners' nodes, each holding its owners' part of every unit (NODE_ALIGN)."""
        self.args, self.world = args, world
        quantum = world * SHARD_ALIGN
        if nodes > 1:
            quantum = math.lcm(quantum, nodes * NODE_ALIGN)
        self.units: list[Unit] = []
        host_offset = 0
        for index, (kind, params) in enumerate(unit_params(args)):
            slots, off = [], 0
            for name, local, shape in params:
                slots.append(ParamSlot(name=name, local_name=local, shape=shape, offset=off))
                off += shape.numel()
            padded = -(-off // quantum) * quantum
            self.units.append(Unit(index=index, kind=kind, params=tuple(slots), numel=off,
                                   padded=padded, host_offset=host_offset,
                                   sole_owner=sole_owner))
            host_offset += padded
        self.total = host_offset
        """Elements in each flat host array (all units, padded)."""
        self.by_name = {p.name: (u, p) for u in self.units for p in u.params}

    @property
    def blocks(self) -> list[Unit]:
        return [u for u in self.units if u.kind == "block"]

    @property
    def embed(self) -> Unit:
        return self.units[0]

    @property
    def head(self) -> Unit:
        return self.units[-1]

    @property
    def block_padded(self) -> int:
        """Flat size of one block slot on the GPU (all blocks have the same shape)."""
        return self.units[1].padded


def node_layout(args: ModelArgs, *, ranks: int, nodes: int,
                sharded: bool) -> tuple[StateLayout, NodeShards]:
    """The layout of `ranks` ranks per node on `nodes` nodes and the part of it a node holds:
    with `sharded` (slidedp.nodes_state) every rank of every node owns a shard of every unit and
    a node holds its ranks' part; otherwise each node lays out its own ranks' whole replica."""
    if nodes == 1 or not sharded:
        return StateLayout(args, world=ranks), NodeShards(first=0, count=ranks, world=ranks)
    owners = ranks * nodes
    return (StateLayout(args, world=owners, nodes=nodes),
            NodeShards(first=0, count=ranks, world=owners))


def chunks(n: int, chunk: int) -> list[int]:
    """Sizes of the chunks of `n` elements, `chunk` at a time."""
    full, rest = divmod(n, chunk)
    return [chunk] * full + ([rest] if rest else [])
