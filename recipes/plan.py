"""What a run needs and how fast it will go, printed before anything is allocated:

    python -m recipes.plan CONFIG [--section.key=value ...] [--rates R] [--ngpu N]
                                  [--nnodes N --link L] [--search]

The plan (slidedp/plan/report.py) needs the rates of the machine it is for, which the
configuration's [plan] section names (the shipped train_configs/ name theirs), `--rates` and
`--ngpu` overriding it: a file shipped in slidedp/plan/rates/ by name (e.g. h200x2,
a800x8_nvlink: plan for hardware you do not have) or a path; without one, the probe's cache
for this machine, model and compute dtype, else the probe runs here first (on a GPU; on the CPU
only for small models), as `python -m recipes.probe` does on its own. `--search` runs
AutoPolicy from the model alone (nothing measured) and writes its choice to a policy file that
`slidedp.policy_file` loads. `--nnodes` (or [plan] nnodes) plans SlideDP over that many nodes
of the machine, joined by `--link` (a file shipped in slidedp/plan/rates/links/ by name, e.g.
ib400x8, or a path): the step-time model adds each rank's cross-node all-reduce.

The configuration is read and checked exactly as recipes/train.py reads it; this command, not
slidedp/plan/, owns that (slidedp/ imports nothing from recipes/).
"""

import argparse
import os
import sys
from functools import partial

import torch
import torch.distributed as dist

from models.kernels import resolve_kernels
from recipes.config import ConfigError, JobConfig, parse_config, resolve_model, run_config
from recipes.job_config import Plan
from recipes.preflight import check_seq_len, check_slidedp_options, device_memory
from slidedp.nodes import check_nodes_reduction
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.link import Link, load_link
from slidedp.plan.predict import compute_dtype, policies_of
from slidedp.plan.probe import probe
from slidedp.plan.rates import MissingRate, Rates, load_rates, shipped_names
from slidedp.plan.report import Job, plan_text, search_offline
from slidedp.plan.search import candidates_of


class PlanError(ValueError):
    """A one-line, user-facing error of the planner."""


def load_config(flags: list[str]) -> tuple[JobConfig, Job]:
    """The configuration of `flags`, read, checked and resolved as a run would, and the job
    the planner reads of it."""
    try:
        config = parse_config(flags)
        flavor, args = resolve_model(config)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    return config, Job(config=run_config(config), flavor=flavor, args=args)


def load_job(flags: list[str]) -> Job:
    """The job the planner reads of the configuration of `flags`."""
    return load_config(flags)[1]


def probe_job(job: Job, *, device: torch.device, rank: int = 0, world: int = 1, group=None,
              refresh: bool = False) -> Rates:
    """This machine's rates for `job`'s model, shapes, policies and AutoPolicy's candidates
    (from the cache where it has them)."""
    config = job.config
    kernels = resolve_kernels(config.model.kernels, attention=config.model.attention,
                              device_type=device.type)
    try:
        return probe(job.args, flavor=job.flavor, kernels=kernels,
                     policies=[*policies_of(config, job.args), *candidates_of(config)],
                     seq=config.training.seq_len, batch=config.training.local_batch_size,
                     loss_chunk=config.training.loss_chunk_tokens, device=device,
                     compute_dtype=compute_dtype(config), rank=rank, world=world, group=group,
                     refresh=refresh)
    except ValueError as e:
        raise PlanError(str(e)) from None


