"""The peer runtime styles (slidedp.runtime = "slideformer" | "megatrain", slidedp/peer_styles.py)
on real gloo ranks against `single` on the same global batch, with accumulation and clipping,
and what makes each what it is: who updates, the routes, the BF16 master, the host bytes."""

import time

import pytest
import torch

from protocols.model_spec import get_flavor
from recipes.config import run_config
from slidedp.config import SlideDPConfig
from slidedp.host_state import HostStatePlan, host_state_bytes, updates_deferred
from slidedp.layout import StateLayout
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.routes import REDUCTIONS
from tests.test_slidedp import (ODD_CHUNK, Case, assert_host_bytes, assert_matches_reference,
                                launched_cases, single_reference)

LR, STEPS = 1e-3, 3


def assert_bf16_master_matches_reference(results, ref_losses, ref_weights):
    """MegaTrain-style BF16 master weights: every update is rounded to BF16, so a weight drifts
    from the FP32-master reference by up to half a BF16 ulp per step on top of Adam's lr per
    step; the losses agree to 2%, every weight to that bound, and the typical one closely."""
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=2e-2), r["variant"]
        assert set(r["weights"]) == set(ref_weights)
        for name, ref in ref_weights.items():
            w = r["weights"][name]
            assert w.dtype == torch.bfloat16, name  # the master itself is BF16
            ulp = ref.abs().clamp_min(2.0**-126) * 2.0**-8
            bound = STEPS * (2 * LR + ulp)
            assert ((w.float() - ref).abs() <= bound).all(), (r["variant"], name)
        diff = torch.cat([(r["weights"][n].float() - w).abs().flatten()
                          for n, w in ref_weights.items()])
        assert diff.mean() <= 5e-4, (r["variant"], diff.mean())


def assert_sole_updater(results):
    """SlideFormer-style: rank 0 (the only rank whose update calls the worker records) updates
    every unit once per step, and the ranks move full gradients over the cpu route."""
    for r in results:
        for c in r["counters"]:
            assert c["traffic_host_reduce_mb"] == pytest.approx(2 * c["traffic_d2h_mb"])
            assert c.get("traffic_all_gather_mb", 0) == 0 and c.get("traffic_reduce_scatter_mb", 0) == 0


# Each multi-rank test's runs, by the test's name: peer_runs launches them per world size.
CASES = {f"test_peer_styles_match_single_with_accumulation_and_clipping[{world}]": Case(
    world, "qwen3-debug", steps=STEPS, accum=2, max_norm=0.5, variants=[
        {"runtime": "slideformer", "chunk_mib": ODD_CHUNK},
        {"runtime": "megatrain", "chunk_mib": ODD_CHUNK, "activation": "keep"}])
    for world in (2, 3)}
CASES["test_peer_styles_without_accumulation_or_clipping"] = Case(
    2, "qwen3-debug", steps=STEPS, accum=1, max_norm=0.0, variants=[
        {"runtime": "slideformer", "nonfinite": "off", "update_delay_s": 0.002},
        {"runtime": "megatrain", "nonfinite": "off", "update_delay_s": 0.002}])
peer_runs = launched_cases(CASES)


@pytest.mark.parametrize("world", [2, 3])
def test_peer_styles_match_single_with_accumulation_and_clipping(request, peer_runs, world):
    case, results = peer_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=world, **case.kw)
    assert_matches_reference(results[:1], ref_losses, ref_weights)
    assert_bf16_master_matches_reference(results[1:], ref_losses, ref_weights)
    assert all(n > case.max_norm for r in results for n in r["grad_norms"])  # it did clip
    assert [r["grad_norms"] for r in results][0] == pytest.approx(results[1]["grad_norms"],
                                                                  rel=2e-2)
    assert_host_bytes(results, world=world, flavor=case.flavor, accum=case.accum,
                      max_norm=case.max_norm)


