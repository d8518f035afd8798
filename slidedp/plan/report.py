"""A plan in words: what a run needs (host and device memory, by part) and how fast it will go
(the predicted step, per-resource demand and busy time, the bottleneck and what would move it).
Where the device is the CPU it is called the device, its memory the host's. The command line
that prints it is recipes/plan.py (`python -m recipes.plan CONFIG`)."""

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import get_args

from protocols.model_spec import ModelArgs
from slidedp.activations import KEEP, RECOMPUTE, format_blocks
from slidedp.plan.link import Link
from slidedp.plan.memory import REFUSE_ABOVE, MemoryEstimate
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.policy_file import policy_settings, write_policy_file
from slidedp.plan.predict import RunPlan, compute_dtype, plan_run, policies_of
from slidedp.plan.rates import MissingRate, Rates
from slidedp.plan.search import (GPU_BUDGET_FRACTION, HOST_BUDGET_FRACTION, Model, Setting,
                                  assign, budgets, build_program, candidates_of, fitting,
                                  resident_levels, runs, screen, setting_of, solve_modelled)
from slidedp.plan.step_spec import Schedule
from slidedp.plan.workload import Workload
from slidedp.routes.build import searched_routes
from slidedp.run_config import RunConfig

GiB = 2**30


@dataclass(frozen=True)
class Job:
    """A configuration as the planner reads it."""

    config: RunConfig
    """The run's configuration (the recipes build it: recipes/config.py run_config)."""
    flavor: str
    """The model's flavor name (or "custom (<dir>)")."""
    args: ModelArgs
    """Its architecture."""


def kernels_for(config: RunConfig, rates: Rates) -> str:
    """What [model] kernels resolves to on the machine of `rates` ("auto": liger on a GPU, as
    the runtime picks it where liger-kernel is installed, a dependency of this package)."""
    choice = config.model.kernels
    if choice != "auto":
        return choice
    return "torch" if rates.machine.on_cpu else "liger"


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (the debug models are small)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _on_device(name: str, rates: Rates) -> str:
    """A resource's name (slidedp/plan/steptime.py's, e.g. "gpu compute") for this device."""
    word = rates.machine.device_word
    return name.replace("gpu", word.lower()).replace("GPU", word)


def _device_memory(rates: Rates) -> str:
    """What the memory line is of."""
    return ("device memory per rank (the CPU's: host memory)" if rates.machine.on_cpu
            else "GPU memory per rank")


def dtype_note(job: Job, rates: Rates) -> list[str]:
    """A line where the rates were timed in another dtype than the run computes in."""
    run = compute_dtype(job.config)
    if rates.compute_dtype == run:
        return []
    return [f"compute: these rates were timed in {rates.compute_dtype}, this run computes in "
            f"{run} (training.dtype): its compute times are {rates.compute_dtype}'s"]


def issue_note(rates: Rates, kernels: str) -> list[str]:
    """A line where GPU rates hold no launch (issue) times for `kernels`: the model then counts
    the host's launches as free, while at few sequences a block's launches can outlast its
    kernels."""
    if rates.machine.on_cpu or any(k.startswith(f"{kernels}/") for k in rates.issue_s):
        return []
    return [f"launches: these rates hold no launch times for the {kernels} kernels, so the step "
            f"counts the host's kernel launches as free (`python -m recipes.probe` on the "
            f"machine measures them)"]


def describe_rates(rates: Rates) -> str:
    m = rates.machine
    label = {"measured": "measured here", "recorded": "taken from recorded runs",
             "spec": "derived from published specs, not measured"}[m.source]
    return f"{m.name} (rates {label})"


def describe_nodes(nodes: int, link: Link | None, state: str) -> list[str]:
    """The line of a plan over several nodes: how many, how they hold the host state
    (slidedp.nodes_state), and their link."""
    if nodes == 1:
        return []
    label = {"measured": "measured", "spec": "from published line rates, not measured"}[link.source]
    held = "host state sharded across them" if state == "sharded" else "replicated host state"
    return [f"x {nodes} nodes ({held}, memory below per node), joined by "
            f"{link.name} (link rates {label}; a predicted step)"]


