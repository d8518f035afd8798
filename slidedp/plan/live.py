"""AutoPolicy live: the routes, chunk, slots, BF16 shadow and per-block activation policies of a
run, chosen by the step-time model and by measuring (the search: slidedp/plan/search.py).

Live (`[slidedp] autopolicy = true`), on the run's own engine before training starts, in
stages; every measurement is a few real steps on random tokens at the run's shapes with lr = 0
(the weights stay as they were; the optimizer state is reset afterwards), the first after a
change dropped (the first two of the first measurement: a whole update cycle):
  1. probe: this machine's rates and the candidates' block timings and bytes (cached);
  2. routes: every delivery x reduction the run can switch to (reconfigure), measured;
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
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from protocols.model_spec import ModelArgs
from protocols.reconfigure import Knobs
from slidedp.activations import ActivationPolicy, format_blocks
from slidedp.host_state import available_host_bytes, host_state_bytes
from slidedp.plan.ilp import solve
from slidedp.plan.policy_file import policy_settings, write_policy_file
from slidedp.plan.probe import probe
from slidedp.plan.search import (Model, Setting, assign, budgets, build_program, calibrate,
                                  candidates_of, policies_from, screen, setting_of)
from slidedp.plan.steptime import simulate_step
from slidedp.routes.build import has_regions, searched_routes
from slidedp.run_config import RunConfig


MEASURED_STEPS = 3
"""Steps per measurement; the first after a change is dropped (one more at the first
measurement), the median of the rest kept."""
CHUNK_STAGE_EXPOSED = 0.01
"""Share of the step the copies and collectives must leave the GPU idle for the chunk stage."""
VALIDATION_MARGIN = 0.02
"""How much faster than the given configuration the choice must measure to replace it (the
spread of a few steps' times)."""


class _Meter:
    """Steps of the real engine with lr = 0 on random tokens at the run's shapes."""

    def __init__(self, backend, config: RunConfig, args: ModelArgs, *, device: torch.device,
                 rank: int, world: int, steps: int):
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


def select_live(backend, config: RunConfig, args: ModelArgs, *, flavor: str, device: torch.device,
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
        backend.reconfigure(Knobs(delivery=s.delivery, reduction=s.reduction,
                                  chunk_mib=s.chunk_mib, window_slots=s.window_slots,
                                  activation=pol[0].name,
                                  activation_blocks=format_blocks(pol, pol[0])))

    def measure(s: Setting, pol: list[ActivationPolicy], what: str) -> float:
        apply(s, pol)
        t = meter()
        measured[s, format_blocks(pol)] = t
        say(f"[autopolicy] {what}: {t:.3f} s per step (model {model.step_s(s, pol):.3f} s)")
        return t

    baseline = measure(setting, policies, f"the configuration ({setting.describe()})")
    # Routes, then the chunk: measured.
    routes = [(d, r) for d, r in searched_routes()
              if world > 1 and has_regions(backend.state.plan, r)]
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
    gpu_budget, host_budget = budgets(model, host_available=available_host_bytes()
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
    best_policies = policies_from(best_blocks, args.n_layers)
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