def rates_for(job: Job, plan: Plan, *, rates: str) -> Rates:
    """`--rates` if given, else [plan] rates, else this machine's (cached, or probed now on one
    rank)."""
    name = rates or plan.rates
    if not name:
        cuda = torch.cuda.is_available()
        return probe_job(job, device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    try:
        return load_rates(name)
    except (FileNotFoundError, ValueError) as e:
        raise PlanError(f"{'--rates' if rates else 'plan.rates'}: {e}") from None


def link_for(job: Job, plan: Plan, *, nodes: int, link: str) -> Link | None:
    """`--link` if given, else [plan] link, for a plan over `nodes` > 1 (None on one node)."""
    config = job.config
    if nodes < 1:
        raise PlanError(f"--nnodes must be >= 1, got {nodes}")
    if nodes == 1:
        return None
    if config.mode != "slidedp":
        raise PlanError(f"--nnodes {nodes}: the planner models SlideDP over several nodes, not "
                        f"mode {config.mode!r}")
    try:
        check_nodes_reduction(
            nodes, RUNTIME_STYLES[config.slidedp.runtime].configure(config.slidedp).reduction)
    except ValueError as e:
        raise PlanError(f"--nnodes {nodes}: {e}") from None
    name = link or plan.link
    if not name:
        raise PlanError(f"--nnodes {nodes} needs the nodes' link: --link NAME (a file of "
                        "slidedp/plan/rates/links/, e.g. ib400x8) or [plan] link")
    try:
        return load_link(name)
    except (FileNotFoundError, ValueError) as e:
        raise PlanError(f"{'--link' if link else 'plan.link'}: {e}") from None


def split_flags(argv: list[str], parser: argparse.ArgumentParser
                ) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the configuration's flags (`--section.key=value`, or `--section.key
    VALUE ...` as the trainer takes them: a dot in the name) with the TOML file (given first).
    The flags are taken out first: argparse would read one whose value holds a space, or a
    value after a space, as a positional argument."""
    ours_args, config_flags, taking = [], [], False
    for a in argv:
        if a.startswith("--"):
            taking = "." in a.partition("=")[0]
            (config_flags if taking else ours_args).append(a)
            taking = taking and "=" not in a  # its values follow it, up to the next flag
        else:
            (config_flags if taking else ours_args).append(a)
    ours = parser.parse_args(ours_args)
    return ours, [f"--job.config_file={ours.config}"] * bool(ours.config) + config_flags


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a train_configs/*.toml file")
    parser.add_argument("--rates", default="",
                        help="a rates file or the name of a shipped one; default: [plan] rates")
    parser.add_argument("--ngpu", type=int, default=0,
                        help="ranks (GPUs) to plan for; default: [plan] ngpu, else the rates' "
                             "machine's")
    parser.add_argument("--nnodes", type=int, default=0,
                        help="nodes of --ngpu ranks each to plan for; default: [plan] nnodes")
    parser.add_argument("--link", default="",
                        help="the nodes' link (with --nnodes > 1): a shipped links/ file by name "
                             "or a path; default: [plan] link")
    parser.add_argument("--search", action="store_true",
                        help="AutoPolicy from the model alone: the best routes, slots, chunk, "
                             "shadow and per-block policies, written to --out")
    parser.add_argument("--out", default="slidedp_policy.toml", help="--search: the policy file")
    ours, flags = split_flags(argv, parser)
    try:
        config, job = load_config(flags)
        if ours.search and config.parallelism.mode != "slidedp":
            raise PlanError(f'--search chooses SlideDP\'s settings: it needs parallelism.mode = '
                            f'"slidedp", got "{config.parallelism.mode}"')
        rates = rates_for(job, config.plan, rates=ours.rates)
        world = ours.ngpu or config.plan.ngpu or rates.machine.devices
        if world < 1:
            raise PlanError(f"--ngpu must be >= 1, got {world}")
        if world > rates.machine.devices and not rates.machine.on_cpu:
            # Its links and host are measured or specified for its own GPUs, not for more.
            raise PlanError(f"{world} GPUs, but the rates' machine has {rates.machine.devices}: "
                            f"{rates.machine.name}; plan for more with a larger one's rates "
                            f"(--rates NAME or [plan] rates; shipped: {shipped_names()})")
        nodes = ours.nnodes or config.plan.nnodes
        if ours.search and nodes > 1:
            # Its options are priced on one node: it would choose without the nodes' link.
            raise PlanError(f"--search chooses for one node, not {nodes}: plan the nodes without "
                            f"--search, or search with --nnodes 1")
        # What a run refuses before it allocates, the plan refuses before it simulates.
        check_slidedp_options(config, job.args, world=world * nodes)
        check_seq_len(config.training.seq_len, job.args)
        link = link_for(job, config.plan, nodes=nodes, link=ours.link)
        print("\n".join(plan_text(job, rates, world=world,
                                  resident_memory=partial(device_memory, config), nodes=nodes,
                                  link=link)), flush=True)
        if ours.search:
            print("\n".join(search_offline(job, rates, world=world, out=ours.out,
                                            say=partial(print, file=sys.stderr, flush=True))),
                  flush=True)
    except (PlanError, ConfigError, MissingRate) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def probe_main(argv: list[str]) -> int:
    """`python -m recipes.probe CONFIG [--section.key=value ...] [--refresh] [--out FILE]`:
    measure (or read from the cache) this machine's rates for the configuration's model, under
    torchrun with every GPU of the host (the links with all GPUs copying, the collectives)."""
    parser = argparse.ArgumentParser(prog="python -m recipes.probe", description=probe_main.__doc__)
    parser.add_argument("config", nargs="?", help="a train_configs/*.toml file (the model and shapes)")
    parser.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    parser.add_argument("--out", default="", help="also write the rates to this file")
    ours, flags = split_flags(argv, parser)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rates = probe_job(load_job(flags), device=device, rank=rank, world=world,
                          group=dist.group.WORLD if world > 1 else None, refresh=ours.refresh)
        if rank == 0 and ours.out:
            rates.save(ours.out)
            print(f"[probe] rates written to {ours.out}")
    except PlanError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
