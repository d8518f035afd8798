"""AutoPolicy's search: the routes, chunk, slots, BF16 shadow and per-block activation
policies of a run, chosen by the step-time model (Model), with what measuring adds to it.

  screen: a candidate is dropped where another takes no more device and host bytes and a block
     of it is faster on the GPU by more than SCREEN_TOLERANCE (closer ones are left to the
     calibration: the probe cannot tell them apart);
  calibrate: each remaining candidate on as many blocks of the real pipeline as the memory
     budgets allow, measured against the configuration (by the caller's `measure`); what it
     measured beyond the model, per block changed and whatever its sign, is the program's cost
     of a block under it;
  build_program, solve (slidedp/plan/ilp.py): the integer program over the settings and the
     candidates under the GPU and host memory budgets;
  solve_modelled: the offline search's solve, each candidate priced by what the simulated
     schedule exposes of it under the option chosen (live, the calibration measures that),
     then each solution's option under every optimizer placement simulated with its blocks,
     the fastest taken.

The live run of it, which measures, is slidedp/plan/live.py; the offline one (`python -m
recipes.plan CONFIG --search`), from the model alone, is slidedp/plan/report.py's
search_offline.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from protocols.model_spec import ModelArgs
from slidedp.activations import KEEP, RECOMPUTE, ActivationPolicy, block_policies, parse_policy
from slidedp.gpu_update import check_gpu_updates
from slidedp.host_state import host_state_bytes
from slidedp.layout import StateLayout
from slidedp.plan.ilp import (TIE_BREAK_S_PER_GIB, Assignment, Choice, Option, device_bytes,
                              feasible, solve)
from slidedp.plan.memory import estimate_device_memory
from slidedp.plan.policy_file import parse_candidates
from slidedp.plan.predict import state_plan, step_spec, with_slidedp
from slidedp.plan.rates import Rates
from slidedp.plan.steptime import simulate_step, step_demands
from slidedp.plan.workload import Workload
from slidedp.run_config import RunConfig
from slidedp.speculative import check_speculative


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
REFINE_ROUNDS = 3
"""Most rounds of solve_modelled: each re-prices the choices under the option last chosen."""
SCREEN_TOLERANCE = 0.03
"""How much faster a probed block must be (relatively) to drop a candidate: the probe's noise
(a median of 3 repetitions, often at fewer sequences than the run's, that put two policies 1%
apart which the pipeline measured 2% apart)."""
@dataclass(frozen=True)
class Setting:
    """One whole-run option."""

    delivery: str
    reduction: str
    window_slots: int
    chunk_mib: float
    bf16_shadow: bool
    gpu_state_blocks: int
    """Blocks whose optimizer state stays on the GPU (slidedp/gpu_update.py)."""
    embedding_update: str
    """Where the embedding's AdamW runs (slidedp.embedding_update)."""

    def apply(self, config: RunConfig) -> RunConfig:
        return with_slidedp(config, delivery=self.delivery, reduction=self.reduction,
                            window_slots=self.window_slots, chunk_mib=self.chunk_mib,
                            bf16_shadow=self.bf16_shadow, gpu_state_blocks=self.gpu_state_blocks,
                            embedding_update=self.embedding_update)

    def describe(self) -> str:
        resident = (f", optimizer state of {self.gpu_state_blocks} blocks on the GPU"
                    if self.gpu_state_blocks else "")
        return (f"{self.delivery}/{self.reduction}, {self.window_slots} slots, chunk "
                f"{self.chunk_mib:g} MiB, {'bf16 shadow' if self.bf16_shadow else 'no shadow'}, "
                f"embedding update {self.embedding_update}{resident}")


def setting_of(config: RunConfig) -> Setting:
    s = config.slidedp
    return Setting(s.delivery, s.reduction, s.window_slots, s.chunk_mib, s.bf16_shadow,
                   s.gpu_state_blocks, s.embedding_update)


