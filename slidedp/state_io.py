"""The host state's weights in and out: the first fill, the master by name, a load of shards.

Checkpoints of the host state are this rank's shards, written unit by unit
(slidedp/state_file.py); a Hugging Face checkpoint or a random init fills the master (and the
shadow) at the start.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from protocols.model_spec import ModelArgs, ModelSpec
from slidedp import cpu_adam
from slidedp.gpu_update import GpuUpdate
from slidedp.host_state import SharedHostState
from slidedp.layout import Unit
from slidedp.save_gate import SaveGate
from slidedp.state_file import load_shards


def master_view(state: SharedHostState, name: str) -> torch.Tensor:
    """The parameter `name` in the shared master, in its shape."""
    unit, p = state.layout.by_name[name]
    start = unit.host_offset + p.offset
    return state.master[start:start + p.numel].view(p.shape)


def master_parameters(state: SharedHostState) -> Iterator[tuple[str, torch.Tensor]]:
    for name in state.layout.by_name:
        yield name, master_view(state, name)


@torch.no_grad()
def init_weights(state: SharedHostState, spec: ModelSpec, args: ModelArgs, *, hf_dir: str,
                 seed: int, parallel_above: int) -> None:
    """Fill the shared master (and shadow). Checkpoints are read by rank 0. Random init of
    models up to `parallel_above` parameters reproduces the model's init_weights after
    torch.manual_seed(seed) draw for draw (so `single` and `slidedp` start equal); bigger ones
    are drawn by all ranks in parallel, one generator per unit (seed, unit) — minutes saved
    at 8B+, same distribution, different values. A node that holds part of every unit
    (slidedp/node_shards.py) draws or reads every parameter and keeps its part."""
    layout, rank, world = state.layout, state.local_rank, state.shards.count
    mine: list[Unit] = []
    if hf_dir:
        if rank == 0:
            from models.hf_checkpoint import load_hf_into

            expected = {name: p.shape for name, (_, p) in layout.by_name.items()}
            load_hf_into(lambda name, t: _store(state, name, t), hf_dir, expected)
            mine = layout.units
    elif args.num_params() <= parallel_above:
        if rank == 0:
            torch.manual_seed(seed)
            for name in layout.by_name:
                _init_parameter(state, spec, name)
            mine = layout.units
    else:
        mine = layout.units[rank::world]

        def draw(unit: Unit) -> None:
            gen = torch.Generator().manual_seed(seed * 100_003 + unit.index)
            for p in unit.params:
                _init_parameter(state, spec, p.name, generator=gen)

        # torch's CPU normal_ draws on one core; one generator per unit makes the units
        # independent, so this rank's share of the cores draws them at once, same values.
        with ThreadPoolExecutor(cpu_adam.default_num_threads(local_world=world),
                                thread_name_prefix="slidedp-init") as pool:
            list(pool.map(draw, mine))
    if state.plan.bf16_shadow:
        for unit in mine:
            lo, hi = state.shards.span(unit)
            state.unit_view("shadow", unit.index, lo, hi).copy_(
                state.unit_view("master", unit.index, lo, hi))


def _init_parameter(state: SharedHostState, spec: ModelSpec, name: str,
                    generator: torch.Generator | None = None) -> None:
    """Draws in FP32, as `single` does, then stores (a BF16 master: rounded)."""
    master = master_view(state, name)
    in_place = master.dtype == torch.float32 and state.shards.whole
    drawn = master if in_place else torch.empty(master.shape)
    spec.init_parameter(name, drawn, generator=generator)
    if not in_place:
        _store(state, name, drawn)


def _store(state: SharedHostState, name: str, value: torch.Tensor) -> None:
    """The part of parameter `name` that this node holds, from `value` (its whole tensor)."""
    unit, p = state.layout.by_name[name]
    lo, hi = state.shards.span(unit)
    start, end = max(p.offset, lo), min(p.offset + p.numel, hi)
    if start < end:
        state.master[unit.host_offset + start:unit.host_offset + end].copy_(
            value.reshape(-1)[start - p.offset:end - p.offset])


@torch.no_grad()
def load_state(state: SharedHostState, path: str) -> tuple[int, int]:
    """Load this rank's shards, rebuild their BF16 shadow and open the version gates of the
    next step's deliveries; returns the steps taken and Adam's step count."""
    steps, adam_steps = load_shards(state, path)
    for unit in state.layout.units:
        if state.plan.bf16_shadow:
            state.shadow_from_master(unit)
        state.version[unit.index, state.rank] = steps
    return steps, adam_steps


def snapshot_writer(state: SharedHostState, *, units: list[Unit], steps: int, adam_steps: int,
                    pending: list[Future], gpu_updates: list[GpuUpdate], gate: SaveGate,
                    save: Callable[..., None], write_files: bool) -> Callable[[str], None]:
    """A writer of this rank's shards as they are after step `steps`: it waits for that step's
    `pending` updates and the GPU's copies going home, then `save`s (state_file.save_shards)
    unit by unit in the order of `units`, the order the next step updates them, and each unit's
    next update waits until the unit is written (`gate`, armed here). `write_files`: this node
    writes (the other nodes' replicas are the same bytes)."""
    gate.arm(steps, [u.index for u in units])

    def write(path: str) -> None:
        try:
            for fut in pending:
                fut.result()
            for g in gpu_updates:
                g.wait_home()
            if write_files:
                save(state, path, steps_done=steps, adam_steps=adam_steps, units=units,
                     unit_written=lambda u: gate.release(u.index))
        finally:
            gate.release_all()

    return write


def reset_moments(state: SharedHostState) -> None:
    """This rank's Adam moments (and their scales) zero and its version gates closed at 0."""
    for unit in state.layout.units:
        for region in state.plan.state_regions()[1:]:  # the moments (and their scales)
            state.shard_view(region, unit).zero_()
        state.version[unit.index, state.rank] = 0
