"""The shipped rates files (slidedp/plan/rates/*.json): each loads and round-trips, its CPU tables
reach its machine's cores, each multi-GPU machine plans a run on all of its devices, and the
H200 hosts hold what issue 14's plan (docs/results/issue14_plan.md) says they hold."""

import re

import pytest

from recipes.plan import load_job
from slidedp.host_state import host_state_regions
from slidedp.layout import StateLayout
from slidedp.plan.predict import state_plan
from slidedp.plan.rates import SHIPPED, Rates, load_rates
from slidedp.plan.report import plan_text

NAMES = sorted(p.stem for p in SHIPPED.glob("*.json"))
MULTI_GPU = [name for name in NAMES if load_rates(name).machine.devices > 1]
GiB = 2**30


def test_the_multi_gpu_h200_kinds_ship():
    assert {"h200x2", "h200x4", "h200x8"} <= set(MULTI_GPU)


@pytest.mark.parametrize("name", NAMES)
def test_a_shipped_rates_file_round_trips_and_its_cpu_tables_reach_its_cores(name):
    rates = load_rates(name)
    assert Rates.from_json(rates.to_json()) == rates
    # by_threads is flat past the last count: a table that stopped short would leave the
    # machine's other cores idle in every prediction.
    for table in (rates.adam_gparams, rates.grad_sum_gelems):
        assert max(table) == rates.machine.cores
        counts = sorted(table)
        assert all(table[a] <= table[b] for a, b in zip(counts, counts[1:]))


@pytest.mark.parametrize("name", MULTI_GPU)
def test_a_multi_gpu_machine_plans_a_run_on_all_of_its_devices(name, tmp_path):
    rates = load_rates(name)
    devices = rates.machine.devices
    job = load_job(["--parallelism.mode=slidedp", "--model.flavor=qwen3-debug",
                    "--training.seq_len=64", "--training.local_batch_size=2",
                    f"--job.dump_folder={tmp_path}"])
    text = "\n".join(plan_text(job, rates, world=devices))
    assert f" {devices} rank(s) x " in text and "DOES NOT FIT" not in text, text
    assert float(re.search(r"^predicted step: ([\d.]+) s", text, re.M)[1]) > 0, text


def _host_gib(flavor: str, world: int, *, accum: int) -> float:
    """SlideDP's shared host state for `flavor` on `world` ranks, no clipping."""
    job = load_job(["--parallelism.mode=slidedp", f"--model.flavor={flavor}",
                    "--training.max_norm=0", "--training.nonfinite=off",
                    f"--training.grad_accum_steps={accum}"])
    return sum(host_state_regions(StateLayout(job.args, world=world),
                                  state_plan(job.config)).values()) / GiB


def test_qwen3_32b_fits_the_x4_and_x8_hosts_only_without_accumulation():
    """Issue 14's weak scaling: Qwen3-32B's 14 B/param fit the 4- and 8-GPU hosts, not the
    2-GPU one; the FP32 accumulation buffer (18 B/param) fits none of them."""
    host = {name: load_rates(name).machine.host_memory_gib for name in ("h200x2", "h200x4", "h200x8")}
    plain, accumulated = _host_gib("qwen3-32B", 8, accum=1), _host_gib("qwen3-32B", 8, accum=4)
    assert host["h200x2"] < plain < host["h200x4"] < host["h200x8"] < accumulated
