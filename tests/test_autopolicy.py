"""AutoPolicy (slidedp/plan/search.py, live.py): its integer program (slidedp/plan/ilp.py) against
brute force on small instances; the screen, the calibration and the meter on the Qwen3-8B case
of issue 11 (the model from shipped rates, the probe's timings and the measurements made up);
and the live stages on two CPU ranks, whose choice a later run loads from the policy file and
trains with the same losses."""

import itertools
import json
import random
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from recipes.config import parse_config, resolve_model, run_config
from slidedp.activations import KEEP, RECOMPUTE, parse_policy
from slidedp.plan import live
from slidedp.plan.live import _Meter
from slidedp.plan.search import (Model, Setting, assign, budgets, build_program, calibrate, screen,
                                 setting_of, solve_modelled)
from slidedp.plan.ilp import Choice, Option, feasible, objective, solve
from slidedp.plan.policy_file import POLICY_FILE_NAME
from slidedp.plan.rates import BlockTiming, load_rates, model_key, timing_key
from slidedp.plan.report import kernels_for
from slidedp.plan.workload import Workload
from tests.conftest import run_torchrun, subprocess_env

RESOURCES = ("gpu compute", "cpu update", "h2d per GPU", "d2h per GPU")


def compositions(total: int, parts: int):
    """Every way to write `total` as `parts` non-negative integers."""
    for cut in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *cut, total + parts - 1)
        yield [b - a - 1 for a, b in zip(edges, edges[1:])]


def brute_force(options, choices, *, blocks, ranks, gpu_budget, host_budget, rebuild_bytes):
    by_name, best = {c.name: c for c in choices}, None
    for option in options:
        for counts in compositions(blocks, len(choices)):
            assigned = {c.name: n for c, n in zip(choices, counts) if n}
            if feasible(option, assigned, by_name, ranks=ranks, gpu_budget=gpu_budget,
                        host_budget=host_budget, rebuild_bytes=rebuild_bytes):
                value = objective(option, assigned, by_name)
                best = value if best is None else min(best, value)
    return best


def instance(seed: int):
    rng = random.Random(seed)
    choices = [Choice(name="keep", demand={"gpu compute": rng.uniform(0.1, 0.2)},
                      gpu_bytes=rng.uniform(4, 8) * 2**30, host_bytes=0, rebuilds=False,
                      residual=rng.uniform(-0.05, 0.05))]
    for i in range(rng.randint(2, 3)):
        offload = rng.random() < 0.5
        choices.append(Choice(
            name=f"p{i}", rebuilds=True,
            demand={"gpu compute": rng.uniform(0.15, 0.4),
                    **({"h2d per GPU": rng.uniform(0.05, 0.3), "d2h per GPU": rng.uniform(0.05, 0.3)}
                       if offload else {})},
            gpu_bytes=rng.uniform(0.2, 4) * 2**30,
            host_bytes=rng.uniform(1, 5) * 2**30 if offload else 0,
            residual=rng.uniform(-0.05, 0.05) if rng.random() < 0.5 else 0.0))
    options = [Option(name=f"o{j}", settings={}, residual=rng.uniform(0, 0.3),
                      demand={r: rng.uniform(0.2, 2.5) for r in RESOURCES},
                      gpu_bytes=rng.uniform(2, 10) * 2**30, host_bytes=rng.uniform(10, 60) * 2**30,
                      gpu_floor_bytes=rng.uniform(5, 30) * 2**30)
               for j in range(rng.randint(1, 3))]
    return options, choices, dict(blocks=rng.randint(3, 7), ranks=rng.randint(1, 3),
                                  gpu_budget=rng.uniform(15, 40) * 2**30,
                                  host_budget=rng.uniform(50, 90) * 2**30,
                                  rebuild_bytes=rng.uniform(1, 6) * 2**30)


@pytest.mark.parametrize("seed", range(25))
def test_the_program_finds_the_brute_force_optimum(seed):
    options, choices, kw = instance(seed)
    best = brute_force(options, choices, **kw)
    found = solve(options, choices, **kw)
    if best is None:
        assert found is None
        return
    assert found is not None and found.objective == pytest.approx(best, abs=1e-6)
    assert sum(found.counts.values()) == kw["blocks"]
    assert feasible(found.option, found.counts, {c.name: c for c in choices}, ranks=kw["ranks"],
                    gpu_budget=kw["gpu_budget"], host_budget=kw["host_budget"],
                    rebuild_bytes=kw["rebuild_bytes"])


