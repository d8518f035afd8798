"""SlideDP on real gloo ranks equals the `single` backend on the same global batch.

Every datapath (replicated|sharded delivery x gpu|cpu reduction), with gradient accumulation,
global-norm clipping, chunk sizes that do not divide a block, every activation policy (keep,
recompute, segment masks, op-level saves, offload fractions 0, 0.37 and 1, mixed across blocks)
and the FP32-cast delivery path, for 2 and 3 ranks and both families; plus the pieces (plan,
layout, host state) alone.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from protocols.model_spec import get_flavor
from protocols.reconfigure import Knobs
from recipes.baselines.eager import build_single_backend
from recipes.config import JobConfig, run_config
from slidedp.config import SlideDPConfig
from slidedp.gpu_update import gpu_updated_units
from slidedp.layout import SHARD_ALIGN, StateLayout
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.schedule import Use, plan_micro_batch
from slidedp.state_io import master_view
from tests.conftest import REPO, kill_process_tree, run_torchrun, selected, subprocess_env
from tests.slidedp_worker import global_batches, make_config

# A chunk of 0.003 MiB is 1536 elements: it divides neither a block nor a shard.
ODD_CHUNK = 0.003


def run_workers(tmp_path, *, world: int, variants: list[dict], device: str = "cpu",
                kernels: str = "auto", **setting: str | int | float) -> list[dict]:
    """The worker's runs of `variants` on `world` ranks; `setting` (flavor, steps, accum,
    max_norm) for the variants that carry none of their own."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in setting.items()]
    run_torchrun([os.path.join(REPO, "tests", "slidedp_worker.py"),
                  "--variants", json.dumps(variants), *flags, "--out", str(tmp_path),
                  "--device", device, "--kernels", kernels], nproc=world)
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    for i, r in enumerate(results):
        r["weights"] = torch.load(tmp_path / f"weights_{i}.pt")
    return results


@dataclass(frozen=True)
class Case:
    """One test's SlideDP runs on `world` gloo ranks: its variants, with one run setting."""
    world: int
    flavor: str
    steps: int
    accum: int
    max_norm: float
    variants: list[dict]

    @property
    def kw(self) -> dict:
        """The run setting, as single_reference and the worker's variants take it."""
        return dict(flavor=self.flavor, steps=self.steps, accum=self.accum,
                    max_norm=self.max_norm)


def run_cases(tmp_path, cases: dict[str, Case]) -> dict[str, list[dict]]:
    """Every case (of one world size) in one torchrun: one start-up for all, each variant with
    its case's setting. The results by case."""
    (world,) = {c.world for c in cases.values()}
    results = iter(run_workers(tmp_path, world=world, variants=[
        {**c.kw, **v} for c in cases.values() for v in c.variants]))
    return {name: [next(results) for _ in c.variants] for name, c in cases.items()}


def launched_cases(cases: dict[str, Case]) -> Callable:
    """A module fixture over `cases`, keyed by the name of the test that checks each:
    `runs(request.node.name)` is (case, results). Launching is what costs (seconds per rank
    start-up): the first call for a world size runs every selected test's case of that size in
    one torchrun."""

    @pytest.fixture(scope="module")
    def runs(request, tmp_path_factory) -> Callable[[str], tuple[Case, list[dict]]]:
        chosen = selected(request, cases)
        launched: dict[int, dict[str, list[dict]]] = {}

        def results(name: str) -> tuple[Case, list[dict]]:
            world = cases[name].world
            if world not in launched:
                launched[world] = run_cases(tmp_path_factory.mktemp(f"ranks{world}"), {
                    n: cases[n] for n in chosen if cases[n].world == world})
            return cases[name], launched[world][name]

        return results

    return runs


def single_reference(*, world: int, flavor: str, steps: int, accum: int, max_norm: float,
                     device: str = "cpu", kernels: str = "auto"):
    cfg = make_config({}, accum=accum, max_norm=max_norm, kernels=kernels)
    backend = build_single_backend(cfg, get_flavor(flavor), device=torch.device(device))
    losses = []
    for micro in global_batches(steps=steps, accum=accum, batch=2 * world, seq=16,
                                vocab=get_flavor(flavor).vocab_size, seed=7):
        ntok = sum(int((y != -100).sum()) for _, y in micro)
        losses.append(backend.train_step(micro, lr=1e-3, global_target_tokens=ntok).loss_sum / ntok)
    return losses, {n: t.detach().cpu().clone() for n, t in backend.named_master_parameters()}


def assert_matches_reference(results, ref_losses, ref_weights):
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-2), r["variant"]
        assert set(r["weights"]) == set(ref_weights)
        # Adam moves a weight by up to ~lr per step whatever the gradient's size, so BF16
        # rounding of near-zero gradients (e.g. the key bias, whose exact gradient is 0) may flip
        # a few steps: allow 2 lr per step anywhere, and require the typical element to agree
        # far more closely.
        diff = torch.cat([(r["weights"][n] - w).abs().flatten() for n, w in ref_weights.items()])
        assert diff.max() <= 2 * 1e-3 * len(ref_losses), (r["variant"], diff.max())
        assert diff.mean() <= 1e-4, (r["variant"], diff.mean())


# Every policy kind, offload fractions 0.37 and 1 (0: the variants without), mixes across blocks.
POLICY_VARIANTS = [
    {"activation": "segments(qkv+attention_core)@offload=0.37"},
    {"activation": "ops(matmul+attention)",
     "activation_blocks": "0:recompute@offload=1, 1:segments(input_norm+mlp_up+down_proj)"},
    {"activation": "recompute@offload=1", "activation_blocks": "2-3:keep@offload=0.37",
     "window_slots": 2},
    {"activation": "selective@offload=1", "keep_blocks": 1,
     "activation_blocks": "3:segments(qk_norm_rope+o_proj+post_norm)"},
]


def assert_offload_traffic(results):
    """Every offloaded byte comes back, and the start-up measurement predicted the bytes: exactly
    at fraction 1, from above when a split rounds down."""
    for r in results:
        for c in r["counters"]:
            assert c["traffic_offload_d2h_mb"] == c["traffic_offload_h2d_mb"], r["variant"]
            assert c["traffic_offload_d2h_mb"] <= r["predicted_offload_mb"], r["variant"]
            offloads = "offload" in json.dumps(r["variant"])
            assert (c["traffic_offload_d2h_mb"] > 0) == offloads, r["variant"]
            if offloads and "offload=0.37" not in json.dumps(r["variant"]):
                assert c["traffic_offload_d2h_mb"] == pytest.approx(r["predicted_offload_mb"])


# Each multi-rank test's runs, by the test's name: slidedp_runs launches them per world size.
CASES: dict[str, Case] = {}
slidedp_runs = launched_cases(CASES)

