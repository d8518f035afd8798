"""AutoPolicy: the routes, chunk, slots, BF16 shadow and per-block activation policies of a run,
chosen by the step-time model and by measuring.

Live (`[slidedp] autopolicy = true`), on the run's own engine before training starts, in
stages; every measurement is a few real steps on random tokens at the run's shapes with lr = 0
(the weights stay as they were; the optimizer state is reset afterwards), the first after a
change dropped (the first two of the first measurement: a whole update cycle):
  1. probe: this machine's rates and the candidates' block timings and bytes (cached);
  2. routes: every delivery x reduction the run can switch to (set_routes), measured;
  3. chunk: a smaller and a larger chunk than configured, measured, where the model sees the
     copies or collectives exposed for more than CHUNK_STAGE_EXPOSED of the step (else the
     chunk cannot move it and the stage is skipped);
  4. screen: a candidate is dropped where another takes no more device and host bytes and a
     block of it is faster on the GPU by more than SCREEN_TOLERANCE (closer ones are left to
     the calibration: the probe cannot tell them apart);
  5. calibrate: each remaining candidate on as many blocks of the real pipeline as the memory
     budgets allow, measured against the configuration; what it measured beyond the model,
     per block changed and whatever its sign, is the program's cost of a block under it;
  6. solve: the integer program of slidedp/plan/ilp.py over the slot counts and the candidates
     under the GPU and host memory budgets;
  7. validate: the solution measured; the fastest configuration measured on the way and the
     given one are measured again, back to back with the same steps; the former is kept only
     if VALIDATION_MARGIN faster.
The choice is applied, written to <job.dump_folder>/slidedp_policy.toml (slidedp.policy_file
loads it), and the selection time and the steps that amortize it are printed.

Offline (`python -m recipes.plan CONFIG --search`): stages 4 and 6 from the model alone, over
routes, shadow on/off and slot counts, then the chunk by simulation; nothing is measured, so
it can plan for a machine from its rates file.
"""

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from models.args import QwenArgs
from slidedp.activations import (KEEP, RECOMPUTE, ActivationPolicy, block_policies, format_blocks,
                                 parse_policy)
from slidedp.host_state import available_host_bytes, host_state_bytes
from slidedp.layout import StateLayout
from slidedp.plan.ilp import Assignment, Choice, Option, solve
from slidedp.plan.memory import estimate_device_memory
from slidedp.plan.policy_file import parse_candidates, policy_settings, write_policy_file
from slidedp.plan.predict import plan_run, policies_of, state_plan, step_spec, with_slidedp
from slidedp.plan.probe import probe
from slidedp.plan.rates import Rates
from slidedp.plan.report import Job, format_memory, kernels_for
from slidedp.plan.steptime import simulate_step, step_demands
from slidedp.plan.workload import Workload

_BASES = ("keep", "recompute", "selective", "ops(matmul+attention)", "segments(attention_core)",
          "segments(qkv+qk_norm_rope+attention_core)", "segments(mlp_up)",
          "segments(input_norm+qkv+qk_norm_rope+attention_core+o_proj)",
          "segments(post_norm+mlp_up+down_proj)")
CANDIDATES: tuple[ActivationPolicy, ...] = tuple(
    parse_policy(f"{b}@offload={f}" if f else b) for b in _BASES for f in (0, 0.5, 1.0))
"""The per-block policies screened by default: no recompute, full recompute, attention kept,
every matmul kept, and segment masks (the attention core; the attention half up to it; the MLP's
up projection; the attention half; the MLP half), each with 0, half or all of what it saves
offloaded to host memory."""
GPU_BUDGET_FRACTION = 0.9
"""Of the device's memory, what the program may fill (the estimate is within -2%..+23%)."""
HOST_BUDGET_FRACTION = 0.9
"""Of the host's memory (MemAvailable when live), what the program may fill."""
SCREEN_TOLERANCE = 0.03
"""How much faster a probed block must be (relatively) to drop a candidate: the probe's noise
(a median of 3 repetitions, often at fewer sequences than the run's, that put two policies 1%
apart which the pipeline measured 2% apart)."""
MEASURED_STEPS = 3
"""Steps per measurement; the first after a change is dropped (one more at the first
measurement), the median of the rest kept."""
CHUNK_STAGE_EXPOSED = 0.01
"""Share of the step the copies and collectives must leave the GPU idle for the chunk stage."""
VALIDATION_MARGIN = 0.02
"""How much faster than the given configuration the choice must measure to replace it (the
spread of a few steps' times)."""