def test_spare_memory_buys_the_policy_that_replays_less():
    keep = Choice("keep", {"gpu compute": 0.1}, gpu_bytes=4 * 2**30, host_bytes=0, rebuilds=False)
    recompute = Choice("recompute", {"gpu compute": 0.13}, gpu_bytes=0.1 * 2**30, host_bytes=0,
                       rebuilds=True)
    option = Option("o", {"gpu compute": 1.0, "cpu update": 1.5}, gpu_bytes=10 * 2**30,
                    host_bytes=0, settings={}, residual=0.0)
    kw = dict(blocks=10, ranks=1, host_budget=2**40, rebuild_bytes=0.5 * 2**30)
    roomy = solve([option], [keep, recompute], gpu_budget=60 * 2**30, **kw)
    assert roomy.counts == {"keep": 10}
    tight = solve([option], [keep, recompute], gpu_budget=(10 + 0.5 + 9 * 0.1 + 4) * 2**30, **kw)
    assert tight.counts == {"keep": 1, "recompute": 9}
    # Host-bound: the CPU update (1.5 s) hides the replay, so any fitting mix is as fast.
    assert tight.objective == pytest.approx(max(1.0 + 0.1 + 9 * 0.13, 1.5), abs=1e-3)
    assert solve([option], [keep], gpu_budget=20 * 2**30, **kw) is None


def test_the_gradients_at_backwards_end_bound_an_option_but_do_not_add_to_the_activations():
    """The device's peak is the larger of the activations and the gradients left at backward's
    end (MemoryEstimate.total): an option's floor rules it out above the budget, and below it
    costs the blocks nothing, however close to the budget."""
    keep = Choice("keep", {"gpu compute": 0.1}, gpu_bytes=4 * 2**30, host_bytes=0, rebuilds=False)
    option = Option("o", {"gpu compute": 1.0}, gpu_bytes=10 * 2**30, host_bytes=0, settings={},
                    residual=0.0, gpu_floor_bytes=49 * 2**30)
    kw = dict(blocks=10, ranks=1, host_budget=2**40, rebuild_bytes=0.0)
    assert solve([option], [keep], gpu_budget=50 * 2**30, **kw).counts == {"keep": 10}
    assert solve([option], [keep], gpu_budget=48 * 2**30, **kw) is None


# ---- the screen, the calibration, the meter -------------------------------------------------------

SELECTIVE = parse_policy("selective")


def qwen3_8b(*, selective_vs_recompute: float) -> Model:
    """Qwen3-8B at 24 sequences from `recompute` on every block, on the shipped H200 rates with a
    probe's block timings: `selective` `selective_vs_recompute` times recompute's (the probe
    found 11.40 against 11.29 ms per sequence), `keep` without the replay."""
    parsed = parse_config(["--job.config_file=train_configs/h200_qwen3_8b_slidedp.toml",
                           "--training.local_batch_size=24", "--slidedp.activation=recompute",
                           "--slidedp.keep_blocks=0", "--slidedp.window_slots=2"])
    (flavor, args), config = resolve_model(parsed), run_config(parsed)
    rates = load_rates("h200")
    kernels = kernels_for(config, rates)
    seq = config.training.seq_len
    recompute = BlockTiming(forward_s=3.76e-3, backward_s=7.53e-3, batch=8)
    blocks = {timing_key("recompute", seq): recompute,
              timing_key("selective", seq): replace(
                  recompute, backward_s=recompute.backward_s * selective_vs_recompute
                  + recompute.forward_s * (selective_vs_recompute - 1)),
              timing_key("keep", seq): replace(recompute, backward_s=2 * recompute.forward_s)}
    rates = rates.with_model(model_key(args, kernels), blocks, {})
    return Model(config, args, flavor, kernels, 1, rates)