CASES["test_two_ranks_every_datapath_with_accumulation_and_clipping"] = Case(
    2, "qwen3-debug", steps=3, accum=2, max_norm=0.5, variants=[
        {"delivery": "sharded", "reduction": "gpu", "chunk_mib": ODD_CHUNK},
        {"delivery": "replicated", "reduction": "cpu", "chunk_mib": ODD_CHUNK},
        {"delivery": "replicated", "reduction": "gpu", "activation": "keep"},
        {"delivery": "sharded", "reduction": "gpu", "activation": "selective", "window_slots": 2},
        {"delivery": "sharded", "reduction": "cpu", "keep_blocks": 2, "bf16_shadow": False,
         "window_slots": 2, "chunk_mib": ODD_CHUNK},
        *POLICY_VARIANTS])


def test_two_ranks_every_datapath_with_accumulation_and_clipping(request, slidedp_runs):
    case, results = slidedp_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=2, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert_offload_traffic(results)
    assert_host_bytes(results, world=2, flavor=case.flavor, accum=case.accum,
                      max_norm=case.max_norm)
    # Traffic per rank (paper's table): sharded delivery halves H2D at R=2; CPU-side reduction
    # returns the full gradient (2x the GPU-reduced shard) and sums R copies on the host.
    t = [r["counters"][0] for r in results]
    assert t[0]["traffic_h2d_mb"] * 2 == pytest.approx(t[1]["traffic_h2d_mb"])
    assert t[0]["traffic_d2h_mb"] * 2 == pytest.approx(t[1]["traffic_d2h_mb"])
    assert t[1]["traffic_host_reduce_mb"] == pytest.approx(t[1]["traffic_d2h_mb"])
    assert t[0]["traffic_all_gather_mb"] > 0 and t[1]["traffic_all_gather_mb"] == 0
    # Fewer slots (2) cost re-deliveries in backward: more H2D than the 3-slot sharded run.
    assert t[3]["traffic_h2d_mb"] > t[0]["traffic_h2d_mb"]


CASES["test_two_ranks_clipping_without_accumulation"] = Case(
    2, "qwen3-debug", steps=3, accum=1, max_norm=0.05, variants=[
        {"delivery": "sharded", "reduction": "gpu"},
        {"delivery": "replicated", "reduction": "cpu", "chunk_mib": ODD_CHUNK},
        {"delivery": "replicated", "reduction": "gpu", "bf16_shadow": False,
         "chunk_mib": ODD_CHUNK},
        {"delivery": "sharded", "reduction": "cpu", "bf16_shadow": False},
        {"delivery": "sharded", "reduction": "gpu", "moments_dtype": "bfloat16"},
        {"delivery": "sharded", "reduction": "cpu", "moments_dtype": "8bit", "pin_threads": True},
        {"delivery": "sharded", "reduction": "gpu", "speculative_update": True}])


def test_two_ranks_clipping_without_accumulation(request, slidedp_runs):
    # One micro-batch with clipping: the route takes the norm (on the GPU, or inside the host
    # sum) and the BF16 gradients wait on the host for the clipped update, which runs after the
    # step: in the shadow, in the BF16 gradient buffer without one, or (cpu route) in the
    # staging copies, summed again. BF16 moments (10 B/param) and 8-bit ones (the last two
    # variants before the last, pinned) train as single does to the same bounds, and so do
    # speculative updates (the last), every one of them redone scaled.
    case, results = slidedp_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=2, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert_host_bytes(results, world=2, flavor=case.flavor, accum=1, max_norm=case.max_norm)
    assert all(n > case.max_norm for r in results for n in r["grad_norms"])  # it did clip
    for r in results:
        # Every update is a clipped one, reported by the step during which it ran: mostly the
        # next (test_clipped_update_between_steps_is_counted_in_the_next), but on a loaded
        # machine a step's updates can end before its own report.
        assert r["counters"][-1]["host_grad_job_s"] > 0
        assert sum(c.get("host_clipped_update_s", 0.0) for c in r["counters"]) > 0
        assert not any("host_accumulate_s" in c or "host_update_s" in c for c in r["counters"])
    # FP32 delivery moves twice the bytes of the shadow's.
    assert results[2]["counters"][1]["traffic_h2d_mb"] == pytest.approx(
        2 * results[1]["counters"][1]["traffic_h2d_mb"])


_A, _B = ["sharded", "cpu"], ["sharded", "gpu"]
_C, _D = ["replicated", "cpu"], ["replicated", "gpu"]
CIRCUIT = [_A, _B, _A, _C, _A, _D, _B, _C, _B, _D, _C, _D, _A]
CASES["test_routes_switch_between_steps_in_every_direction"] = Case(
    2, "qwen3-debug", steps=len(CIRCUIT), accum=2, max_norm=0.0, variants=[
        {"delivery": "sharded", "reduction": "cpu", "routes_per_step": CIRCUIT}])


def test_routes_switch_between_steps_in_every_direction(request, slidedp_runs):
    """reconfigure through all 12 route transitions of the four datapaths (CIRCUIT, an Eulerian
    circuit), with accumulation: the cpu route's buffer release must not wait for returns the
    gpu route never made (it hung on cpu -> gpu -> cpu)."""
    case, results = slidedp_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=2, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    cpu_steps = [i for i, route in enumerate(CIRCUIT) if route[1] == "cpu"]
    counters = results[0]["counters"]
    assert all((counters[i]["traffic_host_reduce_mb"] > 0) == (i in cpu_steps)
               for i in range(len(CIRCUIT)))


# Without clipping: updates during backward (the non-finite guard off), and after it (on).
# Slowed-down updates outlast backward: what is left runs in arrival order (or in the next
# step's order, bit for bit the same) while the next step starts, with the reduced shards
# waiting on the device (no shadow: 12 B/param of host memory); on the cpu route each unit
# is updated as its sum arrives.
_SLOW = {"nonfinite": "off", "update_delay_s": 0.005, "delivery": "replicated"}
_NO_SHADOW = {**_SLOW, "bf16_shadow": False, "chunk_mib": ODD_CHUNK}
CASES["test_three_ranks_untied_qwen25"] = Case(
    3, "qwen2.5-debug", steps=3, accum=1, max_norm=0.0, variants=[
        {"delivery": "sharded", "reduction": "gpu", "chunk_mib": ODD_CHUNK, "nonfinite": "off"},
        {"delivery": "replicated", "reduction": "cpu", "activation": "keep"},
        {"activation": "segments(qkv+o_proj)@offload=1",
         "activation_blocks": "0:selective@offload=0.37"},
        _NO_SHADOW, {**_NO_SHADOW, "update_order": "next_use"},
        {**_SLOW, "reduction": "cpu"}])


