"""AutoPolicy (slidedp/plan/autopolicy.py): its integer program (slidedp/plan/ilp.py) against
brute force on small instances, and the live stages on two CPU ranks, whose choice a later run
loads from the policy file and trains with the same losses."""

import itertools
import json
import random
import re
import pytest

from slidedp.plan.ilp import Choice, Option, feasible, objective, solve
from slidedp.plan.policy_file import POLICY_FILE_NAME
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
                      gpu_bytes=rng.uniform(4, 8) * 2**30, host_bytes=0, rebuilds=False)]
    for i in range(rng.randint(2, 3)):
        offload = rng.random() < 0.5
        choices.append(Choice(
            name=f"p{i}", rebuilds=True,
            demand={"gpu compute": rng.uniform(0.15, 0.4),
                    **({"h2d per GPU": rng.uniform(0.05, 0.3), "d2h per GPU": rng.uniform(0.05, 0.3)}
                       if offload else {})},
            gpu_bytes=rng.uniform(0.2, 4) * 2**30,
            host_bytes=rng.uniform(1, 5) * 2**30 if offload else 0))
    options = [Option(name=f"o{j}", settings={}, residual=rng.uniform(0, 0.3),
                      demand={r: rng.uniform(0.2, 2.5) for r in RESOURCES},
                      gpu_bytes=rng.uniform(2, 10) * 2**30, host_bytes=rng.uniform(10, 60) * 2**30)
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
    text = policy.read_text()
    assert text.startswith("# chosen by AutoPolicy on 2 x cpu") and "[slidedp]" in text
    loaded = run_torchrun(train_flags(tmp_path / "b", f"--slidedp.policy_file={policy}"),
                          nproc=2, env=env)
    assert "[autopolicy]" not in loaded.stdout + loaded.stderr
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