def test_a_probes_block_timings_time_only_the_model_it_ran():
    """The rates carry Qwen3-8B's measured blocks: they time the 8B, while Qwen3-4B (another
    model key) is timed from its FLOPs, not from the 8B's blocks."""
    model = qwen3_8b(selective_vs_recompute=1.0)
    seq = model.config.training.seq_len
    assert model.work.block(RECOMPUTE, 8) == (3.76e-3 * 8, 7.53e-3 * 8)
    (flavor, args) = resolve_model(parse_config(["--model.flavor=qwen3-4B"]))
    other = Workload(model.rates, args, flavor=flavor, kernels=model.kernels, seq=seq)
    forward, backward = other.block(RECOMPUTE, 8)
    assert forward != 3.76e-3 * 8 and backward > 2 * forward
    assert other.cost(RECOMPUTE) is None


def solved_on_h200(flags: list[str], resident_blocks: tuple[int, ...], candidates: tuple[str, ...],
                   **setting):
    """The program alone and solve_modelled for the configuration of `flags` on one H200 (the
    h200 rates), over its setting with each count of resident blocks (and `setting`) and the
    candidate policies; with the simulated step of a solution."""
    parsed = parse_config(flags)
    (flavor, args), config = resolve_model(parsed), run_config(parsed)
    rates = load_rates("h200")
    model = Model(config, args, flavor, kernels_for(config, rates), 1, rates)
    settings = [replace(setting_of(config), gpu_state_blocks=n, **setting) for n in resident_blocks]
    options, choices, rebuild = build_program(model, settings,
                                              [parse_policy(p) for p in candidates])
    gpu, host = budgets(model)
    kw = dict(gpu_budget=gpu, host_budget=host, rebuild_bytes=rebuild)
    alone = solve(options, choices, blocks=args.n_layers, ranks=1, **kw)
    priced = solve_modelled(model, options, choices, **kw)

    def simulated(found):
        return model.step_s(Setting(**found.option.settings), assign(found, args.n_layers))

    return alone, priced, simulated


def test_the_offline_search_prices_what_the_schedule_exposes_of_an_offload():
    """Qwen3-8B at 3 sequences with BF16 moments: all 36 blocks' optimizer state resident leaves
    room for activations only offloaded, whose copies back at the turn to backward the demands
    do not show; 27 resident leave room to keep every matmul. The program alone takes the
    offload (it prices it at the GPU's time); priced by the schedule, the 27 with no offload,
    which the simulation has faster."""
    alone, priced, simulated = solved_on_h200(
        ["--job.config_file=train_configs/h200_qwen3_8b_slidedp.toml", "--training.max_norm=1.0",
         "--slidedp.moments_dtype=bfloat16", "--training.local_batch_size=3"], (36, 27),
        ("keep@offload=1.0", "ops(matmul+attention)", "ops(matmul+attention)@offload=1.0"),
        reduction="gpu", bf16_shadow=True, embedding_update="resident")
    assert alone.option.settings["gpu_state_blocks"] == 36
    assert priced.option.settings["gpu_state_blocks"] == 27
    assert priced.counts == {"ops(matmul+attention)": 36}
    assert simulated(priced) < 0.85 * simulated(alone)


def test_the_offline_search_takes_the_option_the_simulation_has_faster_at_the_blocks_chosen():
    """Qwen3-4B at 4 sequences, updates under backward (no clipping, no guard), every block's
    matmuls kept and the rest offloaded: the program prices 9 and 18 blocks' optimizer state on
    the GPU with every block under recompute, whose long backward hides the host's updates, and
    takes 9 for the GPU memory it frees; with the blocks it keeps, the simulation has the host's
    updates of 27 blocks exposed and 18 faster, which the search takes."""
    alone, priced, simulated = solved_on_h200(
        ["--job.config_file=train_configs/h200_qwen3_4b_slidedp.toml", "--training.max_norm=0",
         "--training.nonfinite=off"], (9, 18), ("ops(matmul+attention)@offload=1.0",))
    assert alone.option.settings["gpu_state_blocks"] == 9
    assert priced.option.settings["gpu_state_blocks"] == 18
    assert priced.objective == simulated(priced) < 0.95 * simulated(alone)


def test_the_screen_keeps_a_candidate_within_its_tolerance_and_drops_a_dominated_one():
    """`selective` keeps more bytes than `recompute`: 1% slower in the probe (its noise) it goes
    on to the calibration, 10% slower it is dropped; `keep`, the fastest, always stays."""
    candidates = [KEEP, SELECTIVE, RECOMPUTE]
    close = qwen3_8b(selective_vs_recompute=1.01)
    assert close.work.activation_bytes(SELECTIVE, 24) > close.work.activation_bytes(RECOMPUTE, 24)
    assert screen(close, candidates) == candidates
    assert screen(qwen3_8b(selective_vs_recompute=1.10), candidates) == [KEEP, RECOMPUTE]