def resident_levels(config: RunConfig, n_layers: int) -> list[tuple[int, str]]:
    """The optimizer placements the search weighs, as (gpu_state_blocks, embedding_update): the
    configuration's, and the embedding with none, a quarter, half, three quarters or all of the
    blocks resident on the GPU; the program trades their 14 B/param (10 with BF16 moments) of GPU
    memory against kept activations (`runs` drops those the run cannot update on the GPU)."""
    s = config.slidedp
    levels = [(s.gpu_state_blocks, s.embedding_update)]
    for blocks in (0, n_layers // 4, n_layers // 2, 3 * n_layers // 4, n_layers):
        if (blocks, "resident") not in levels:
            levels.append((blocks, "resident"))
    return levels


_PLACEMENT = ("gpu_state_blocks", "embedding_update")
"""The settings of an optimizer placement (resident_levels)."""


def runs(setting: Setting, config: RunConfig, n_layers: int, *, world: int) -> bool:
    """Whether the run can take `setting` (the conditions of its GPU updates,
    slidedp/gpu_update.py, and of speculative updates, slidedp/speculative.py)."""
    cfg, accum = setting.apply(config).slidedp, config.training.grad_accum_steps
    try:
        check_gpu_updates(cfg, grad_accum_steps=accum, n_layers=n_layers, world=world)
        check_speculative(cfg, grad_accum_steps=accum, n_layers=n_layers)
    except ValueError:
        return False
    return True


@dataclass
class Model:
    """The step-time model of one run, for the program: the configuration, where it runs."""

    config: RunConfig
    args: ModelArgs
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

    def fixed_bytes(self, setting: Setting) -> tuple[float, float, float]:
        """Device and host bytes of `setting` without the blocks' activations, and its device
        bytes while none is held: the program's M_o, H_o and F_o. The device's peak is the
        resident bytes plus the larger of the activations (with the logits) and the gradients
        at backward's end (MemoryEstimate.total), so only the first adds to the blocks'."""
        config = setting.apply(self.config)
        gpu = estimate_device_memory(config, self.args, world=self.world, kernels=self.kernels,
                                     block_bytes=lambda p: 0.0, rebuild_bytes=lambda p: 0.0)
        host = host_state_bytes(StateLayout(self.args, world=self.world), state_plan(config))
        return (gpu.resident + gpu.activations + gpu.logits, host,
                gpu.resident + max(gpu.gradients, gpu.after_prefetch))

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
        gpu, host, floor = model.fixed_bytes(setting)
        options.append(Option(name=setting.describe(), settings=setting.__dict__,
                              demand=dict(step.demand_s),
                              residual=step.step_s - step.bound_s + step_correction,
                              gpu_bytes=gpu, host_bytes=host, gpu_floor_bytes=floor))
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


def modelled_residuals(model: Model, setting: Setting,
                       choices: list[Choice]) -> dict[str, float]:
    """Per block, what the schedule exposes of each choice beyond its demands under `setting`:
    the simulated step less its largest demand with every block under the choice, less the same
    with every block under recompute, over the blocks (at least 0). An offload's copies back
    at the turn to backward cannot overlap anything, which no demand shows; AutoPolicy live
    measures this (calibrate), the offline search takes it from the model."""
    L = model.args.n_layers

    def exposed(policy: ActivationPolicy) -> float:
        step = simulate_step(model.spec(setting, [policy] * L), model.rates)
        return step.step_s - step.bound_s

    ref = exposed(RECOMPUTE)
    return {c.name: max(0.0, exposed(parse_policy(c.name)) - ref) / L for c in choices}


def solve_modelled(model: Model, options: list[Option], choices: list[Choice], *,
                   gpu_budget: float, host_budget: float, rebuild_bytes: float
                   ) -> Assignment | None:
    """The program solved with each choice's modelled residual (modelled_residuals) under the
    option of the previous solution, until the option repeats (at most REFINE_ROUNDS): the
    residual depends on the option (a host-bound one hides an offload that a GPU-bound one
    exposes), and the program weighs one option's at a time. Then the simulation has the last
    word (simulated_best)."""
    limits = dict(blocks=model.args.n_layers, ranks=model.world, gpu_budget=gpu_budget,
                  host_budget=host_budget, rebuild_bytes=rebuild_bytes)
    found = solve(options, choices, **limits)
    if found is None:
        return None
    # Pricing changes no choice's bytes: what fitted still fits, so a solution stays one.
    solutions = [found]
    for _ in range(REFINE_ROUNDS):
        residual = modelled_residuals(model, Setting(**found.option.settings), choices)
        again = solve(options, [replace(c, residual=residual[c.name]) for c in choices], **limits)
        settled = again.option.name == found.option.name
        found = again
        solutions.append(found)
        if settled:
            break
    return simulated_best(model, options, choices, solutions, ranks=model.world,
                          gpu_budget=gpu_budget, host_budget=host_budget,
                          rebuild_bytes=rebuild_bytes)


def simulated_best(model: Model, options: list[Option], choices: list[Choice],
                   solutions: list[Assignment], **limits) -> Assignment:
    """Of the program's solutions, each with its option's every optimizer placement that fits
    (the option's other settings the same), the one the simulation has fastest (its `objective`
    the simulated step). The program prices each option with every block under recompute
    (build_program), whose long backward hides host updates that kept blocks expose: alone, it
    traded resident optimizer state away where the simulation has it faster."""
    by_name = {c.name: c for c in choices}
    scored = {}
    for a in solutions:
        policies = block_order(a.counts)
        for o in options:
            placed = {**a.option.settings, **{k: o.settings[k] for k in _PLACEMENT}}
            if o.settings != placed or not feasible(o, a.counts, by_name, **limits):
                continue
            key = (o.name, tuple(a.counts.items()))
            if key not in scored:
                step = model.step_s(Setting(**o.settings), policies)
                gpu = device_bytes(o, a.counts, by_name)
                # Among equal steps the one with less device memory, as the program's tie-break.
                scored[key] = (step + TIE_BREAK_S_PER_GIB * gpu / 2**30,
                               Assignment(o, a.counts, step))
    return min(scored.values(), key=lambda scored: scored[0])[1]


def assign(assignment: Assignment, n_blocks: int) -> list[ActivationPolicy]:
    """Per-block policies for the program's counts (block_order)."""
    out = block_order(assignment.counts)
    assert len(out) == n_blocks
    return out


def block_order(counts: dict[str, int]) -> list[ActivationPolicy]:
    """Per-block policies for counts of blocks per policy name: the ones that keep most first
    (the way keep_blocks puts kept blocks first; where a block sits does not change the peak)."""
    policies = [parse_policy(name) for name in counts]
    order = sorted(policies, key=lambda p: (p.base != "keep", p.offload, p.name))
    return [p for p in order for _ in range(counts[p.name])]


def budgets(model: Model, *, host_available: float | None = None) -> tuple[float, float]:
    gpu = model.rates.machine.device_memory_gib * 2**30 * GPU_BUDGET_FRACTION or float("inf")
    host = (host_available or model.rates.machine.host_memory_gib * 2**30) * HOST_BUDGET_FRACTION
    return gpu, host


def fitting(model: Model, settings: list[Setting], *, gpu_budget: float, host_budget: float
            ) -> list[Setting]:
    """The settings whose bytes without any block's activations fit the budgets (the program's
    constraints with no activation): the program can choose no other, so the search prices
    only these, each a simulated step."""
    out = []
    for s in settings:
        gpu, host, floor = model.fixed_bytes(s)
        if max(gpu, floor) <= gpu_budget and host <= host_budget:
            out.append(s)
    return out


def candidates_of(config: RunConfig) -> list[ActivationPolicy]:
    """slidedp.autopolicy_candidates, or CANDIDATES."""
    chosen = parse_candidates(config.slidedp.autopolicy_candidates)
    return chosen or list(CANDIDATES)


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
    gpu, host, floor = model.fixed_bytes(setting)
    if floor > gpu_budget:
        return policies
    for k in range(len(policies), 0, -1):
        trial = [candidate] * k + policies[k:]
        g, h = model.activation_bytes(trial)
        if gpu + g <= gpu_budget and host + h <= host_budget:
            return trial
    return policies


def policies_from(blocks: str, n: int) -> list[ActivationPolicy]:
    """The policies format_blocks wrote (every block named)."""
    return block_policies(n, default="recompute", blocks=blocks)