def format_memory(plan: RunPlan, rates: Rates) -> list[str]:
    host = plan.host_parts
    parts = ", ".join(f"{name} {_gib(n)}" for name, n in host.items() if n and name != "control")
    have = rates.machine.host_memory_gib * GiB
    verdict = "fits" if plan.host_total <= have else "DOES NOT FIT"
    dev, cap = plan.device, plan.device_capacity
    fit = "" if not cap else (f" of {_gib(cap)}: fits" if dev.total <= cap else
                              f" of {_gib(cap)}: {'DOES NOT FIT' if dev.total > cap * REFUSE_ABOVE else 'tight'}")
    source = "measured activation bytes" if plan.measured_bytes else "activations from the shapes"
    return [f"host memory: {_gib(plan.host_total)} ({parts}) of {_gib(have)}: {verdict}",
            f"{_device_memory(rates)}: {_gib(dev.total)} (resident {_gib(dev.resident)}, "
            f"activations {_gib(dev.activations)}, logits {_gib(dev.logits)}; {source}){fit}"]


def format_step(plan: RunPlan, rates: Rates) -> list[str]:
    p, spec, word = plan.step, plan.spec, rates.machine.device_word
    lines = [f"predicted step: {p.step_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s "
             f"({spec.tokens:,} tokens per step); service-demand lower bound {p.bound_s:.3f} s "
             f"({_on_device(p.bound_resource, rates)})",
             f"  {'resource':<14} {'demand s':>9} {'busy s':>9}   {word} idle while first busy"]
    exposed = {"h2d per GPU": "h2d", "interconnect": "collective", "inter-node link": "inter-node",
               "d2h per GPU": "d2h", "cpu update": "cpu update"}
    for name, demand in p.demand_s.items():
        if name == "gpu compute" or demand or p.busy_s.get(name):
            shown = exposed.get(name)
            idle = f"{p.exposed_s[shown]:.3f} s" if shown else ""
            lines.append(f"  {_on_device(name, rates):<14} {demand:>9.3f} "
                         f"{p.busy_s.get(name, 0.0):>9.3f}   {idle}")
    rest = {k: v for k, v in p.exposed_s.items() if k in ("cast", "other") and v > 0.0005}
    if rest:
        lines.append(f"  {word} idle otherwise: "
                     + ", ".join(f"{k} {v:.3f} s" for k, v in rest.items()))
    lines.append(f"bottleneck: {p.regime}: {p.why}")
    lines.append(f"what would move it: {p.advice}")
    if plan.speculation is not None:
        sp = plan.speculation
        lines.append(f"speculative updates: {p.step_s:.3f} s a step whose norm does not clip, "
                     f"{sp.redone.step_s:.3f} s one that clips (redone), against "
                     f"{sp.deferred.step_s:.3f} s deferred: they pay while fewer than "
                     f"{sp.break_even(p):.0%} of the steps clip")
    return lines


def describe_run(job: Job, *, world: int, kernels: str) -> str:
    # The routes and shadow the runtime style runs, not only the ones the config names.
    tr, s = job.config.training, RUNTIME_STYLES[job.config.slidedp.runtime].configure(
        job.config.slidedp)
    shadow = "bf16 shadow" if s.bf16_shadow else "FP32 cast on delivery"
    clip = ("updates deferred to the norm (clipping)" if tr.max_norm > 0 else
            "updates deferred to the norm (non-finite guard)" if tr.nonfinite != "off" else
            "updates deferred to the end of backward (the locked route's one sum)"
            if s.reduction == "locked" else "updates during backward")
    return (f"{job.flavor}: {job.args.num_params() / 1e9:.2f}B params, {job.args.n_layers} blocks; "
            f"{world} rank(s) x {tr.grad_accum_steps} x {tr.local_batch_size} x {tr.seq_len} "
            f"tokens; {s.delivery}/{s.reduction}, {s.window_slots} slots, chunk {s.chunk_mib:g} "
            f"MiB, {shadow}, {clip}; {kernels} kernels")


DeviceMemory = Callable[..., MemoryEstimate]
"""`(args, *, world, kernels) -> MemoryEstimate`: a mode's device estimate (of the recipes'
configuration)."""