def test_three_ranks_untied_qwen25(request, slidedp_runs):
    case, results = slidedp_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=3, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert_offload_traffic(results)
    assert_host_bytes(results, world=3, flavor=case.flavor, accum=1, max_norm=0.0)
    assert_bit_identical(results[3], results[4])

    def reported(r, key):  # a step's updates may end after it returns: the next one reports them
        return any(key in c for c in r["counters"])

    assert reported(results[0], "host_update_s") and not reported(results[1], "host_update_s")
    assert reported(results[1], "host_clipped_update_s")
    sharded, replicated = (r["counters"][0] for r in results[:2])
    assert sharded["traffic_h2d_mb"] * 3 == pytest.approx(replicated["traffic_h2d_mb"])
    assert sharded["traffic_d2h_mb"] * 3 == pytest.approx(replicated["traffic_d2h_mb"])


CASES["test_two_ranks_llama3"] = Case(
    2, "llama3-debug", steps=2, accum=2, max_norm=0.5, variants=[
        {"delivery": "sharded", "reduction": "gpu", "activation": "selective"}])


def test_two_ranks_llama3(request, slidedp_runs):
    """A second model family through the seam (models/llama3/): untied, llama3 RoPE scaling,
    no QK-norm, on the spec's units, embedding and head step."""
    case, results = slidedp_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=2, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert "lm_head.weight" in ref_weights and not any("q_norm" in n for n in ref_weights)


def assert_bit_identical(a: dict, b: dict) -> None:
    """Two runs that differ only in slidedp.update_order: the same losses, norms and weights,
    bit for bit."""
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"], (a["variant"],
                                                                             b["variant"])
    assert all(torch.equal(a["weights"][n], w) for n, w in b["weights"].items()), b["variant"]


def _update_order_case(world: int, accum: int, max_norm: float, nonfinite: str) -> Case:
    slow = {"nonfinite": nonfinite, "update_delay_s": 0.005}
    bases = [{"delivery": "sharded", "reduction": "gpu"},
             {"delivery": "replicated", "reduction": "gpu", "bf16_shadow": False,
              "chunk_mib": ODD_CHUNK},
             {"delivery": "sharded", "reduction": "cpu", "bf16_shadow": False}]
    return Case(world, "qwen3-debug", steps=3, accum=accum, max_norm=max_norm,
                variants=[{**slow, **base, "update_order": order}
                          for base in bases for order in ("next_use", "arrival")])


# On 2 ranks: the order is what varies (test_three_ranks_untied_qwen25 compares orders on 3).
UPDATE_ORDER_RUNS = {"2-2-0.5-stop_consecutive": (2, 2, 0.5, "stop_consecutive"),
                     "2-1-0.5-stop_consecutive": (2, 1, 0.5, "stop_consecutive"),
                     "2-2-0.0-off": (2, 2, 0.0, "off")}
CASES.update({f"test_update_orders_are_bit_identical[{run}]": _update_order_case(*params)
              for run, params in UPDATE_ORDER_RUNS.items()})