@dataclass(frozen=True)
class Setting:
    """One whole-run option."""

    delivery: str
    reduction: str
    window_slots: int
    chunk_mib: float
    bf16_shadow: bool

    def apply(self, config):
        return with_slidedp(config, delivery=self.delivery, reduction=self.reduction,
                            window_slots=self.window_slots, chunk_mib=self.chunk_mib,
                            bf16_shadow=self.bf16_shadow)

    def describe(self) -> str:
        return (f"{self.delivery}/{self.reduction}, {self.window_slots} slots, chunk "
                f"{self.chunk_mib:g} MiB, {'bf16 shadow' if self.bf16_shadow else 'no shadow'}")


def setting_of(config) -> Setting:
    s = config.slidedp
    return Setting(s.delivery, s.reduction, s.window_slots, s.chunk_mib, s.bf16_shadow)


@dataclass
class Model:
    """The step-time model of one run, for the program: the configuration, where it runs."""

    config: object
    args: QwenArgs
    flavor: str
    kernels: str
    world: int
    rates: Rates

    @property
    def work(self) -> Workload:
        return Workload(self.rates, self.args, flavor=self.flavor, kernels=self.kernels,
                        seq=self.config.training.seq_len)

    def spec(self, setting: Setting, policies: list[ActivationPolicy]):
        return step_spec(setting.apply(self.config), self.args, flavor=self.flavor,
                         kernels=self.kernels, world=self.world, rates=self.rates,
                         policies=policies)

    def step_s(self, setting: Setting, policies: list[ActivationPolicy]) -> float:
        return simulate_step(self.spec(setting, policies), self.rates).step_s

    def fixed_bytes(self, setting: Setting) -> tuple[float, float]:
        """Device and host bytes of `setting` without the blocks' activations: the program's
        M_o and H_o."""
        config = setting.apply(self.config)
        gpu = estimate_device_memory(config, self.args, world=self.world, kernels=self.kernels,
                                     block_bytes=lambda p: 0.0, rebuild_bytes=lambda p: 0.0)
        return gpu.total, host_state_bytes(StateLayout(self.args, world=self.world),
                                           state_plan(config))

    def activation_bytes(self, policies: list[ActivationPolicy]) -> tuple[float, float]:
        """Device bytes of the blocks' activations and of the largest rebuild, and host bytes
        of the offloaded ones on every rank: the program's sum_p n_p g_p + z * rebuild and
        ranks * sum_p n_p h_p."""
        work, batch = self.work, self.config.training.local_batch_size
        per = {p: work.activation_bytes(p, batch) for p in set(policies)}
        rebuild = max((work.rebuilt_bytes(p, batch) for p in per if p != KEEP), default=0)
        return (sum(per[p][0] for p in policies) + rebuild,
                self.world * sum(per[p][1] for p in policies))

    def block_gpu_s(self, policy: ActivationPolicy) -> float:
        """GPU seconds a step of one block under `policy` (forward and backward, every
        micro-batch)."""
        tr = self.config.training
        return sum(self.work.block(policy, tr.local_batch_size)) * tr.grad_accum_steps


def screen(model: Model, candidates: list[ActivationPolicy]) -> list[ActivationPolicy]:
    """The candidates no other beats: none takes no more device and host bytes while a block of
    it (forward + backward) is faster on the GPU by more than SCREEN_TOLERANCE."""
    work, batch = model.work, model.config.training.local_batch_size
    score = {}
    for p in dict.fromkeys(candidates):
        gpu, host = work.activation_bytes(p, batch)
        score[p] = (gpu, host, sum(work.block(p, batch)))

    def beats(o: tuple, s: tuple) -> bool:
        return o[0] <= s[0] and o[1] <= s[1] and o[2] < s[2] * (1 - SCREEN_TOLERANCE)

    return [p for p, s in score.items() if not any(beats(o, s) for o in score.values())]