def plan_text(job: Job, rates: Rates, *, world: int,
              resident_memory: DeviceMemory | None = None, nodes: int = 1,
              link: Link | None = None) -> list[str]:
    """The printed plan of `job` on `world` ranks of the machine of `rates` (SlideDP: on each of
    `nodes` nodes joined by `link`). A mode that keeps the model on the device (single, fsdp2)
    needs `resident_memory`, its device estimate: the recipes model those modes
    (recipes/preflight.py's device_memory), not this package."""
    kernels = kernels_for(job.config, rates)
    config = job.config
    if config.mode != "slidedp":
        if resident_memory is None:
            raise ValueError(f"plan_text: mode {config.mode!r} needs its "
                             "resident_memory estimate")
        est = resident_memory(job.args, world=world, kernels=kernels)
        return _resident_mode_text(job, rates, est, world=world, kernels=kernels)
    # A peer runtime style (slidedp.runtime) is simulated with its own schedule where the model
    # has one; its routes and host regions come from the style either way.
    runtime = config.slidedp.runtime
    modelled = runtime in get_args(Schedule)
    run = dict(flavor=job.flavor, kernels=kernels, world=world, rates=rates,
               schedule=runtime if modelled else "slidedp", nodes=nodes, link=link)
    try:
        plan = plan_run(config, job.args, **run)
        step = format_step(plan, rates)
    except MissingRate as e:  # the memory can still be said
        plan = plan_run(config, job.args, **run, simulate=False)
        step = [f"predicted step: none: {e}"]
    caveat = [] if modelled else [f"step: simulated with SlideDP's own schedule (the model has "
                                  f"none for the {runtime} runtime)"]
    return [f"plan of {describe_run(job, world=world, kernels=kernels)}",
            f"on {describe_rates(rates)}", *describe_nodes(nodes, link, config.slidedp.nodes_state),
            f"activations: {format_blocks(list(plan.policies))}",
            *dtype_note(job, rates), *issue_note(rates, kernels), *format_memory(plan, rates),
            *caveat, *step]


def _resident_mode_text(job: Job, rates: Rates, est: MemoryEstimate, *, world: int,
                        kernels: str) -> list[str]:
    """single / fsdp2: the device estimate `est` and the compute alone, a lower bound of the
    step (the step-time model simulates SlideDP's schedules)."""
    config, tr = job.config, job.config.training
    # "selective" (torchtitan's op-level policy) replays less than full: keep is the bound.
    policy = RECOMPUTE if config.activation_checkpoint == "full" else KEEP
    work = Workload(rates, job.args, flavor=job.flavor, kernels=kernels, seq=tr.seq_len)
    seconds = work.micro_batch([policy] * job.args.n_layers, tr.local_batch_size).total * tr.grad_accum_steps
    tokens = tr.local_batch_size * tr.seq_len * tr.grad_accum_steps * world
    cap = rates.machine.device_memory_gib * GiB
    fit = "" if not cap else f" of {_gib(cap)}: {'fits' if est.total <= cap * REFUSE_ABOVE else 'DOES NOT FIT'}"
    mode = config.activation_checkpoint
    checkpointing = "no" if mode == "none" else mode
    return [f"plan of {job.flavor} in mode {config.mode} on {world} rank(s), "
            f"{tr.grad_accum_steps} x {tr.local_batch_size} x {tr.seq_len} tokens; {kernels} "
            f"kernels, {compute_dtype(config)} compute",
            f"on {describe_rates(rates)}", *dtype_note(job, rates),
            f"{_device_memory(rates)}: {_gib(est.total)} ({est.parts(_gib)}){fit}",
            f"compute alone (forward + backward, {checkpointing} activation checkpointing): "
            f"{seconds:.3f} s per step, {tokens / seconds:,.0f} tokens/s: a lower bound of this "
            f"mode's step (the step-time model simulates SlideDP; --parallelism.mode=slidedp plans it)"]


def no_fit(model: Model, settings: list[Setting], *, gpu_budget: float,
           host_budget: float) -> list[str]:
    """Why no setting fits the search's budgets before any block's activations: the least
    any takes of each memory, against its budget."""
    sizes = [model.fixed_bytes(s) for s in settings]
    gpu = min(max(g, floor) for g, _, floor in sizes)
    host = min(h for _, h, _ in sizes)
    device = model.rates.machine.device_word
    lines = [f"search: no configuration fits the search's budgets before any block's "
             f"activations: the least any takes is {_gib(gpu)} of {_gib(gpu_budget)} on the "
             f"{device} ({GPU_BUDGET_FRACTION:.0%} of it) and {_gib(host)} of "
             f"{_gib(host_budget)} on the host ({HOST_BUDGET_FRACTION:.0%} of it)"]
    if host > host_budget and model.config.slidedp.moments_dtype == "float32":
        lines.append("  the host state is 14 B/param with FP32 moments: slidedp.moments_dtype = "
                     "\"bfloat16\" takes 10, \"8bit\" 8")
    return lines