def calibrated_choice(model: Model, measured_gain_s: float):
    """The program's choice after calibrating keep and selective against recompute, where the
    steps measure each as the model predicts but selective (on every block) `measured_gain_s`
    faster than that."""
    setting, policies = setting_of(model.config), [RECOMPUTE] * model.args.n_layers
    gpu_budget, host_budget = budgets(model)
    trials = []

    def measure(trial, what):
        trials.append((trial, what))
        return model.step_s(setting, trial) - measured_gain_s * (SELECTIVE in trial)

    shortlist = screen(model, [KEEP, SELECTIVE, *policies])
    correction = calibrate(model, setting, policies, shortlist, ref=model.step_s(setting, policies),
                           measure=measure, gpu_budget=gpu_budget, host_budget=host_budget)
    options, choices, rebuild = build_program(model, [setting], shortlist,
                                              block_correction=correction)
    found = solve(options, choices, blocks=model.args.n_layers, ranks=1, gpu_budget=gpu_budget,
                  host_budget=host_budget, rebuild_bytes=rebuild)
    return correction, trials, found


def test_a_measured_gain_the_model_does_not_predict_moves_the_choice():
    """The probe has `selective` 1% slower than `recompute` with more bytes, so the model alone
    recomputes what it does not keep; the steps measure selective on all 36 blocks 0.2 s faster
    than the model: the calibration trusts that (the old one ignored a gain the model had the
    other sign of) and the program takes selective."""
    model = qwen3_8b(selective_vs_recompute=1.01)
    L = model.args.n_layers
    correction, trials, model_alone = calibrated_choice(model, 0.0)
    assert correction["keep"] == pytest.approx(0.0) and correction["selective"] == pytest.approx(0.0)
    assert "selective" not in model_alone.counts and model_alone.counts["recompute"] > L // 2
    # Each candidate takes as many blocks as fit: keep a few, selective every one.
    kept = sum(p == KEEP for p in trials[0][0])
    assert 0 < kept < L and trials[0][1] == f"calibration: keep on {kept} blocks"
    assert trials[1] == ([SELECTIVE] * L, f"calibration: selective on {L} blocks")
    correction, _, found = calibrated_choice(model, 0.2)
    assert correction["selective"] == pytest.approx(-0.2 / L)
    assert found.counts == {"selective": L}  # keep on top of it does not fit
    # The program reproduces the measurement it was calibrated on.
    measured = model.step_s(setting_of(model.config), [SELECTIVE] * L) - 0.2
    assert found.objective == pytest.approx(measured, rel=1e-3)
    assert found.objective < model_alone.objective - 0.05


def test_an_absurd_measurement_is_bounded_by_the_blocks_gpu_time():
    model = qwen3_8b(selective_vs_recompute=1.01)
    correction, _, _ = calibrated_choice(model, 1000.0)
    assert correction["selective"] == pytest.approx(-model.block_gpu_s(SELECTIVE))


def test_the_meter_drops_a_whole_update_cycle_at_first_then_the_first_step(monkeypatch):
    """Step times 9, 7, 1 then 5, 2: the first measurement of two steps runs three and keeps
    the third, the next runs two and keeps the second."""
    clock = [0.0]
    durations = [9.0, 7.0, 1.0, 5.0, 2.0]

    class Backend:
        def train_step(self, batches, *, lr, global_target_tokens):
            assert lr == 0.0 and len(batches) == 1 and batches[0][0].shape == (2, 4)
            clock[0] += durations.pop(0)

    monkeypatch.setattr(live.time, "perf_counter", lambda: clock[0])
    config = SimpleNamespace(training=SimpleNamespace(local_batch_size=2, seq_len=4,
                                                      grad_accum_steps=1))
    meter = _Meter(Backend(), config, SimpleNamespace(vocab_size=11), device=torch.device("cpu"),
                   rank=0, world=1, steps=2)
    assert meter() == 1.0 and meter.steps == 3
    assert meter() == 2.0 and meter.steps == 5 and not durations


# ---- live, on two CPU ranks ------------------------------------------------------------------------


