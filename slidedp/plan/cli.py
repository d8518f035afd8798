"""`python -m slidedp.plan CONFIG [--section.key=value ...] [--rates R] [--ngpu N] [--search]`
and `python -m slidedp.probe CONFIG [...]`: what a run needs and how fast it will go, printed
before anything is allocated.

A plan needs the rates of the machine it is for: `--rates NAME` (a file shipped in
slidedp/plan/rates/, e.g. h200x2, a800x8_nvlink) or `--rates FILE`; without it, the probe's
cache for this machine and model, else the probe runs here (on a GPU; on the CPU only for small
models), which is what `python -m slidedp.probe` does on its own (under torchrun with every
GPU, to measure the links with all GPUs copying and the collectives).
"""

import argparse
import sys
from dataclasses import dataclass

import torch

from models.args import QwenArgs
from slidedp.plan.memory import REFUSE_ABOVE
from slidedp.plan.predict import RunPlan, plan_run, policies_of
from slidedp.plan.rates import Rates, load_rates
from slidedp.plan.workload import Workload

GiB = 2**30


class PlanError(ValueError):
    """A one-line, user-facing error of the planner."""


@dataclass(frozen=True)
class Job:
    """A configuration as the planner reads it."""

    config: object
    """The recipe's JobConfig."""
    flavor: str
    """The model's flavor name (or "custom (<dir>)")."""
    args: QwenArgs
    """Its architecture."""


def load_job(flags: list[str]) -> Job:
    """The configuration of `flags` read, checked and resolved exactly as a run would. The
    recipe owns the TOML format and its checks (recipes/config.py), so this command uses them:
    the one import of recipes/ under slidedp/, in the command line alone (the planner's modules
    take the configuration as an argument)."""
    from recipes.config import ConfigError, parse_config, resolve_model

    try:
        config = parse_config(flags)
        flavor, args = resolve_model(config)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    return Job(config=config, flavor=flavor, args=args)


def kernels_for(config, rates: Rates) -> str:
    """What [model] kernels resolves to on the machine of `rates` ("auto": liger on a GPU, as
    the runtime picks it where liger-kernel is installed, a dependency of this package)."""
    choice = config.model.kernels
    if choice != "auto":
        return choice
    return "torch" if rates.machine.device == "cpu" else "liger"


def rates_for(job: Job, *, rates: str, refresh: bool = False) -> Rates:
    """`--rates` if given, else this machine's (cached, or probed now)."""
    if rates:
        try:
            return load_rates(rates)
        except (FileNotFoundError, ValueError) as e:
            raise PlanError(f"--rates: {e}") from None
    from models.kernels import resolve_kernels
    from slidedp.plan.autopolicy import candidates_of
    from slidedp.plan.probe import probe

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    config = job.config
    kernels = resolve_kernels(config.model.kernels, attention=config.model.attention,
                              device_type=device.type)
    policies = [*policies_of(config, job.args), *candidates_of(config)]
    try:
        return probe(job.args, flavor=job.flavor, kernels=kernels, policies=policies,
                     seq=config.training.seq_len, batch=config.training.local_batch_size,
                     loss_chunk=config.training.loss_chunk_tokens, device=device, refresh=refresh)
    except ValueError as e:
        raise PlanError(str(e)) from None


# ---- printing ------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (the debug models are small)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def describe_rates(rates: Rates) -> str:
    m = rates.machine
    label = {"measured": "measured here", "recorded": "taken from recorded runs",
             "spec": "derived from published specs, not measured"}[m.source]
    return f"{m.name} (rates {label})"


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
            f"GPU memory per rank: {_gib(dev.total)} (resident {_gib(dev.resident)}, activations "
            f"{_gib(dev.activations)}, logits {_gib(dev.logits)}; {source}){fit}"]