def test_peer_styles_without_accumulation_or_clipping(request, peer_runs):
    """One micro-batch, guard off: SlideFormer's rank 0 updates inside the host sum during
    backward; MegaTrain's updates still wait for the whole backward."""
    case, results = peer_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=2, **case.kw)
    assert_matches_reference(results[:1], ref_losses, ref_weights)
    assert_bf16_master_matches_reference(results[1:], ref_losses, ref_weights)
    assert_sole_updater(results[:1])
    n_units = get_flavor(case.flavor).n_layers + 2
    for r in results:  # rank 0 updates every unit
        assert sorted(set(r["updated_units"])) == list(range(n_units)), r["variant"]
    # SlideFormer: the other rank runs no CPU Adam; MegaTrain: each rank updates its shard.
    assert results[0]["update_calls_per_rank"][1] == 0 < results[0]["update_calls_per_rank"][0]
    assert min(results[1]["update_calls_per_rank"]) > 0


def test_style_sets_routes_layout_and_host_bytes():
    args = get_flavor("qwen3-debug")
    base = SlideDPConfig(delivery="sharded", reduction="gpu")
    former = RUNTIME_STYLES["slideformer"].configure(SlideDPConfig(runtime="slideformer"))
    mega = RUNTIME_STYLES["megatrain"].configure(SlideDPConfig(runtime="megatrain",
                                                               bf16_shadow=True))
    assert (former.delivery, former.reduction, former.bf16_shadow) == ("replicated", "cpu", True)
    assert (mega.delivery, mega.reduction, mega.bf16_shadow) == ("replicated", "locked", False)
    with pytest.raises(ValueError, match="runs delivery/reduction replicated/cpu"):
        RUNTIME_STYLES["slideformer"].check_routes("sharded", "gpu")
    RUNTIME_STYLES["slidedp"].check_routes("sharded", "gpu")
    # Rank 0 owns every element under SlideFormer; the other ranks own none.
    layout = StateLayout(args, world=3, sole_owner=True)
    for u in layout.units:
        assert u.shard(0, 3) == (0, u.padded)
        assert u.shard(1, 3)[0] == u.shard(1, 3)[1] == u.shard(2, 3)[1] == u.padded
    # Host bytes per element: SlideDP 14 (shadow), SlideFormer 14 + 2R (staging), MegaTrain
    # 2 (BF16 master) + 8 (moments) + 4 (the one FP32 gradient sum), with or without accumulation.
    layout = StateLayout(args, world=2)
    for runtime, accum, per_element in (("slidedp", 1, 14), ("slideformer", 1, 18),
                                        ("megatrain", 1, 14), ("megatrain", 4, 14),
                                        ("slideformer", 4, 22)):
        cfg = SlideDPConfig(runtime=runtime) if runtime != "slidedp" else base
        plan = HostStatePlan.for_run(cfg, grad_accum_steps=accum, max_norm=1.0,
                                     nonfinite="stop_consecutive")
        got = host_state_bytes(layout, plan)
        assert 0 <= got - layout.total * per_element <= 8 * 4096, (runtime, accum)
    plan = HostStatePlan.for_run(SlideDPConfig(runtime="megatrain"), grad_accum_steps=1,
                                 max_norm=0.0, nonfinite="off")
    # Updates after the whole backward, from the one shared sum, even without clipping.
    assert updates_deferred(max_norm=0.0, nonfinite="off", reduction="locked")
    assert REDUCTIONS["locked"].hold(plan, n_micro=4, deferred=True).name == "shared_accum"
    without_lock = HostStatePlan.for_run(base, grad_accum_steps=1, max_norm=0.0, nonfinite="off")
    with pytest.raises(ValueError, match="needs the shared gradient sum"):
        REDUCTIONS["locked"].hold(without_lock, n_micro=1, deferred=True)