def build_program(model: Model, settings: list[Setting], candidates: list[ActivationPolicy], *,
                  step_correction: float = 0.0, block_correction: dict[str, float] | None = None
                  ) -> tuple[list[Option], list[Choice], float]:
    """The program's options (one per setting) and choices (one per candidate), and the bytes of
    a rebuilt block. Demands come from the model's step accounting: each option's with every
    block under recompute, each choice's as its difference from recompute per block (so the
    demands add up exactly for any mix). The calibration: `step_correction` (measured less
    modelled step) is added to every option's residual, `block_correction[name]` (measured less
    modelled, per block) is a choice's residual."""
    L, rates = model.args.n_layers, model.rates
    work, batch = model.work, model.config.training.local_batch_size
    ref = [RECOMPUTE] * L
    options = []
    for setting in settings:
        step = simulate_step(model.spec(setting, ref), rates)
        gpu, host = model.fixed_bytes(setting)
        options.append(Option(name=setting.describe(), settings=setting.__dict__,
                              demand=dict(step.demand_s),
                              residual=step.step_s - step.bound_s + step_correction,
                              gpu_bytes=gpu, host_bytes=host))
    reference = step_demands(model.spec(settings[0], ref), rates)
    choices = []
    for p in candidates:
        d = step_demands(model.spec(settings[0], [p] * L), rates)
        gpu, host = work.activation_bytes(p, batch)
        choices.append(Choice(name=p.name, demand={r: (d[r] - reference[r]) / L for r in d},
                              gpu_bytes=gpu, host_bytes=host, rebuilds=p != KEEP,
                              residual=(block_correction or {}).get(p.name, 0.0)))
    # z * rebuild in the program: the most any candidate's block holds in backward (z = 1 as
    # soon as one rebuilds), so the program is never short of what the estimate counts.
    rebuild = max((work.rebuilt_bytes(p, batch) for p in candidates if p != KEEP), default=0)
    return options, choices, rebuild


def assign(assignment: Assignment, n_blocks: int) -> list[ActivationPolicy]:
    """Per-block policies for the program's counts: the ones that keep most first (the way
    keep_blocks puts kept blocks first; where a block sits does not change the peak)."""
    policies = [parse_policy(name) for name in assignment.counts]
    order = sorted(policies, key=lambda p: (p.base != "keep", p.offload, p.name))
    out = [p for p in order for _ in range(assignment.counts[p.name])]
    assert len(out) == n_blocks
    return out


def _budgets(model: Model, *, host_available: float | None = None) -> tuple[float, float]:
    gpu = model.rates.machine.device_memory_gib * 2**30 * GPU_BUDGET_FRACTION or float("inf")
    host = (host_available or model.rates.machine.host_memory_gib * 2**30) * HOST_BUDGET_FRACTION
    return gpu, host


def candidates_of(config) -> list[ActivationPolicy]:
    """slidedp.autopolicy_candidates, or CANDIDATES."""
    chosen = parse_candidates(config.slidedp.autopolicy_candidates)
    return chosen or list(CANDIDATES)


# ---- offline ---------------------------------------------------------------------------------------