def format_step(plan: RunPlan) -> list[str]:
    p, spec = plan.step, plan.spec
    lines = [f"predicted step: {p.step_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s "
             f"({spec.tokens:,} tokens per step); service-demand lower bound {p.bound_s:.3f} s "
             f"({p.bound_resource})",
             f"  {'resource':<14} {'demand s':>9} {'busy s':>9}   GPU idle while first busy"]
    exposed = {"h2d per GPU": "h2d", "interconnect": "collective", "d2h per GPU": "d2h",
               "cpu update": "cpu update"}
    for name, demand in p.demand_s.items():
        if name == "gpu compute" or demand or p.busy_s.get(name):
            shown = exposed.get(name)
            idle = f"{p.exposed_s[shown]:.3f} s" if shown else ""
            lines.append(f"  {name:<14} {demand:>9.3f} {p.busy_s.get(name, 0.0):>9.3f}   {idle}")
    rest = {k: v for k, v in p.exposed_s.items() if k in ("cast", "other") and v > 0.0005}
    if rest:
        lines.append("  GPU idle otherwise: " + ", ".join(f"{k} {v:.3f} s" for k, v in rest.items()))
    lines.append(f"bottleneck: {p.regime}: {p.why}")
    lines.append(f"what would move it: {p.advice}")
    return lines


def describe_run(job: Job, *, world: int, kernels: str) -> str:
    tr, s = job.config.training, job.config.slidedp
    shadow = "bf16 shadow" if s.bf16_shadow else "FP32 cast on delivery"
    clip = ("updates deferred to the norm (clipping)" if tr.max_norm > 0 else
            "updates deferred to the norm (non-finite guard)" if tr.nonfinite != "off" else
            "updates during backward")
    return (f"{job.flavor}: {job.args.num_params() / 1e9:.2f}B params, {job.args.n_layers} blocks; "
            f"{world} rank(s) x {tr.grad_accum_steps} x {tr.local_batch_size} x {tr.seq_len} "
            f"tokens; {s.delivery}/{s.reduction}, {s.window_slots} slots, chunk {s.chunk_mib:g} "
            f"MiB, {shadow}, {clip}; {kernels} kernels")


def plan_text(job: Job, rates: Rates, *, world: int) -> list[str]:
    """The printed plan of `job` on `world` ranks of the machine of `rates`."""
    kernels = kernels_for(job.config, rates)
    config = job.config
    if config.parallelism.mode != "slidedp":
        return _resident_mode_text(job, rates, world=world, kernels=kernels)
    plan = plan_run(config, job.args, flavor=job.flavor, kernels=kernels, world=world, rates=rates)
    from slidedp.activations import format_blocks

    return [f"plan of {describe_run(job, world=world, kernels=kernels)}",
            f"on {describe_rates(rates)}",
            f"activations: {format_blocks(list(plan.policies))}",
            *format_memory(plan, rates), *format_step(plan)]


def _resident_mode_text(job: Job, rates: Rates, *, world: int, kernels: str) -> list[str]:
    """single / fsdp2: the device estimate and the compute alone, a lower bound of the step
    (the step-time model simulates SlideDP's schedules)."""
    from slidedp.activations import KEEP, RECOMPUTE
    from slidedp.plan.memory import estimate_device_memory

    config, tr = job.config, job.config.training
    est = estimate_device_memory(config, job.args, world=world, kernels=kernels)
    policy = RECOMPUTE if config.activation_checkpoint.mode == "full" else KEEP
    work = Workload(rates, job.args, flavor=job.flavor, kernels=kernels, seq=tr.seq_len)
    seconds = work.micro_batch([policy] * job.args.n_layers, tr.local_batch_size).total * tr.grad_accum_steps
    tokens = tr.local_batch_size * tr.seq_len * tr.grad_accum_steps * world
    cap = rates.machine.device_memory_gib * GiB
    fit = "" if not cap else f" of {_gib(cap)}: {'fits' if est.total <= cap * REFUSE_ABOVE else 'DOES NOT FIT'}"
    return [f"plan of {job.flavor} in mode {config.parallelism.mode} on {world} rank(s), "
            f"{tr.grad_accum_steps} x {tr.local_batch_size} x {tr.seq_len} tokens; {kernels} kernels",
            f"on {describe_rates(rates)}",
            f"GPU memory per rank: {_gib(est.total)} (resident {_gib(est.resident)}, gradients "
            f"{_gib(est.gradients)}, activations {_gib(est.activations)}, logits {_gib(est.logits)}){fit}",
            f"compute alone (forward + backward, {config.activation_checkpoint.mode} checkpointing): "
            f"{seconds:.3f} s per step, {tokens / seconds:,.0f} tokens/s: a lower bound of this "
            f"mode's step (the step-time model simulates SlideDP; --parallelism.mode=slidedp plans it)"]