@pytest.mark.parametrize("run", UPDATE_ORDER_RUNS)
def test_update_orders_are_bit_identical(request, slidedp_runs, run):
    """Slowed-down host updates outlast backward, so what is left is reordered (with the updates
    during backward; deferred ones wait for the step's norm and run in forward order either
    way). "next_use" and "arrival" give bit-identical losses, norms and weights, and both equal
    `single` within BF16 tolerance: clipping with and without accumulation, accumulation
    without clipping, shadow on and off, both reduction routes."""
    case, results = slidedp_runs(request.node.name)
    max_norm = case.max_norm
    ref_losses, ref_weights = single_reference(world=case.world, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert_host_bytes(results, world=case.world, flavor=case.flavor, accum=case.accum,
                      max_norm=max_norm)
    for next_use, arrival in zip(results[::2], results[1::2]):
        assert_bit_identical(next_use, arrival)
        # The host update calls (one per chunk), unit by unit: deferred ones in forward order
        # in both; during backward the orders differ where backward left updates over.
        orders = next_use["updated_units"], arrival["updated_units"]
        if max_norm > 0:
            assert orders[0] == orders[1]
        else:
            assert orders[0] != orders[1], next_use["variant"]
    if max_norm > 0:
        assert all(n > max_norm for r in results for n in r["grad_norms"])  # it did clip


# Units updated on the device (slidedp/gpu_update.py): the embedding's state streamed there each
# step (embedding_update = "gpu"), or resident there with the first blocks' (embedding_update =
# "resident", gpu_state_blocks); during backward (nonfinite off, no clipping) and after it
# (clipping, or the guard alone), slowed host updates outlasting backward, shadow on and off,
# both families (Qwen3's embedding is tied).
_ON_GPU = {"embedding_update": "gpu", "update_delay_s": 0.002}
_RESIDENT = {"embedding_update": "resident", "update_delay_s": 0.002}
CASES["test_units_updated_on_the_device[clipped]"] = Case(
    2, "qwen3-debug", steps=3, accum=1, max_norm=0.05, variants=[
        {**_ON_GPU, "delivery": "sharded"},
        {**_ON_GPU, "delivery": "replicated", "bf16_shadow": False, "chunk_mib": ODD_CHUNK},
        {**_RESIDENT, "gpu_state_blocks": 2, "update_order": "next_use"},
        # Beside offloaded and replayed activations, as the step-time model's choices run it
        # (recipes/reproduce/common.py PLANNED).
        {**_RESIDENT, "gpu_state_blocks": 2, "update_order": "next_use", "window_slots": 2,
         "activation": "ops(matmul+attention)@offload=1.0", "activation_blocks": "3:selective"},
        {**_ON_GPU, "gpu_state_blocks": 1, "bf16_shadow": False},
        # Every unit on the device: the norm and clipping are taken there (device_clip).
        {**_RESIDENT, "gpu_state_blocks": 4, "update_order": "next_use"},
        # Resident BF16 moments stay BF16 there (10 B/param), updated as the host's would be.
        {**_RESIDENT, "gpu_state_blocks": 4, "moments_dtype": "bfloat16"}])
CASES["test_units_updated_on_the_device[during_backward]"] = Case(
    3, "qwen2.5-debug", steps=3, accum=1, max_norm=0.0, variants=[
        {**_ON_GPU, "nonfinite": "off"},
        {**_ON_GPU, "nonfinite": "off", "bf16_shadow": False, "delivery": "replicated"},
        {**_ON_GPU, "activation": "keep"},
        {**_RESIDENT, "nonfinite": "off", "gpu_state_blocks": 3, "chunk_mib": ODD_CHUNK}])


@pytest.mark.parametrize("run", ["clipped", "during_backward"])
def test_units_updated_on_the_device(request, slidedp_runs, run):
    """AdamW on the device equals `single`; no host update touches those units, and their state
    crosses PCIe as counted. Streamed (the embedding with "gpu"): 12 B/param there each step,
    12 home plus the shadow's 2 when there is one. Resident: 12 B/param there once, then only
    the delivery source home per update (the shadow's 2 B/param, or the master's 4); the
    gradient never goes home."""
    case, results = slidedp_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=case.world, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    if case.max_norm > 0:
        assert all(n > case.max_norm for r in results for n in r["grad_norms"])  # it did clip
    units = StateLayout(get_flavor(case.flavor), world=case.world).units
    for r in results:
        v, steps = r["variant"], len(r["counters"])
        on_gpu = gpu_updated_units(SlideDPConfig(
            embedding_update=v["embedding_update"], gpu_state_blocks=v.get("gpu_state_blocks", 0)),
            n_layers=get_flavor(case.flavor).n_layers)
        assert set(r["updated_units"]) == {u.index for u in units} - set(on_gpu), v
        every_unit = len(on_gpu) == len(units) and case.max_norm > 0
        assert r["device_clips"] == (steps if every_unit else 0), v
        shard_mb = {i: units[i].padded // case.world / 2**20 for i in on_gpu}
        shadow = v.get("bf16_shadow", True)
        # Per update: resident, nothing (the delivery reads the GPU's copy); streamed, the FP32
        # state and the shadow.
        home = {True: 0, False: 14 if shadow else 12}
        per_step = sum(mb * home[on_gpu[i]] for i, mb in shard_mb.items())
        # Each counted by the report of the step during which it ran: the last step's updates
        # may come after the last report; the streamed state comes during backward, every step.
        d2h = sum(c.get("traffic_gpu_update_d2h_mb", 0.0) for c in r["counters"])
        assert per_step * (steps - 1) - 1e-6 <= d2h <= per_step * steps + 1e-6, (d2h, v)
        h2d = sum(c.get("traffic_gpu_update_h2d_mb", 0.0) for c in r["counters"])
        state = 8 if v.get("moments_dtype") == "bfloat16" else 12  # master and moments, B/param
        fetched = sum(mb * state * (1 if on_gpu[i] else steps) for i, mb in shard_mb.items())
        assert h2d == pytest.approx(fetched), (h2d, v)
        assert any(c.get("host_gpu_update_s", 0) > 0 for c in r["counters"])


def test_one_rank_computes_from_resident_units_in_place(tmp_path):
    """On one rank a resident unit's BF16 copy is the whole unit: its uses compute from it where
    it is (Delivery.deliver copies nothing), the forward's saved weights stay references to
    it, and the clipped run equals `single`: every unit resident (the norm on the device), and
    some blocks resident with the rest streamed through the window (the kept activations
    offloaded in part, the resident weights not)."""
    kw = dict(flavor="qwen3-debug", steps=3, accum=1, max_norm=0.05)
    results = run_workers(tmp_path, world=1, variants=[
        {**_RESIDENT, "gpu_state_blocks": 4, "update_order": "next_use"},
        {**_RESIDENT, "gpu_state_blocks": 2, "activation_blocks": "0-3:keep@offload=0.5"}], **kw)
    ref_losses, ref_weights = single_reference(world=1, **kw)
    assert_matches_reference(results, ref_losses, ref_weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
@pytest.mark.parametrize("max_norm", [0.0, 0.05])
def test_one_gpu_embedding_updated_on_the_device(tmp_path, max_norm):
    """The CUDA path of the embedding's update: fused AdamW, the state's copies on their own
    stream, the version gate opened when the delivery source is home."""
    kw = dict(flavor="qwen3-debug", steps=3, accum=1, max_norm=max_norm)
    results = run_workers(tmp_path, world=1, device="cuda", variants=[
        {"embedding_update": "gpu", "nonfinite": "off", "activation": "keep"},
        {"embedding_update": "gpu", "bf16_shadow": False}], **kw)
    ref_losses, ref_weights = single_reference(world=1, device="cuda", **kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert all(r["counters"][0]["traffic_gpu_update_h2d_mb"] > 0 for r in results)


_GPU_STATE = {"embedding_update": "host", "gpu_state_blocks": 2}


@pytest.mark.parametrize("change,accum,said", [
    ({"reduction": "cpu"}, 1, "embedding_update"), ({}, 2, "embedding_update"),
    ({"runtime": "megatrain"}, 1, "embedding_update"),
    ({**_GPU_STATE, "reduction": "cpu"}, 1, "gpu_state_blocks > 0 needs"),
    ({**_GPU_STATE, "gpu_state_blocks": 5}, 1, "gpu_state_blocks: 5 is not within"),
    ({**_GPU_STATE, "delivery": "replicated"}, 1, 'several ranks needs slidedp.delivery = "sharded"'),
    ({**_GPU_STATE, "moments_dtype": "8bit"}, 1, "needs every unit's optimizer state at home"),
    ({"embedding_update": "resident", "moments_dtype": "8bit"}, 1,
     "needs every unit's optimizer state at home"),
    ({"moments_dtype": "8bit"}, 1, 'moments_dtype = "8bit" needs slidedp.embedding_update = "host"')])
def test_updates_on_the_device_refuse_what_they_cannot_serve(change, accum, said):
    """Said by the preflight check, and by the backend before it allocates anything."""
    from recipes.config import ConfigError
    from recipes.preflight import check_mode_options
    from slidedp.engine import SlideDPBackend

    cfg = make_config({"embedding_update": "gpu", **change}, accum=accum, max_norm=0.0)
    cfg.parallelism.mode = "slidedp"
    with pytest.raises(ConfigError, match=said):
        check_mode_options(cfg, get_flavor("qwen3-debug"), world=2)
    if "several ranks" in said:  # the backend's own check, on the ranks it would run on
        from slidedp.gpu_update import check_gpu_updates

        check_gpu_updates(cfg.slidedp, grad_accum_steps=1, n_layers=4, world=1)
        with pytest.raises(ValueError, match=said):
            check_gpu_updates(cfg.slidedp, grad_accum_steps=1, n_layers=4, world=2)
        return
    with pytest.raises(ValueError, match=said):
        SlideDPBackend(run_config(cfg), get_flavor("qwen3-debug"), device=torch.device("cpu"), dp_rank=0,
                       dp_world=1)


CASES["test_two_ranks_qwen25_activation_policies_with_accumulation_and_clipping"] = Case(
    2, "qwen2.5-debug", steps=3, accum=2, max_norm=0.5, variants=POLICY_VARIANTS)


def test_two_ranks_qwen25_activation_policies_with_accumulation_and_clipping(request,
                                                                              slidedp_runs):
    """The untied family with QKV bias (no QK-norm: RoPE rotates the projections' outputs)."""
    case, results = slidedp_runs(request.node.name)
    ref_losses, ref_weights = single_reference(world=2, **case.kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert_offload_traffic(results)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on the GPU machine)")
def test_two_gpus_every_datapath(tmp_path):
    """The CUDA path: streams, events, registered pinned memory, NCCL all-gather/reduce-scatter."""
    variants = [{"delivery": d, "reduction": r, "chunk_mib": ODD_CHUNK}
                for d in ("sharded", "replicated") for r in ("gpu", "cpu")]
    variants.append({"delivery": "sharded", "reduction": "gpu", "activation": "keep",
                     "bf16_shadow": False, "window_slots": 2})
    variants.append({"delivery": "sharded", "reduction": "gpu", "activation": "selective",
                     "keep_blocks": 1, "window_slots": 2})
    variants += POLICY_VARIANTS
    kw = dict(flavor="qwen3-debug", steps=3, accum=2, max_norm=0.5)
    results = run_workers(tmp_path, world=2, variants=variants, device="cuda", **kw)
    ref_losses, ref_weights = single_reference(world=2, device="cuda", **kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert_offload_traffic(results)


@pytest.mark.parametrize("n_slots", [2, 3, 5])
def test_plan_keeps_every_use_on_the_right_buffer(n_slots):
    """The plan is plain data: replayed from its JSON alone, every use finds its unit in its
    buffer, and every offloaded block's activations start back one use before its backward."""
    n_blocks, resident = 6, {}
    offload = [0.0, 1.0, 0.0, 0.37, 0.0, 0.5]
    for micro in range(2):
        planned, after = plan_micro_batch(n_blocks, n_slots, resident=resident,
                                          embed_head_resident=micro > 0, offload=offload)
        uses = [Use(**u) for u in json.loads(json.dumps([dataclasses.asdict(u) for u in planned]))]
        assert uses == planned
        assert [u.offload for u in uses if u.phase == "fwd" and u.unit] == offload
        prefetched = {u.prefetch: k for k, u in enumerate(uses) if u.prefetch is not None}
        assert sorted(prefetched) == [b + 1 for b, f in enumerate(offload) if f > 0]
        for unit, k in prefetched.items():
            assert (uses[k + 1].unit, uses[k + 1].phase) == (unit, "bwd")
        held: dict[int, int] = {s: u for s, u in resident.items()}
        for use in uses:
            if use.unit in (0, n_blocks + 1):
                continue
            if use.deliver:
                held[use.buffer] = use.unit
            assert held.get(use.buffer) == use.unit
        assert after == held
        resident = after
        expected = [("fwd", b) for b in range(1, n_blocks + 1)] + [("bwd", b) for b in range(n_blocks, 0, -1)]
        assert [(u.phase, u.unit) for u in uses if 0 < u.unit <= n_blocks] == expected
    # Backward reuses what forward left in the window: only L - n_slots re-deliveries.
    first, _ = plan_micro_batch(n_blocks, n_slots, resident={}, embed_head_resident=False)
    assert sum(u.deliver for u in first if u.phase == "bwd") == n_blocks - n_slots


@pytest.mark.parametrize("world", [1, 2, 3])
def test_layout_shards_partition_every_unit(world):
    layout = StateLayout(get_flavor("qwen2.5-debug"), world=world)
    offset = 0
    for unit in layout.units:
        assert unit.host_offset == offset and unit.padded % (world * SHARD_ALIGN) == 0
        shards = [unit.shard(r, world) for r in range(world)]
        assert shards[0][0] == 0 and shards[-1][1] == unit.padded
        assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
        offset += unit.padded
    assert layout.total == offset
    assert sum(p.numel for u in layout.units for p in u.params) == get_flavor("qwen2.5-debug").num_params()


def host_bytes_per_element(*, shadow: bool, reduction: str, world: int, accum: int,
                           deferred: bool, moments: str = "float32", speculative: bool = False) -> float:
    """Issue 10's byte count of the shared host state per element, written out apart from
    slidedp/host_state.py: 12 B of FP32 master and moments; +2 for the BF16 shadow, which also
    holds one micro-batch's BF16 gradients while the updates wait for the step's norm (clipping
    or the non-finite guard); without a shadow +2 for those on the gpu route; +4 for
    accumulation; +2R on the cpu route, whose staging copies then hold them. The locked route
    (MegaTrain-style, a BF16 master) is 2 + 8 of moments + 4 of the one shared gradient sum.
    BF16 moments take 4 off the 8 of FP32 ones; 8-bit ones 6, and add two FP32 scales per 128.
    Speculative updates of a deferred step keep the master and moments once more, and the BF16
    gradients in their own buffer beside the shadow."""
    if reduction == "locked":
        return 14
    cpu = reduction == "cpu"
    moments_bytes = {"float32": 8, "bfloat16": 4, "8bit": 2 + 2 * 4 / 128}[moments]
    redo = speculative and deferred and accum == 1
    return ((4 + moments_bytes) * (1 + redo) + 2 * (redo and shadow) + 2 * shadow + 4 * (accum > 1) + 2 * world * cpu
            + 2 * (deferred and accum == 1 and not shadow and not cpu))


def assert_host_bytes(results, *, world: int, flavor: str, accum: int, max_norm: float):
    """What each variant's ranks mapped (the kernel's count) is what the start-up check
    (recipes/preflight.py) computed, and the formula above to within the regions' page
    rounding and the counters."""
    from recipes.preflight import slidedp_host_bytes

    args = get_flavor(flavor)
    total = StateLayout(args, world=world).total
    for r in results:
        cfg = make_config(r["variant"], accum=accum, max_norm=max_norm)
        s = RUNTIME_STYLES[cfg.slidedp.runtime].configure(cfg.slidedp)
        per_element = host_bytes_per_element(
            shadow=s.bf16_shadow, reduction=s.reduction, world=world, accum=accum,
            deferred=max_norm > 0 or cfg.training.nonfinite != "off",
            moments=s.moments_dtype, speculative=s.speculative_update)
        mapped = r["host_mapped_bytes"]
        assert mapped == slidedp_host_bytes(cfg, args, world=world), r["variant"]
        assert 0 <= mapped - total * per_element <= 8 * 4096, (r["variant"], per_element)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_host_bytes_per_parameter_by_mode(world):
    """Every mode (clipping or not, the guard or not, shadow on/off, accumulation, both
    reduction routes): Qwen3-8B's B/param from the plan (what the start-up check uses) equals
    the formula, at most 14 with clipping and 12 without clipping, guard and shadow (issue 10's
    targets); and a real mapping of the debug model's state, as the kernel counts it, has the
    plan's bytes."""
    from slidedp.config import SlideDPConfig
    from slidedp.host_state import HostStatePlan, SharedHostState, host_state_bytes
    from tests.slidedp_worker import mapped_host_state_bytes

    big = get_flavor("qwen3-8B")  # big enough that the padding is below 0.01 B/param
    layouts = StateLayout(big, world=world), StateLayout(get_flavor("qwen3-debug"), world=world)
    for shadow in (True, False):
        for max_norm, nonfinite in ((0.0, "off"), (1.0, "off"), (0.0, "skip"), (1.0, "stop_total")):
            for accum in (1, 2):
                for reduction, moments in (("gpu", "float32"), ("cpu", "float32"),
                                           ("gpu", "bfloat16"), ("gpu", "8bit")):
                    cfg = SlideDPConfig(bf16_shadow=shadow, reduction=reduction,
                                        moments_dtype=moments)
                    plan = HostStatePlan.for_run(cfg, grad_accum_steps=accum, max_norm=max_norm,
                                                 nonfinite=nonfinite)
                    deferred = max_norm > 0 or nonfinite != "off"
                    expected = host_bytes_per_element(shadow=shadow, reduction=reduction,
                                                      world=world, accum=accum, deferred=deferred,
                                                      moments=moments)
                    per_param = host_state_bytes(layouts[0], plan) / big.num_params()
                    assert per_param == pytest.approx(expected, abs=0.01), (plan, per_param)
                    if accum == 1 and reduction == "gpu" and max_norm > 0:
                        assert per_param < 14.01  # clipping, with the shadow or without
                    if accum == 1 and reduction == "gpu" and not deferred and not shadow:
                        assert per_param < 12.01
                    if moments == "bfloat16" and accum == 1 and max_norm > 0:
                        assert per_param < 10.01  # issue 28: 14 -> 10 with BF16 moments
                    if moments == "8bit" and accum == 1 and max_norm > 0:
                        assert per_param < 8.08  # and -> 8 with 8-bit ones
                    state = SharedHostState(layouts[1], plan, rank=0, world=world,
                                            share=lambda s: s, barrier=lambda: None, pin=False)
                    try:
                        assert mapped_host_state_bytes() == host_state_bytes(layouts[1], plan)
                        # Every region but the counters is per element.
                        per_element = sum(t.nbytes for name, t in state.regions.items()
                                          if name != "control") / layouts[1].total
                        assert per_element == expected, plan
                    finally:
                        state.close()


def test_clipped_update_between_steps_is_counted_in_the_next():
    """Step t's clipped update runs after step t returns; if it ends before step t+1 starts, its
    host time is still reported by step t+1."""
    from slidedp.engine import SlideDPBackend
    from tests.slidedp_worker import slow_down_updates

    args = get_flavor("qwen3-debug")
    backend = SlideDPBackend(run_config(make_config({}, accum=1, max_norm=1e-3)), args,
                             device=torch.device("cpu"), dp_rank=0, dp_world=1)
    # Each update outlasts the step's return by far, also on a loaded machine.
    slow_down_updates(backend, 0.2)
    try:
        x = torch.randint(0, args.vocab_size, (2, 16))
        first = backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel())
        # Reading the weights waits for pending updates: step 1's clipped update is finished
        # before step 2 starts.
        dict(backend.named_master_parameters())
        second = backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel())
    finally:
        backend.close()
    assert "host_clipped_update_s" not in first.extra
    assert second.extra["host_clipped_update_s"] > 0
    assert second.extra["host_grad_job_s"] > 0


@pytest.mark.parametrize("order", ["next_use", "arrival"])
def test_updates_left_after_backward_run_in_the_next_steps_order(order):
    """With a slow CPU update (a delay injected into every update) most updates are still queued
    when backward ends. train_step returns once the gradients are home; in "next_use" order the
    embedding, which the next forward needs first, is updated first, and the next step's first
    delivery passes its version gate while the last blocks' updates are still running. In
    "arrival" order the embedding's update comes last: the next step waits for the whole queue.
    Either way every unit is updated once per step, and the run equals `single`."""
    from slidedp.engine import SlideDPBackend
    from tests.slidedp_worker import slow_down_updates

    kw = dict(flavor="qwen3-debug", steps=3, accum=1, max_norm=0.0)
    args = get_flavor(kw["flavor"])
    config = make_config({"nonfinite": "off", "update_order": order}, accum=1, max_norm=0.0)
    backend = SlideDPBackend(run_config(config), args, device=torch.device("cpu"), dp_rank=0, dp_world=1)
    updates, gates, losses, rows = [], {}, [], []
    slow_down_updates(backend, 0.05, updates)
    wait_version = backend.delivery.wait_version

    def gate(unit, version):  # when each delivery's gate opened
        wait_version(unit, version)
        gates[unit.index, version] = time.perf_counter()

    backend.delivery.wait_version = gate
    try:
        for micro in global_batches(steps=3, accum=1, batch=2, seq=16, vocab=args.vocab_size,
                                    seed=7):
            ntok = sum(int((y != -100).sum()) for _, y in micro)
            result = backend.train_step(micro, lr=1e-3, global_target_tokens=ntok)
            losses.append(result.loss_sum / ntok)
            rows.append(result.extra)
        weights = {n: t.clone() for n, t in backend.named_master_parameters()}
    finally:
        backend.close()
    n_units = len(backend.layout.units)
    steps = [updates[i:i + n_units] for i in range(0, len(updates), n_units)]
    assert len(steps) == 3 and all(sorted(u for u, _, _ in s) == list(range(n_units))
                                   for s in steps)
    first = steps[0]
    embed_end = next(end for u, _, end in first if u == 0)
    last_end = max(end for _, _, end in first)
    next_forward = gates[0, 1]  # step 2's delivery of the embedding
    if order == "next_use":
        assert embed_end < last_end and next_forward < last_end
        # The embedding's gradient comes home last; from then on the updates go block by block.
        late = [u for u, _, end in first if end >= embed_end]
        assert late == sorted(late)
    else:
        assert first[-1][0] == 0 and next_forward >= last_end
    assert "update_tail_s" in rows[1] and rows[0]["update_wait_s"] < 0.05 * n_units
    ref_losses, ref_weights = single_reference(world=1, **kw)
    assert_matches_reference([{"variant": order, "losses": losses, "weights": weights}],
                             ref_losses, ref_weights)


def test_activation_policies_switch_between_steps():
    """New activation policies between steps (the bench and AutoPolicy's validation use it): a run that
    changes policy every step still equals `single`."""
    from slidedp.engine import SlideDPBackend

    kw = dict(flavor="qwen3-debug", steps=3, accum=1, max_norm=0.0)
    args = get_flavor(kw["flavor"])
    backend = SlideDPBackend(run_config(make_config({}, accum=1, max_norm=0.0)), args,
                             device=torch.device("cpu"), dp_rank=0, dp_world=1)
    losses = []
    try:
        data = global_batches(steps=3, accum=1, batch=2, seq=16, vocab=args.vocab_size, seed=7)
        settings = [("keep", "", 0), ("selective", "", 2),
                    ("recompute", "2:segments(attention_core)@offload=1, 3:keep@offload=0.37", 1)]
        for micro, (policy, blocks, keep) in zip(data, settings):
            backend.reconfigure(Knobs(activation=policy, activation_blocks=blocks,
                                      keep_blocks=keep))
            ntok = sum(int((y != -100).sum()) for _, y in micro)
            result = backend.train_step(micro, lr=1e-3, global_target_tokens=ntok)
            losses.append(result.loss_sum / ntok)
        weights = {n: t.clone() for n, t in backend.named_master_parameters()}
    finally:
        backend.close()
    assert [p.name for p in backend.policies] == [
        "keep", "recompute", "segments(attention_core)@offload=1.0", "keep@offload=0.37"]
    assert result.extra["traffic_offload_h2d_mb"] > 0  # the pool grew for the last step's policies
    ref_losses, ref_weights = single_reference(world=1, **kw)
    assert_matches_reference([{"variant": "switching", "losses": losses, "weights": weights}],
                             ref_losses, ref_weights)


def test_too_little_host_memory_is_refused_before_allocating():
    from slidedp.engine import SlideDPBackend

    before = _shmem_bytes()
    with pytest.raises(MemoryError, match="GiB of host memory"):
        SlideDPBackend(run_config(make_config({}, accum=1, max_norm=0.0)), get_flavor("qwen2.5-72B"),
                       device=torch.device("cpu"), dp_rank=0, dp_world=1)
    assert _shmem_bytes() - before < 2**26


def _shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))


KILLED_RANK = """
import os, signal, sys, torch
from dataclasses import replace
from protocols.model_spec import get_flavor
from slidedp.host_state import HostStatePlan, SharedHostState
from slidedp.layout import StateLayout
args = replace(get_flavor("qwen3-debug"), dim=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64,
               hidden_dim=1536, vocab_size=32768, tie_embeddings=False)
plan = HostStatePlan(bf16_shadow=True, grad_bf16=False, grad_accum=False, cpu_staging=False)
state = SharedHostState(StateLayout(args, world=1), plan, rank=0, world=1, share=lambda s: s,
                        barrier=lambda: None, pin=False)
state.master.fill_(1.0)
state.exp_avg.fill_(1.0)
print(state.master.numel() * 8, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_shared_state_is_released_when_a_rank_is_killed():
    before = _shmem_bytes()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RANK], cwd=REPO, text=True,
                            env=subprocess_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    touched = int(proc.stdout.readline())
    assert touched > 2**27
    assert _shmem_bytes() - before > touched // 2  # the pages live in shared memory ...
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == -9
    assert _shmem_bytes() - before < touched // 4  # ... and go with the killed process


@pytest.mark.parametrize("flavor", ["qwen3-debug", "qwen2.5-debug"])
def test_host_state_starts_from_a_hugging_face_checkpoint(tmp_path, flavor):
    """model.hf_dir streams the checkpoint into the shared FP32 master (and BF16 shadow)."""
    from models.hf_checkpoint import save_hf_checkpoint
    from protocols.model_spec import spec_of
    from slidedp.engine import SlideDPBackend

    args = get_flavor(flavor)
    torch.manual_seed(123)
    model = spec_of(args).model_cls(args)
    model.init_weights()
    save_hf_checkpoint(model.named_parameters(), args, tmp_path / "hf", dtype=torch.float32,
                       max_shard_bytes=2**17)
    cfg = make_config({}, accum=1, max_norm=0.0)
    cfg.model.hf_dir = str(tmp_path / "hf")
    backend = SlideDPBackend(run_config(cfg), args, device=torch.device("cpu"), dp_rank=0, dp_world=1)
    try:
        loaded = dict(backend.named_master_parameters())
        assert set(loaded) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(loaded[name], p.detach(), rtol=0, atol=0)
        torch.testing.assert_close(backend.state.shadow[:backend.layout.total],
                                   backend.state.master.to(torch.bfloat16), rtol=0, atol=0)
    finally:
        backend.close()


FAILING_STEP = """
import sys, torch, torch.distributed as dist
from protocols.model_spec import get_flavor
from recipes.config import run_config
from slidedp.engine import SlideDPBackend
from tests.slidedp_worker import make_config
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
args = get_flavor("qwen3-debug")
variant = {"delivery": sys.argv[1], "activation": sys.argv[4]}
backend = SlideDPBackend(run_config(make_config(variant, accum=1, max_norm=float(sys.argv[2]))),
                         args, device=torch.device("cpu"), dp_rank=rank, dp_world=world)
x = torch.randint(0, args.vocab_size, (2, 16))
backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel() * world)
bad = torch.full((2, 16), args.vocab_size)  # not a token: the embedding lookup (or the loss) raises
if sys.argv[3] == "closed":  # a bad label: the head fails with every block's activations offloaded
    try:
        backend.train_step([(x, bad)], lr=1e-3, global_target_tokens=x.numel() * world)
    finally:
        assert backend.offloader.blocks_held == 0 and backend.offloader.pool.nbytes == 0
        backend.close()
