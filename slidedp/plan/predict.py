"""A run's plan before anything is allocated: its memory (host and GPU, by part) and its
predicted step, from a RunConfig (slidedp/run_config.py), the model's architecture and a
machine's rates."""

import math
from dataclasses import dataclass, replace
from typing import Literal

from protocols.model_spec import ModelArgs
from slidedp.activations import ActivationPolicy, block_policies
from slidedp.gpu_update import gpu_updated_units
from slidedp.host_state import HostStatePlan, host_state_regions, updates_deferred
from slidedp.layout import chunk_elems, node_layout
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.memory import MemoryEstimate, estimate_device_memory
from slidedp.plan.link import Link
from slidedp.plan.policy_file import activation_keys
from slidedp.plan.rates import Rates
from slidedp.plan.step_spec import Schedule, StepSpec
from slidedp.plan.steptime import simulate_step
from slidedp.plan.verdict import StepPrediction
from slidedp.plan.workload import Workload
from slidedp.run_config import RunConfig


@dataclass(frozen=True)
class RunPlan:
    """What `plan_run` found."""

    policies: tuple[ActivationPolicy, ...]
    """Each block's activation policy."""
    host_parts: dict[str, int]
    """Host bytes by part: the shared state's regions, the ranks' activation offload pools."""
    device: MemoryEstimate
    """One rank's device bytes by part."""
    device_capacity: int
    """One device's bytes (0: unknown)."""
    spec: StepSpec
    """The step the model simulated."""
    step: StepPrediction | None
    """Its prediction (None: not simulated, `plan_run(simulate=False)`)."""
    measured_bytes: bool
    """Every policy's activation bytes were measured (else some come from the shapes)."""
    speculation: "Speculation | None" = None
    """With speculative updates: the step when they are redone, and without speculation."""

    @property
    def host_total(self) -> int:
        return sum(self.host_parts.values())


@dataclass(frozen=True)
class Speculation:
    """Speculative updates (slidedp.speculative_update) against the deferred ones: `RunPlan.step`
    is the step where the norm does not clip and they stand."""

    redone: StepPrediction
    """A step whose norm clips (or is skipped): every update restored and run again."""
    deferred: StepPrediction
    """The same step without speculation."""

    def break_even(self, stands: StepPrediction) -> float:
        """The share of clipping steps below which speculation is faster on average."""
        gain, loss = self.deferred.step_s - stands.step_s, self.redone.step_s - stands.step_s
        if gain <= 0:
            return 0.0
        return 1.0 if loss <= gain else gain / loss


def policies_of(config: RunConfig, args: ModelArgs) -> list[ActivationPolicy]:
    s = config.slidedp
    return block_policies(args.n_layers, default=s.activation, blocks=s.activation_blocks,
                          keep_blocks=s.keep_blocks)


def compute_dtype(config: RunConfig) -> Literal["bf16", "fp32"]:
    """What the run's devices compute in: training.dtype in single and fsdp2; SlideDP's window
    and DeepSpeed (configured so) hold BF16 weights whatever it says."""
    return config.training.dtype if config.mode in ("single", "fsdp2") else "bf16"