def search_offline(job: Job, rates: Rates, *, world: int, out: str,
                   say: Callable[[str], None] = lambda line: None) -> list[str]:
    """`plan --search`: the model's best configuration for `job`, written to `out`; `say`
    takes a line at each stage (each prices many steps, a large model's simulated in seconds)."""
    config, args = job.config, job.args
    start = time.perf_counter()
    model = Model(config, args, job.flavor, kernels_for(config, rates), world, rates)
    base = setting_of(config)
    routes = searched_routes() if world > 1 else [(base.delivery, "gpu")]
    slots = sorted({2, 3, 4, 6, base.window_slots})
    settings = [s for (d, r), n, shadow, (blocks, embedding) in itertools.product(
                    routes, slots, (True, False), resident_levels(config, args.n_layers))
                if runs(s := Setting(d, r, n, base.chunk_mib, shadow, blocks, embedding),
                        config, args.n_layers, world=world)]
    gpu_budget, host_budget = budgets(model)
    fits = fitting(model, settings, gpu_budget=gpu_budget, host_budget=host_budget)
    if not fits:
        return no_fit(model, settings, gpu_budget=gpu_budget, host_budget=host_budget)
    candidates = screen(model, [*candidates_of(config), *policies_of(config, args)])
    say(f"[search] pricing {len(fits)} options and {len(candidates)} candidate policies, a "
        f"simulated step each")
    options, choices, rebuild = build_program(model, fits, candidates)
    say(f"[search] the program, re-priced by simulation ({time.perf_counter() - start:.0f} s)")
    found = solve_modelled(model, options, choices, gpu_budget=gpu_budget,
                           host_budget=host_budget, rebuild_bytes=rebuild)
    if found is None:
        return [f"search: no configuration fits the {rates.machine.device_word} and host memory "
                "budgets"]
    policies = assign(found, args.n_layers)
    say(f"[search] the chunk ({time.perf_counter() - start:.0f} s)")
    chunks = sorted({8.0, 32.0, 128.0, base.chunk_mib})
    step_s, best = min(((model.step_s(s, policies), s) for s in (
        replace(Setting(**found.option.settings), chunk_mib=c) for c in chunks)),
        key=lambda scored: scored[0])
    current = policies_of(config, args)
    now = model.step_s(base, current)
    # The program adds demands up; the simulation, which overlaps them, has the last word: a
    # choice it puts behind the configuration searched from is not taken, unless that
    # configuration itself does not fit the budgets the program kept to.
    fixed_gpu, fixed_host, floor_gpu = model.fixed_bytes(base)
    act_gpu, act_host = model.activation_bytes(current)
    base_fits = (max(floor_gpu, fixed_gpu + act_gpu) <= gpu_budget
                 and fixed_host + act_host <= host_budget)
    kept = base_fits and step_s > now
    if kept:
        best, policies = base, current
    chosen = best.apply(config)
    plan = plan_run(chosen, args, flavor=job.flavor, kernels=model.kernels, world=world,
                    rates=rates, policies=policies)
    settings_out = policy_settings(**{k: v for k, v in best.__dict__.items()}, policies=policies)
    write_policy_file(out, settings_out, comments=[
        f"chosen by `python -m recipes.plan --search` from the step-time model alone, on "
        f"{rates.machine.name} ({rates.machine.source} rates), {world} rank(s)",
        f"predicted step {plan.step.step_s:.3f} s against {now:.3f} s for the configuration "
        f"searched from; not measured (AutoPolicy live measures: slidedp.autopolicy = true)"])
    return ["search (the model alone, nothing measured):",
            f"  screened {len(candidates)} candidate policies, {len(options)} options "
            f"(routes x slots x shadow x optimizer placement), then the chunk",
            *(["  the program's choice simulates slower than the configuration searched from, "
               "which stays the choice"] if kept else []),
            *([f"  the configuration searched from does not fit the search's budgets "
               f"({GPU_BUDGET_FRACTION:.0%} of the {rates.machine.device_word}, "
               f"{HOST_BUDGET_FRACTION:.0%} of the host)"] if not base_fits else []),
            f"  choice: {best.describe()}; activations {format_blocks(policies)}",
            f"  predicted {plan.step.step_s:.3f} s per step ({plan.step.tokens_per_s:,.0f} tokens/s) "
            f"against {now:.3f} s now; {plan.step.regime}: {plan.step.why}",
            *("  " + line for line in format_memory(plan, rates)),
            f"  written to {out} (load it with --slidedp.policy_file={out})"]