def train_flags(out, *flags: str) -> list[str]:
    return ["-m", "recipes.train", "--job.config_file=train_configs/debug_cpu.toml",
            "--parallelism.mode=slidedp", "--training.steps=3", f"--job.dump_folder={out}",
            "--checkpoint.save_dir=", "--metrics.enable_tensorboard=false", "--metrics.log_freq=1",
            *flags]


def losses(out) -> list[float]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def test_autopolicy_on_two_ranks_then_its_policy_file_trains_alike(tmp_path):
    """The live stages run on both ranks (routes, chunk, calibration, the program, validation),
    take the same decisions, write the policy file and reset the optimizer: training then
    follows exactly the losses of a run that loads the file, so the lr = 0 steps left the
    weights as they were."""
    env = subprocess_env(SLIDEDP_RATES_DIR=str(tmp_path / "rates"))
    chosen = run_torchrun(train_flags(tmp_path / "a", "--slidedp.autopolicy",
                                      "--slidedp.autopolicy_candidates=keep, recompute@offload=1"),
                          nproc=2, env=env)
    output = chosen.stdout + chosen.stderr
    policy = tmp_path / "a" / POLICY_FILE_NAME
    assert policy.is_file(), output[-3000:]
    assert re.search(r"\[autopolicy\] chose .*; selection [\d.]+ s over \d+ steps", output)
    assert "[autopolicy] routes replicated/gpu" in output  # both delivery routes were measured
    assert re.search(r"\[autopolicy\] calibration: \S+ on \d+ blocks", output)
    text = policy.read_text()
    assert text.startswith("# chosen by AutoPolicy on 2 x cpu") and "[slidedp]" in text
    loaded = run_torchrun(train_flags(tmp_path / "b", f"--slidedp.policy_file={policy}"),
                          nproc=2, env=env)
    assert "[autopolicy]" not in loaded.stdout + loaded.stderr
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_the_search_weighs_optimizer_state_on_the_gpu():
    """Qwen3-4B at one sequence on the H200's rates, host-bound by the clipped CPU update: the
    search's options place the embedding's and a quarter, half, three quarters or all of the
    blocks' optimizer state on the GPU, each placement the simulation makes faster, and the
    program takes one that keeps state there; with accumulation no GPU update can run, so only
    the configuration's own placement remains."""
    from slidedp.plan.search import Setting, resident_levels, runs
    parsed = parse_config(["--job.config_file=train_configs/h200_qwen3_4b_slidedp.toml",
                           "--training.local_batch_size=1", "--slidedp.activation=recompute",
                           "--slidedp.keep_blocks=0", "--slidedp.embedding_update=host",
                           "--slidedp.gpu_state_blocks=0", "--slidedp.update_order=arrival"])
    (flavor, args), config = resolve_model(parsed), run_config(parsed)
    rates = load_rates("h200")
    model = Model(config, args, flavor, kernels_for(config, rates), 1, rates)
    L, base = args.n_layers, setting_of(config)
    levels = resident_levels(config, L)
    assert levels == [(0, "host"), (0, "resident"), (L // 4, "resident"), (L // 2, "resident"),
                      (3 * L // 4, "resident"), (L, "resident")]
    settings = [Setting(**{**base.__dict__, "gpu_state_blocks": b, "embedding_update": e})
                for b, e in levels]
    assert all(runs(s, config, L, world=1) for s in settings)
    steps = [model.step_s(s, [RECOMPUTE] * L) for s in settings]
    assert all(a > b for a, b in zip(steps, steps[1:])), steps
    options, choices, rebuild = build_program(model, settings, [RECOMPUTE])
    gpu_budget, host_budget = budgets(model)
    found = solve(options, choices, blocks=L, ranks=1, gpu_budget=gpu_budget,
                  host_budget=host_budget, rebuild_bytes=rebuild)
    assert found.option.settings["gpu_state_blocks"] > 0, found.option.name
    assert found.option.settings["embedding_update"] == "resident"
    accumulated = replace(config, training=replace(config.training, grad_accum_steps=2))
    assert [lv for lv in resident_levels(accumulated, L)
            if runs(Setting(**{**base.__dict__, "gpu_state_blocks": lv[0],
                               "embedding_update": lv[1]}), accumulated, L, world=1)] == [(0, "host")]