def threads_per_rank(config: RunConfig, rates: Rates, world: int) -> int:
    """slidedp.cpu_threads, or this rank's share of the machine's cores (as the engine does)."""
    return config.slidedp.cpu_threads or max(1, rates.machine.cores // world)


def step_spec(config: RunConfig, args: ModelArgs, *, flavor: str, kernels: str, world: int,
              rates: Rates,
              policies: list[ActivationPolicy] | None = None,
              schedule: Schedule = "slidedp", nodes: int = 1,
              link: Link | None = None, device_sync: bool = False) -> StepSpec:
    """The step the model simulates for `config` on `world` ranks of the machine of `rates`
    (on each of `nodes` nodes joined by `link`): with the routes and shadow of its runtime
    style, as the engine runs them; `device_sync`: the loop waits for the device after each
    step (StepSpec.device_sync)."""
    tr = config.training
    s = RUNTIME_STYLES[config.slidedp.runtime].configure(config.slidedp)
    policies = list(policies or policies_of(config, args))
    work = Workload(rates, args, flavor=flavor, kernels=kernels, seq=tr.seq_len)
    batch = tr.local_batch_size
    offloaded = {p: work.activation_bytes(p, batch)[1] for p in set(policies)}
    sharded = nodes > 1 and config.slidedp.nodes_state == "sharded"
    layout, _ = node_layout(args, ranks=world, nodes=nodes, sharded=sharded)
    host = state_plan(config)
    return StepSpec(
        world=world, slots=s.window_slots, delivery=s.delivery, reduction=s.reduction,
        chunk_elems=chunk_elems(s.chunk_mib), bf16_shadow=s.bf16_shadow,
        micro_batches=tr.grad_accum_steps, deferred=updates_deferred(max_norm=tr.max_norm, nonfinite=tr.nonfinite,
                                  reduction=s.reduction),
        grad_accum=host.grad_accum, threads=threads_per_rank(config, rates, world),
        cores=rates.machine.cores, unit_elems=tuple(u.padded for u in layout.units),
        work=work.micro_batch(policies, batch), offload=tuple(p.offload for p in policies),
        offload_bytes=tuple(offloaded[p] for p in policies),
        tokens=batch * tr.seq_len * tr.grad_accum_steps * world * nodes, schedule=schedule,
        kernels=kernels, embedding_on_gpu=s.embedding_update == "gpu",
        resident_units=frozenset(u for u, resident in gpu_updated_units(s, args.n_layers).items() if resident),
        moments=host.moments, speculative="stands" if host.redo else "off", nodes=nodes,
        link=link, sharded_nodes=sharded, device_sync=device_sync)


def state_plan(config: RunConfig) -> HostStatePlan:
    """The host state's regions `config` needs (slidedp/host_state.py)."""
    tr = config.training
    return HostStatePlan.for_run(config.slidedp, grad_accum_steps=tr.grad_accum_steps,
                                 max_norm=tr.max_norm, nonfinite=tr.nonfinite)


def plan_run(config: RunConfig, args: ModelArgs, *, flavor: str, kernels: str, world: int,
             rates: Rates,
             policies: list[ActivationPolicy] | None = None,
             schedule: Schedule = "slidedp", simulate: bool = True, nodes: int = 1,
             link: Link | None = None, device_sync: bool = False) -> RunPlan:
    """Memory and the predicted step of `config` (parallelism.mode = "slidedp") on `world`
    ranks of the machine of `rates`, on each of `nodes` nodes joined by `link` (memory is per
    node: each holds its replica, or its 1/N with slidedp.nodes_state = "sharded"). `policies` replace the configuration's per-block ones;
    without `simulate`, the memory alone (for rates that cannot time the step); `device_sync`:
    as step_spec's."""
    if policies is not None:
        config = with_policies(config, policies)
    tr = config.training
    policies = policies_of(config, args)
    work = Workload(rates, args, flavor=flavor, kernels=kernels, seq=tr.seq_len)
    batch, tokens = tr.local_batch_size, tr.local_batch_size * tr.seq_len
    layout, shards = node_layout(args, ranks=world, nodes=nodes,
                                 sharded=config.slidedp.nodes_state == "sharded")
    host_parts = {name: size * shards.count // shards.world
                  for name, size in host_state_regions(layout, state_plan(config)).items()}
    host_parts["offload pools"] = world * sum(work.activation_bytes(p, batch)[1] for p in policies)
    measured = all(work.has_measured_bytes(p) for p in set(policies))
    device = estimate_device_memory(
        config, args, world=world, kernels=kernels,
        block_bytes=(lambda p: work.activation_bytes(p, batch)[0] / tokens) if measured else None)
    spec = step_spec(config, args, flavor=flavor, kernels=kernels, world=world, rates=rates,
                     schedule=schedule, nodes=nodes, link=link, device_sync=device_sync)
    speculation = None
    if simulate and spec.speculative != "off":
        speculation = Speculation(redone=simulate_step(replace(spec, speculative="redone"), rates),
                                  deferred=simulate_step(replace(spec, speculative="off"), rates))
    return RunPlan(policies=tuple(policies), host_parts=host_parts, device=device,
                   device_capacity=math.floor(rates.machine.device_memory_gib * 2**30),
                   spec=spec, step=simulate_step(spec, rates) if simulate else None,
                   measured_bytes=measured,
                   speculation=speculation)


def with_policies(config: RunConfig, policies: list[ActivationPolicy]) -> RunConfig:
    """`config` with its per-block policies set to `policies`."""
    return with_slidedp(config, **activation_keys(policies))


def with_slidedp(config: RunConfig, **changes) -> RunConfig:
    """`config` with some [slidedp] keys changed (the others shared)."""
    return replace(config, slidedp=replace(config.slidedp, **changes))