else:  # uncaught, and no close(): the interpreter's exit must not wait on the runtime's threads
    backend.train_step([(bad, x)], lr=1e-3, global_target_tokens=x.numel() * world)
"""


@pytest.mark.parametrize("delivery,max_norm,ending,activation", [
    ("sharded", 0.0, "uncaught", "recompute"), ("replicated", 1.0, "closed", "keep@offload=1")])
def test_a_failing_step_ends_every_rank_promptly(tmp_path, delivery, max_norm, ending, activation):
    """An error inside a step (here a bad token id or label; on a GPU typically out-of-memory)
    reaches the caller and the process exits, releasing the shared state and the offloaded
    activations, instead of waiting forever on the runtime's delivery and update threads."""
    script = tmp_path / "failing_step.py"
    script.write_text(FAILING_STEP)
    before = _shmem_bytes()
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node=2", str(script), delivery, str(max_norm), ending,
                                 activation],
                                cwd=REPO, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        raise AssertionError("a rank hung after its step failed:\n" + log.read_text()[-3000:])
    out = log.read_text()
    assert proc.returncode != 0
    assert "IndexError" in out, out[-3000:]
    assert _shmem_bytes() - before < 2**26


NO_THREAD_LEFT = """
import torch, torch.distributed as dist
from protocols.model_spec import get_flavor
from recipes.config import run_config
from slidedp.engine import SlideDPBackend
from tests.rank_exit import assert_no_gloo_thread_left, gloo_threads
from tests.slidedp_worker import make_config


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
default = gloo_threads(-1)
assert default > 0, "torch names its gloo worker threads pt_gloo_runloop"
args = get_flavor("qwen3-debug")
cfg = make_config({"delivery": "sharded", "reduction": "cpu"}, accum=1, max_norm=0.5)
backend = SlideDPBackend(run_config(cfg), args, device=torch.device("cpu"), dp_rank=rank,
                         dp_world=world)
x = torch.randint(0, args.vocab_size, (2, 16))
backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel() * world)
backend.close()
assert gloo_threads(default) == default  # the backend's groups are gone (it is still referenced)
dist.destroy_process_group()
assert_no_gloo_thread_left()  # the default group too: nothing holds it past destroy
"""


