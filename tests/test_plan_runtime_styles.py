"""The planner and the model check plan a peer runtime style (slidedp.runtime) with the style's
routes and host regions and, where the step-time model has one, its own schedule, as the bench
runs it (the suite strong_scaling_14b sets SlideFormer's style beside SlideDP)."""

import json
import re

import pytest

from recipes.bench.model_check import compare, prediction_rows
from recipes.plan import load_job
from slidedp.plan.predict import step_spec
from slidedp.plan.rates import load_rates
from slidedp.plan.report import plan_text
from slidedp.plan.steptime import simulate_step

FLAGS = ["--parallelism.mode=slidedp", "--model.flavor=qwen3-debug", "--training.seq_len=64",
         "--training.local_batch_size=2", "--training.max_norm=0", "--training.nonfinite=off"]


def _step_s(text: str) -> float:
    return float(re.search(r"^predicted step: ([\d.]+) s", text, re.M)[1])


def test_a_slideformer_style_plan_runs_its_routes_and_its_schedule():
    rates = load_rates("h200x4")
    style = load_job([*FLAGS, "--slidedp.runtime=slideformer"])
    text = "\n".join(plan_text(style, rates, world=4))
    spec = step_spec(style.config, style.args, flavor="qwen3-debug", kernels="liger", world=4,
                     rates=rates, schedule="slideformer")
    assert (spec.delivery, spec.reduction) == ("replicated", "cpu")  # the style's, not the config's
    assert _step_s(text) == pytest.approx(simulate_step(spec, rates).step_s, abs=1e-3)
    own = "\n".join(plan_text(load_job(FLAGS), rates, world=4))
    assert "staging" in text and "staging" not in own  # every rank returns its whole gradient


def test_a_style_without_a_schedule_is_planned_with_slidedps_and_says_so():
    text = "\n".join(plan_text(load_job([*FLAGS, "--slidedp.runtime=megatrain"]),
                               load_rates("h200x4"), world=4))
    assert "simulated with SlideDP's own schedule (the model has none for the megatrain runtime)" in text


@pytest.mark.parametrize("flags", [["--slidedp.reduction=locked"], ["--slidedp.runtime=megatrain"]])
def test_the_locked_route_defers_updates_in_the_plan_as_in_the_engine(flags):
    """Without clipping or the guard, the locked route's one sum is complete only after every
    rank's backward: the plan defers its updates (slidedp.host_state.updates_deferred), as the
    engine does, and says why."""
    job, rates = load_job([*FLAGS, *flags]), load_rates("h200x4")
    spec = step_spec(job.config, job.args, flavor="qwen3-debug", kernels="liger", world=4,
                     rates=rates)
    assert spec.reduction == "locked" and spec.deferred
    assert "the locked route's one sum" in "\n".join(plan_text(job, rates, world=4))
    own = load_job(FLAGS)
    assert not step_spec(own.config, own.args, flavor="qwen3-debug", kernels="liger", world=4,
                         rates=rates).deferred


def test_a_slideformer_point_is_predicted_and_joined_under_the_benchs_keys(tmp_path):
    """`predict --runtime slideformer --accum 2` keys its row as the bench keys the measured one
    (the style's routes, the accumulation), so `compare` joins them; a MegaTrain-style row, which
    the model has no schedule for, is left out."""
    (row,) = prediction_rows("h200x4", flavor="qwen3-debug", seq=64, points=["recompute:4"],
                             world=4, route="sharded/gpu", kernels="auto", slots=3, chunk_mib=32.0,
                             max_norm=0.0, nonfinite="off", accum=2, runtime="slideformer")
    assert (row["route"], row["runtime"], row["accum"]) == ("replicated/cpu", "slideformer", 2)
    predicted, runs = tmp_path / "predicted.jsonl", tmp_path / "runs.jsonl"
    predicted.write_text(json.dumps(row) + "\n")
    measured = {k: v for k, v in row.items() if k not in ("predicted_s", "regime", "why", "rates")}
    megatrain = {**measured, "runtime": "megatrain", "route": "replicated/locked"}
    runs.write_text("".join(json.dumps({**r, "step_time_s": row["predicted_s"] * 1.25}) + "\n"
                            for r in (measured, megatrain)))
    lines, errors = compare(str(predicted), [str(runs)])
    assert errors == [pytest.approx(-0.2)]
    assert sum(line.startswith("| runs |") for line in lines) == 1