def search_offline(job: Job, rates: Rates, *, world: int, out: str) -> list[str]:
    """`plan --search`: the model's best configuration for `job`, written to `out`."""
    config, args = job.config, job.args
    model = Model(config, args, job.flavor, kernels_for(config, rates), world, rates)
    base = setting_of(config)
    # The embedding's update on the GPU needs the gpu route.
    reductions = ("gpu",) if config.slidedp.embedding_update == "gpu" else ("gpu", "cpu")
    routes = ([(d, r) for d in ("sharded", "replicated") for r in reductions] if world > 1
              else [(base.delivery, "gpu")])
    slots = sorted({2, 3, 4, 6, base.window_slots})
    settings = [Setting(d, r, n, base.chunk_mib, shadow)
                for (d, r), n, shadow in itertools.product(routes, slots, (True, False))]
    candidates = screen(model, [*candidates_of(config), *policies_of(config, args)])
    options, choices, rebuild = build_program(model, settings, candidates)
    gpu_budget, host_budget = _budgets(model)
    found = solve(options, choices, blocks=args.n_layers, ranks=world, gpu_budget=gpu_budget,
                  host_budget=host_budget, rebuild_bytes=rebuild)
    if found is None:
        return ["search: no configuration fits the GPU and host memory budgets"]
    policies = assign(found, args.n_layers)
    best = Setting(**found.option.settings)
    chunks = sorted({8.0, 32.0, 128.0, base.chunk_mib})
    best = min((replace(best, chunk_mib=c) for c in chunks), key=lambda s: model.step_s(s, policies))
    chosen = best.apply(config)
    plan = plan_run(chosen, args, flavor=job.flavor, kernels=model.kernels, world=world,
                    rates=rates, policies=policies)
    now = model.step_s(base, policies_of(config, args))
    settings_out = policy_settings(**{k: v for k, v in best.__dict__.items()}, policies=policies)
    write_policy_file(out, settings_out, comments=[
        f"chosen by `python -m recipes.plan --search` from the step-time model alone, on "
        f"{rates.machine.name} ({rates.machine.source} rates), {world} rank(s)",
        f"predicted step {plan.step.step_s:.3f} s against {now:.3f} s for the configuration "
        f"searched from; not measured (AutoPolicy live measures: slidedp.autopolicy = true)"])
    return ["search (the model alone, nothing measured):",
            f"  screened {len(candidates)} candidate policies, {len(options)} options "
            f"(routes x slots x shadow), then the chunk",
            f"  choice: {best.describe()}; activations {format_blocks(policies)}",
            f"  predicted {plan.step.step_s:.3f} s per step ({plan.step.tokens_per_s:,.0f} tokens/s) "
            f"against {now:.3f} s now; {plan.step.regime}: {plan.step.why}",
            *("  " + line for line in format_memory(plan, rates)),
            f"  written to {out} (load it with --slidedp.policy_file={out})"]


# ---- live ------------------------------------------------------------------------------------------


class _Meter:
    """Steps of the real engine with lr = 0 on random tokens at the run's shapes."""

    def __init__(self, backend, config, args: QwenArgs, *, device: torch.device, rank: int,
                 world: int, steps: int):
        tr = config.training
        self.backend, self.device, self.world = backend, device, world
        self.shape = (tr.local_batch_size, tr.seq_len)
        self.micro = tr.grad_accum_steps
        self.vocab = args.vocab_size
        self.generator = torch.Generator().manual_seed(1234 + rank)
        self.per_measurement = steps
        self.steps = 0

    def _batches(self):
        b, s = self.shape
        out = []
        for _ in range(self.micro):
            tokens = torch.randint(self.vocab, (b, s + 1), generator=self.generator)
            out.append((tokens[:, :-1], tokens[:, 1:]))
        return out

    def __call__(self) -> float:
        """The median step time of a measurement's steps less the first; the slowest rank's.
        The first measurement runs and drops one step more: the engine's first step's host
        updates run on in its second (deferred), faulting in the Adam moments' pages."""
        b, s = self.shape
        dropped = 1 + (self.steps == 0)
        times = []
        for _ in range(self.per_measurement + dropped - 1):
            batches = self._batches()
            start = time.perf_counter()
            self.backend.train_step(batches, lr=0.0, global_target_tokens=b * s * self.micro * self.world)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        self.steps += len(times)
        value = torch.tensor([statistics.median(times[dropped:] or times[-1:])], dtype=torch.float64,
                             device=self.device)
        if self.world > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())