def test_no_gloo_thread_outlives_close_and_destroy(tmp_path):
    """close() ends the backend's process groups and destroy_process_group() the default one,
    each joining its gloo threads then: one still alive at interpreter exit that drops a finished
    collective's tensors needs the GIL there and aborts the rank ("terminate called without an
    active exception", seen on a loaded 2-core CI machine)."""
    script = tmp_path / "no_thread_left.py"
    script.write_text(NO_THREAD_LEFT)
    run_torchrun([str(script)], nproc=2)


def test_offloaded_activations_are_freed_when_a_step_fails():
    """A step that fails in the head, with every block's activations offloaded (and the graphs
    still referenced by the exception's traceback): every host slice and every GPU-side copy is
    released at once, and the backend refuses further steps."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from slidedp.activations.offload import BlockOffload
    from slidedp.engine import SlideDPBackend

    args = get_flavor("qwen3-debug")
    cfg = make_config({"activation": "recompute@offload=1",
                       "activation_blocks": "1-2:keep@offload=0.37"}, accum=1, max_norm=0.0)
    backend = SlideDPBackend(run_config(cfg), args, device=torch.device("cpu"), dp_rank=0, dp_world=1)
    held: list[StorageWeakRef] = []
    pack = BlockOffload.pack

    def recording_pack(self, t):
        packed = pack(self, t)
        if packed is not t:
            held.extend(StorageWeakRef(x.untyped_storage()) for x in
                        (packed.stored.host, packed.stored.rest) if x is not None)
        return packed

    BlockOffload.pack = recording_pack
    try:
        x = torch.randint(0, args.vocab_size, (2, 16))
        backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel())
        held.clear()
        with pytest.raises(IndexError) as failure:
            backend.train_step([(x, torch.full_like(x, args.vocab_size))], lr=1e-3,
                               global_target_tokens=x.numel())
        assert held and failure.traceback  # offloaded, and the traceback is alive
        assert all(ref.expired() for ref in held)
        assert backend.offloader.blocks_held == 0 and backend.offloader.pool.nbytes == 0
        with pytest.raises(RuntimeError, match="restart from the last checkpoint"):
            backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel())
    finally:
        BlockOffload.pack = pack
        backend.close()


def test_reconfigure_checks_each_knob_against_the_routes_in_force():
    """reconfigure applies the routes before the embedding update, so the update is checked
    against the route the call leaves in force, in one call or over two; Knobs refuses block
    overrides without the policy they modify."""
    from slidedp.engine import SlideDPBackend

    cfg = make_config({"reduction": "cpu"}, accum=1, max_norm=0.0)
    backend = SlideDPBackend(run_config(cfg), get_flavor("qwen3-debug"), device=torch.device("cpu"),
                             dp_rank=0, dp_world=1)
    try:
        with pytest.raises(ValueError, match='embedding_update = "gpu" needs'):
            backend.reconfigure(Knobs(embedding_update="gpu"))  # the cpu route is in force
        backend.reconfigure(Knobs(reduction="gpu", embedding_update="gpu"))
        assert (backend.cfg.reduction, backend.cfg.embedding_update) == ("gpu", "gpu")
        backend.reconfigure(Knobs(embedding_update="host"))
        backend.reconfigure(Knobs(reduction="cpu", chunk_mib=1.0, window_slots=2))
        assert (backend.cfg.delivery, backend.cfg.reduction, backend.cfg.chunk_mib,
                backend.cfg.window_slots) == ("sharded", "cpu", 1.0, 2)
        with pytest.raises(ValueError, match='embedding_update = "gpu" needs'):
            backend.reconfigure(Knobs(embedding_update="gpu"))
        # Numbers are held to their [slidedp] fields' bounds, as the config's are.
        with pytest.raises(ValueError, match=r"^slidedp.window_slots must be >= 2, got 1$"):
            backend.reconfigure(Knobs(window_slots=1))
    finally:
        backend.close()
    with pytest.raises(ValueError, match="apply with activation"):
        Knobs(keep_blocks=2)


def test_pinning_units_makes_one_registration_widened_over_those_it_overlaps():
    """A copy that straddles two cudaHostRegister ranges is refused, and CUDA registers a page
    once: the GPU updates' units are pinned as one range, and a later one that overlaps
    registered ranges replaces them with their union."""
    from slidedp.host_state import widened

    assert widened([], 0, 8) == ((0, 8), [])
    assert widened([(0, 16)], 4, 8) is None
    assert widened([(0, 4), (10, 12)], 2, 8) == ((0, 8), [(0, 4)])
    assert widened([(0, 4), (6, 12)], 2, 8) == ((0, 12), [(0, 4), (6, 12)])


def test_a_large_models_units_are_drawn_at_once_as_drawn_one_by_one(monkeypatch):
    """Above PARALLEL_INIT_PARAMS each unit draws from a generator of its own, on threads that
    draw several units at once: every unit's master is what its own generator draws alone, in
    the unit's parameter order, and the shadow is its BF16 copy."""
    import slidedp.engine as engine
    from protocols.model_spec import spec_of

    monkeypatch.setattr(engine, "PARALLEL_INIT_PARAMS", 0)
    args = get_flavor("qwen3-debug")
    backend = engine.SlideDPBackend(run_config(make_config({}, accum=1, max_norm=1.0)), args,
                                    device=torch.device("cpu"), dp_rank=0, dp_world=1)
    try:
        seed = JobConfig().training.seed
        for unit in backend.layout.units:
            gen = torch.Generator().manual_seed(seed * 100_003 + unit.index)
            for p in unit.params:
                want = torch.empty(p.shape)
                spec_of(args).init_parameter(p.name, want, generator=gen)
                assert torch.equal(master_view(backend.state, p.name), want), p.name
            assert torch.equal(backend.state.unit_view("shadow", unit.index),
                               backend.state.unit_view("master", unit.index).bfloat16())
    finally:
        backend.close()