def test_megatrain_updates_after_the_whole_backward_and_before_the_step_returns():
    """One rank, a slowed-down update, no clipping and the guard off (where SlideDP updates
    during backward): MegaTrain-style, every update of a step starts after the step's last
    gradient came home and ends before train_step returns."""
    from slidedp.engine import SlideDPBackend
    from tests.slidedp_worker import global_batches, make_config, slow_down_updates

    args = get_flavor("qwen3-debug")
    config = make_config({"runtime": "megatrain", "nonfinite": "off"}, accum=1, max_norm=0.0)
    backend = SlideDPBackend(run_config(config), args, device=torch.device("cpu"), dp_rank=0, dp_world=1)
    updates, returns, step_ends = [], [], []
    slow_down_updates(backend, 0.01, updates)
    start = backend.grad_return.start

    def timed_start(*a, **kw):
        out = start(*a, **kw)
        returns.append(time.perf_counter())
        return out

    backend.grad_return.start = timed_start
    try:
        for micro in global_batches(steps=2, accum=1, batch=2, seq=16, vocab=args.vocab_size,
                                    seed=7):
            ntok = sum(int((y != -100).sum()) for _, y in micro)
            backend.train_step(micro, lr=LR, global_target_tokens=ntok)
            step_ends.append(time.perf_counter())
    finally:
        backend.close()
    n_units = len(backend.layout.units)
    assert len(updates) == len(returns) == 2 * n_units
    for step in range(2):
        last_return = returns[(step + 1) * n_units - 1]
        for _, begin, end in updates[step * n_units:(step + 1) * n_units]:
            assert last_return <= begin and end <= step_ends[step]


def test_bench_compares_the_styles(tmp_path):
    """recipes/bench/throughput.py --slidedp.runtime, through the head-to-head experiment on 2 CPU ranks
    (its end-to-end check: tests/test_reproduce.py): each style runs its own routes, its rows
    name it and its host bytes, and the experiment divides SlideDP's throughput by each style's."""
    import csv
    import json

    from tests.test_reproduce import check_end_to_end

    recorded = check_end_to_end("head_to_head", tmp_path)
    rows = {r["runtime"]: r for r in map(json.loads, open(recorded))}
    assert {k: rows[k]["route"] for k in rows} == {
        "slidedp": "sharded/gpu", "slideformer": "replicated/cpu", "megatrain": "replicated/locked"}
    # 14 B/param, + 2R of staging for SlideFormer, 2 + 8 + 4 for MegaTrain (to within padding).
    for runtime, per_param in (("slidedp", 14), ("slideformer", 18), ("megatrain", 14)):
        assert rows[runtime]["host_state_bytes_per_param"] == pytest.approx(per_param, rel=0.02)
    assert not rows["megatrain"]["bf16_shadow"]
    with open(tmp_path / "head_to_head.csv") as f:
        peers = {r["peer"] for r in csv.DictReader(f) if r["local_batch"] == "geomean"}
    assert peers == {"slideformer", "megatrain"}


@pytest.mark.parametrize("runtime", ["slideformer", "megatrain"])
def test_peer_styles_save_and_resume_exactly(runtime, tmp_path):
    """./run_train.sh on 2 ranks: a style's saves (SlideFormer's rank 1 owns an empty shard,
    MegaTrain's master is BF16) resume bit for bit."""
    from safetensors.torch import load_file

    from tests.test_resume import STEPS, assert_same_state, resume_half_way, train_state

    first, second = resume_half_way(tmp_path, f"--slidedp.runtime={runtime}")
    final = f"hf/step-{STEPS}"
    saved = train_state(first / final, tmp_path)
    masters = [t for k, t in saved.items() if "/master.u" in k]
    assert masters and {t.dtype for t in masters} == {
        torch.bfloat16 if runtime == "megatrain" else torch.float32}
    assert_same_state(load_file(second / final / "model.safetensors"),
                      load_file(first / final / "model.safetensors"))


def test_preflight_and_device_estimate_count_each_style():
    """The start-up check's exact host bytes for Qwen3-8B on 2 ranks, and the device estimate:
    MegaTrain-style holds no FP32 cast buffer (its BF16 master goes to the GPU as it is) and its
    gradients wait on the host, so its device bytes are SlideDP's with the shadow."""
    from recipes.config import JobConfig, run_config
    from slidedp.plan.memory import estimate_device_memory
    from recipes.preflight import slidedp_host_bytes

    args = get_flavor("qwen3-8B")
    per_param, device = {}, {}
    for runtime in ("slidedp", "slideformer", "megatrain"):
        config = JobConfig()
        config.parallelism.mode, config.slidedp.runtime = "slidedp", runtime
        per_param[runtime] = slidedp_host_bytes(config, args, world=2) / args.num_params()
        device[runtime] = estimate_device_memory(run_config(config), args, world=2).total
    assert per_param == pytest.approx({"slidedp": 14, "slideformer": 18, "megatrain": 14},
                                      rel=1e-3)
    assert device["megatrain"] == device["slidedp"]