def select_live(backend, config, args: QwenArgs, *, flavor: str, device: torch.device,
                rank: int, world: int, group, out: str, steps: int = MEASURED_STEPS,
                log: Callable[[str], None] = print) -> dict:
    """The live stages (module docstring) on `backend`; returns what was chosen and measured.
    Every rank calls it with the same arguments and takes the same decisions (the probe's
    rates are rank 0's, the step times every rank's slowest)."""
    say = log if rank == 0 else (lambda _: None)
    start = time.perf_counter()
    candidates = candidates_of(config)
    tr = config.training
    rates = probe(args, flavor=flavor, kernels=backend.kernels,
                  policies=[*candidates, *backend.policies], seq=tr.seq_len,
                  batch=tr.local_batch_size, loss_chunk=tr.loss_chunk_tokens, device=device,
                  rank=rank, world=world, group=group, log=say)
    model = Model(config, args, flavor, backend.kernels.name, world, rates)
    meter = _Meter(backend, config, args, device=device, rank=rank, world=world, steps=steps)
    policies = list(backend.policies)
    setting = setting_of(config)
    measured: dict[tuple[Setting, str], float] = {}

    def apply(s: Setting, pol: list[ActivationPolicy]) -> None:
        backend.set_routes(delivery=s.delivery, reduction=s.reduction, chunk_mib=s.chunk_mib)
        if s.window_slots != backend.cfg.window_slots:
            backend.set_window_slots(s.window_slots)
        backend.set_activation(default=pol[0].name, blocks=format_blocks(pol, pol[0]))

    def measure(s: Setting, pol: list[ActivationPolicy], what: str) -> float:
        apply(s, pol)
        t = meter()
        measured[s, format_blocks(pol)] = t
        say(f"[autopolicy] {what}: {t:.3f} s per step (model {model.step_s(s, pol):.3f} s)")
        return t

    baseline = measure(setting, policies, f"the configuration ({setting.describe()})")
    # Routes, then the chunk: measured.
    routes = [(d, r) for d in ("sharded", "replicated") for r in ("gpu", "cpu")
              if world > 1 and (r == "gpu" or backend.state.plan.cpu_staging)]
    for d, r in routes:
        if (d, r) != (setting.delivery, setting.reduction):
            measure(replace(setting, delivery=d, reduction=r), policies, f"routes {d}/{r}")
    setting = _fastest(measured, policies)
    predicted = simulate_step(model.spec(setting, policies), rates)
    copies = sum(predicted.exposed_s[k] for k in ("h2d", "collective", "d2h"))
    if copies > CHUNK_STAGE_EXPOSED * predicted.step_s:
        for c in (setting.chunk_mib / 4, setting.chunk_mib * 4):
            if 0.25 <= c <= 1024:
                measure(replace(setting, chunk_mib=c), policies, f"chunk {c:g} MiB")
        setting = _fastest(measured, policies)
    else:
        say(f"[autopolicy] chunk: kept {setting.chunk_mib:g} MiB (the model has the copies "
            f"{copies:.3f} s exposed of {predicted.step_s:.3f} s: no chunk can move the step)")
    # Screen, then calibrate each candidate on the real pipeline.
    shortlist = screen(model, [*candidates, *policies])
    gpu_budget, host_budget = _budgets(model, host_available=available_host_bytes()
                                       + host_state_bytes(backend.layout, backend.state.plan))
    ref = measured[setting, format_blocks(policies)]
    block_correction = calibrate(model, setting, policies, shortlist, ref=ref,
                                 measure=lambda trial, what: measure(setting, trial, what),
                                 gpu_budget=gpu_budget, host_budget=host_budget)
    # Solve over the slot counts the run can switch to (the model's error on the measured
    # configuration corrects every option), then measure the solution.
    slots = sorted({max(2, setting.window_slots - 1), setting.window_slots, setting.window_slots + 1})
    settings = [replace(setting, window_slots=n) for n in slots]
    options, choices, rebuild = build_program(
        model, settings, shortlist, step_correction=ref - model.step_s(setting, policies),
        block_correction=block_correction)
    found = solve(options, choices, blocks=args.n_layers, ranks=world, gpu_budget=gpu_budget,
                  host_budget=host_budget, rebuild_bytes=rebuild)
    if found is not None:
        chosen = Setting(**found.option.settings)
        chosen_policies = assign(found, args.n_layers)
        if (chosen, format_blocks(chosen_policies)) not in measured:
            measure(chosen, chosen_policies, f"the program's choice ({chosen.describe()}; "
                                             f"{format_blocks(chosen_policies)})")
    # The fastest configuration measured (calibration mixes are configurations too) and the
    # given one, measured again back to back with the same steps (the baseline was the first
    # measurement, under other conditions); it must beat the given one by VALIDATION_MARGIN,
    # else the given one stays.
    (best, best_blocks), _ = min(measured.items(), key=lambda kv: kv[1])
    best_policies = _policies_from(best_blocks, args.n_layers)
    given = setting_of(config)
    best_t = baseline
    if (best, best_blocks) != (given, format_blocks(policies)):
        baseline = measure(given, policies, f"validation of the configuration ({given.describe()})")
        best_t = measure(best, best_policies, f"validation of {best.describe()}; {best_blocks}")
        if best_t > baseline * (1 - VALIDATION_MARGIN):
            best, best_policies, best_t = given, policies, baseline
            apply(best, best_policies)
    backend.reset_optimizer()
    elapsed = time.perf_counter() - start
    gain = baseline - best_t
    settings_out = policy_settings(**best.__dict__, policies=best_policies)
    amortize = (f"amortized after {elapsed / gain:,.0f} steps ({gain:.3f} s saved per step)"
                if gain > 0 else "nothing measured faster than the configuration given: kept it")
    comments = [f"chosen by AutoPolicy on {rates.machine.name}, {world} rank(s), "
                f"{tr.grad_accum_steps} x {tr.local_batch_size} x {tr.seq_len} tokens per rank",
                f"measured {best_t:.3f} s per step against {baseline:.3f} s for the configuration "
                f"it started from; selection took {elapsed:.1f} s ({meter.steps} steps), {amortize}"]
    if rank == 0:
        write_policy_file(out, settings_out, comments=comments)
    say(f"[autopolicy] chose {best.describe()}; activations {format_blocks(best_policies)}: "
        f"{best_t:.3f} s per step (was {baseline:.3f} s); selection {elapsed:.1f} s over "
        f"{meter.steps} steps, {amortize}; written to {out}")
    return {"setting": best, "policies": best_policies, "step_s": best_t, "baseline_s": baseline,
            "selection_s": elapsed, "steps": meter.steps}