# ---- the commands --------------------------------------------------------------------------------


def _split(argv: list[str], parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the configuration's flags (--section.key=value) with the TOML file."""
    ours, flags = parser.parse_known_args(argv)
    config_flags = [f"--job.config_file={ours.config}"] if ours.config else []
    for flag in flags:
        if not flag.startswith("--") or "." not in flag.partition("=")[0]:
            parser.error(f"unrecognized argument {flag!r} (configuration flags are "
                         f"--section.key=value)")
        config_flags.append(flag)
    return ours, config_flags


def plan_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m slidedp.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a train_configs/*.toml file")
    parser.add_argument("--rates", default="", help="a rates file or the name of a shipped one")
    parser.add_argument("--ngpu", type=int, default=0,
                        help="ranks (GPUs) to plan for; default: the rates' machine's")
    parser.add_argument("--search", action="store_true",
                        help="AutoPolicy from the model alone: the best routes, slots, chunk, "
                             "shadow and per-block policies, written to --out")
    parser.add_argument("--out", default="slidedp_policy.toml", help="--search: the policy file")
    ours, flags = _split(argv, parser)
    try:
        job = load_job(flags)
        rates = rates_for(job, rates=ours.rates)
        world = ours.ngpu or rates.machine.devices
        if world < 1:
            raise PlanError(f"--ngpu must be >= 1, got {world}")
        print("\n".join(plan_text(job, rates, world=world)), flush=True)
        if ours.search:
            from slidedp.plan.autopolicy import search_offline

            print("\n".join(search_offline(job, rates, world=world, out=ours.out)), flush=True)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def probe_main(argv: list[str]) -> int:
    """`python -m slidedp.probe CONFIG [--section.key=value ...] [--refresh] [--out FILE]`:
    measure (or read from the cache) this machine's rates for the configuration's model, under
    torchrun with every GPU of the host."""
    import os

    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m slidedp.probe", description=probe_main.__doc__)
    parser.add_argument("config", nargs="?", help="a train_configs/*.toml file (the model and shapes)")
    parser.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    parser.add_argument("--out", default="", help="also write the rates to this file")
    ours, flags = _split(argv, parser)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    try:
        job = load_job(flags)
        from models.kernels import resolve_kernels
        from slidedp.plan.autopolicy import candidates_of
        from slidedp.plan.probe import probe

        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        group = None
        if world > 1:
            dist.init_process_group("nccl" if cuda else "gloo")
            group = dist.group.WORLD
        config = job.config
        kernels = resolve_kernels(config.model.kernels, attention=config.model.attention,
                                  device_type=device.type)
        rates = probe(job.args, flavor=job.flavor, kernels=kernels,
                      policies=[*policies_of(config, job.args), *candidates_of(config)],
                      seq=config.training.seq_len, batch=config.training.local_batch_size,
                      loss_chunk=config.training.loss_chunk_tokens, device=device, rank=rank,
                      world=world, group=group, refresh=ours.refresh)
        if rank == 0 and ours.out:
            rates.save(ours.out)
            print(f"[probe] rates written to {ours.out}")
        if dist.is_initialized():
            dist.destroy_process_group()
    except (PlanError, ValueError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