def _fastest(measured: dict, policies: list[ActivationPolicy]) -> Setting:
    blocks = format_blocks(policies)
    return min(((s, t) for (s, b), t in measured.items() if b == blocks), key=lambda st: st[1])[0]


def calibrate(model: Model, setting: Setting, policies: list[ActivationPolicy],
              shortlist: list[ActivationPolicy], *, ref: float,
              measure: Callable[[list[ActivationPolicy], str], float], gpu_budget: float,
              host_budget: float) -> dict[str, float]:
    """Stage 5: each candidate of `shortlist` on as many blocks as fit (`measure(trial, what)`:
    the step time of `setting` with the per-block policies `trial`), against `ref`, the
    measured step of `policies`; returns build_program's `block_correction`."""
    modelled_ref = model.step_s(setting, policies)
    correction = {}
    for p in shortlist:
        trial = _calibration_trial(model, setting, p, policies, gpu_budget=gpu_budget,
                                   host_budget=host_budget)
        changed = sum(a != b for a, b in zip(trial, policies))
        if not changed:
            continue
        t = measure(trial, f"calibration: {p.name} on {changed} blocks")
        # What the measurement says a block under p costs beyond what the model says, whatever
        # the sign: the program then reproduces this measurement, as the step correction makes
        # it reproduce the configuration's. Bounded by the block's GPU time only: the model
        # cannot be off on one block by more than all its work (beyond that the steps caught
        # something else, a first use or another process; validation measures again).
        error = ((t - ref) - (model.step_s(setting, trial) - modelled_ref)) / changed
        bound = model.block_gpu_s(p)
        correction[p.name] = min(bound, max(-bound, error))
    return correction


def _calibration_trial(model: Model, setting: Setting, candidate: ActivationPolicy,
                       policies: list[ActivationPolicy], *, gpu_budget: float,
                       host_budget: float) -> list[ActivationPolicy]:
    """`policies` with `candidate` on as many blocks from the first as fit the budgets by the
    program's accounting (all of them where it fits): the more blocks change, the further the
    measured difference stands out of the steps' noise and the less the program extrapolates
    it (`policies` itself where not one block fits)."""
    gpu, host = model.fixed_bytes(setting)
    for k in range(len(policies), 0, -1):
        trial = [candidate] * k + policies[k:]
        g, h = model.activation_bytes(trial)
        if gpu + g <= gpu_budget and host + h <= host_budget:
            return trial
    return policies


def _policies_from(blocks: str, n: int) -> list[ActivationPolicy]:
    """The policies format_blocks wrote (every block named)."""
    return block_policies(n, default="recompute", blocks=blocks)
