"""The planner's activation bytes from the shapes (slidedp/plan/memory.py) against what the
engine measures: its start-up measurement of one block on the CPU (slidedp/activations/cost.py),
the same measurement's reports on the H200, and the peaks measured there."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models.kernels import TORCH_KERNELS
from protocols.model_spec import get_flavor
from slidedp.activations import KEEP, RECOMPUTE, measure_costs, parse_policy
from slidedp.gpu_update import GPU_CHUNK
from slidedp.layout import StateLayout
from slidedp.plan.memory import activation_bytes, estimate_device_memory, rebuilt_bytes
from slidedp.run_config import RunConfig
from tests.conftest import REPO

GiB, MiB = 2**30, 2**20
RESULTS = Path(REPO, "docs", "results", "2026-12-01-h200")

POLICIES = ["recompute", "keep", "segments()", "segments(input_norm+qkv+qk_norm_rope+attention_core"
            "+o_proj+post_norm+mlp_up+down_proj)", "segments(attention_core)",
            "segments(qkv+attention_core+o_proj+mlp_up+down_proj)",
            "segments(input_norm+qk_norm_rope+post_norm)", "segments(qkv+qk_norm_rope+mlp_up)",
            "segments(post_norm+mlp_up+down_proj)@offload=0.5", "selective", "ops(matmul)",
            "ops(matmul+attention)@offload=1"]
"""The empty and the full mask (in both spellings), masks whose replayed runs start at every
kind of boundary, an offloaded mask, and the op-level sets."""


@pytest.mark.parametrize("flavor", ["qwen3-debug", "qwen2.5-debug"])
def test_shape_bytes_are_what_the_engine_measures_on_the_cpu(flavor):
    """Per token and per position, GPU and host: equal up to the fit's float rounding."""
    args = get_flavor(flavor)
    policies = [parse_policy(p) for p in POLICIES]
    costs = measure_costs(policies, args, TORCH_KERNELS, device=torch.device("cpu"), seq_len=128)
    for policy in policies:
        gpu, host = activation_bytes(args, policy, compute_bytes=2, kernels="torch")
        measured = costs[policy]
        for ours, theirs in ((gpu, measured.gpu), (host, measured.host)):
            assert ours.per_token == pytest.approx(theirs.per_token, rel=1e-9), policy.name
            assert ours.per_position == pytest.approx(theirs.per_position, rel=1e-9, abs=1e-9)


def rebuilt(args, policy: str, kernels: str = "torch") -> float:
    return rebuilt_bytes(args, parse_policy(policy), compute_bytes=2, kernels=kernels).per_token


def test_what_backward_rebuilds():
    """Nothing under keep; the whole block under recompute, less the block input where keep
    saves it (liger's RMSNorm), as the replay reads it where recompute kept it; a mask's largest
    replayed run, no more; an offloaded part comes back."""
    args = get_flavor("qwen3-4B")
    keep = {k: activation_bytes(args, KEEP, compute_bytes=2, kernels=k)[0].per_token
            for k in ("torch", "liger")}
    assert rebuilt(args, "keep") == 0 and rebuilt(args, "recompute") == keep["torch"]
    assert rebuilt(args, "recompute", "liger") == keep["liger"] - 2 * args.dim
    norms = "segments(qkv+attention_core+o_proj+mlp_up+down_proj)"  # replays the norms only
    assert 0 < rebuilt(args, norms) < rebuilt(args, "segments(attention_core)") < keep["torch"]
    assert rebuilt(args, "keep@offload=0.5") == pytest.approx(keep["torch"] / 2)


# The H200's start-up reports, "[slidedp] activations per block for 8 x 4096 tokens"
# (docs/results/2026-12-01-h200/h200_call{5,6}_log.txt; liger): (flavor, policy, MiB GPU, host).
H200_REPORTS = [
    ("qwen3-4B", "keep", 3435.3, 0.0), ("qwen3-4B", "recompute", 160.0, 0.0),
    ("qwen3-4B", "selective", 420.0, 0.0), ("qwen3-4B", "keep@offload=0.1", 3091.7, 343.5),
    ("qwen3-4B", "keep@offload=0.3", 2404.7, 1030.6),
    ("qwen3-4B", "segments(qkv+attention_core+o_proj+mlp_up+down_proj)", 3428.0, 0.0),
    ("qwen3-8B", "keep", 4299.3, 0.0), ("qwen3-8B", "recompute", 256.0, 0.0),
    ("qwen3-8B", "selective", 516.0, 0.0),
]


@pytest.mark.parametrize("flavor, policy, gpu_mib, host_mib", H200_REPORTS)
def test_shape_bytes_are_the_h200_start_up_reports(flavor, policy, gpu_mib, host_mib):
    """Within the reports' rounding to 0.1 MiB (and the SDPA kernel's few fixed bytes)."""
    gpu, host = activation_bytes(get_flavor(flavor), parse_policy(policy), compute_bytes=2,
                                 kernels="liger")
    assert gpu.at(8, 4096) / MiB == pytest.approx(gpu_mib, abs=0.1)
    assert host.at(8, 4096) / MiB == pytest.approx(host_mib, abs=0.1)


def test_shape_bytes_are_call_1s_keep_bytes_on_both_paths():
    """recipes/bench/activations.py's count through autograd's saved tensors, one sequence."""
    rows = [json.loads(line) for line in (RESULTS / "h200_call1_activations.jsonl").open()]
    rows = [r for r in rows if r["saved_bytes_per_token"] is not None]
    assert {(r["flavor"], r["kernels"]) for r in rows} == {
        (f, k) for f in ("qwen3-4B", "qwen3-8B") for k in ("torch", "liger")}
    for r in rows:
        gpu, _ = activation_bytes(get_flavor(r["flavor"]), parse_policy(r["policy"]),
                                  compute_bytes=2, kernels=r["kernels"])
        assert gpu.at(r["batch"], r["seq"]) / (r["batch"] * r["seq"]) == pytest.approx(
            r["saved_bytes_per_token"], abs=0.01)


def _slidedp_config(row: dict) -> RunConfig:
    """A recorded one-H200 SlideDP row's configuration."""
    config = RunConfig()
    t = config.training
    t.local_batch_size, t.seq_len, t.max_norm = row["local_batch"], row["seq"], row["max_norm"]
    delivery, reduction = row["route"].split("/")
    config.slidedp = dataclasses.replace(
        config.slidedp, activation=row["ac"], activation_blocks=row["activation_blocks"],
        keep_blocks=row["keep_blocks"], delivery=delivery, reduction=reduction,
        bf16_shadow=row.get("bf16_shadow", config.slidedp.bf16_shadow))
    return config


def test_segment_mask_peaks_on_the_h200():
    """The masks' measured peaks (calls 5 and 6): the estimate is within 0-10% above them;
    counted as recompute it was 16.3 GiB for Qwen3-4B's 124.9."""
    rows = [json.loads(line) for call in (5, 6)
            for line in (RESULTS / f"h200_call{call}_runs.jsonl").open()]
    masks = [r for r in rows if r["mode"] == "slidedp" and r["ac"].startswith("segments(")]
    assert {(r["flavor"], r["local_batch"]) for r in masks} == {
        ("qwen3-4B", 8), ("qwen3-8B", 5), ("qwen3-8B", 6)}
    for r in masks:
        est = estimate_device_memory(_slidedp_config(r), get_flavor(r["flavor"]), world=1,
                                     kernels=r["kernels"])
        assert 1.0 < est.total / GiB / r["peak_mem_alloc_gib"] < 1.10, r



def _embedding_update_config(*, batch: int, activation: str, where: str) -> RunConfig:
    config = RunConfig()
    config.training.local_batch_size, config.training.seq_len = batch, 4096
    config.slidedp = dataclasses.replace(config.slidedp, activation=activation,
                                         embedding_update=where)
    return config


@pytest.mark.parametrize("world", [1, 2])
def test_the_embeddings_state_on_the_device_is_a_later_peak(world):
    """slidedp.embedding_update = "gpu" with Qwen3-4B (tied: 389M parameters in the embedding):
    from the backward of block 4 on, this rank's shard at 12 B/param and a GPU_CHUNK piece of
    the gradient in FP32 and BF16, beside blocks 0-4's activations (what the other 31 blocks kept
    is freed by then) or, when backward ends, the reduced gradient shard waiting for the norm. At one sequence under recompute, on one rank it is above backward's start
    and the estimate grows by the difference; on two the half shard stays below. At eight
    sequences under keep it is far below, and nothing changes."""
    args = get_flavor("qwen3-4B")
    shard = StateLayout(args, world=world).embed.padded // world
    state = 12 * shard + 6 * min(shard, GPU_CHUNK)
    block = activation_bytes(args, RECOMPUTE, compute_bytes=2, kernels="liger")[0].at(1, 4096)
    config = _embedding_update_config(batch=1, activation="recompute", where="host")
    assert config.training.max_norm > 0  # deferred: the reduced shard waits there for the norm
    host, gpu = (estimate_device_memory(
        _embedding_update_config(batch=1, activation="recompute", where=where), args,
        world=world, kernels="liger") for where in ("host", "gpu"))
    assert host.after_prefetch == 0 and gpu.gradients == host.gradients + 2 * shard
    assert dataclasses.replace(gpu, after_prefetch=0, gradients=host.gradients) == host
    # Then the activations of blocks 0-4, or at backward's end the embedding's gradient shard.
    assert gpu.after_prefetch == pytest.approx(
        state + max(host.activations - 31 * block, gpu.gradients), abs=2)
    backward_start = host.activations + host.logits
    if world == 1:
        assert gpu.total - host.total == gpu.after_prefetch - backward_start > 0
    else:
        assert gpu.after_prefetch < backward_start and gpu.total == host.total
    host, gpu = (estimate_device_memory(
        _embedding_update_config(batch=8, activation="keep", where=where), args, world=world,
        kernels="liger") for where in ("host", "gpu"))
    assert 0 < gpu.after_prefetch < gpu.activations and gpu.total == host.total


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_resident_optimizer_state_is_held_on_the_device_for_the_whole_run(max_norm):
    """slidedp.gpu_state_blocks = 18 with embedding_update = "resident" on Qwen3-4B, two ranks:
    the units' shards at 14 B/param (FP32 master and moments, BF16 copy) and the update's FP32
    and BF16 gradient piece are resident;
    deferred (clipping), the reduced shards (2 B/param) wait on the device for the norm; none of
    it streams."""
    args, world = get_flavor("qwen3-4B"), 2
    units = StateLayout(args, world=world).units
    shards = [units[i].padded // world for i in range(19)]  # the embedding, blocks 0-17
    config = _embedding_update_config(batch=2, activation="selective", where="host")
    config.training.max_norm = max_norm
    config.training.nonfinite = "skip" if max_norm else "off"  # not deferred without both
    host = estimate_device_memory(config, args, world=world, kernels="liger")
    config.slidedp = dataclasses.replace(config.slidedp, embedding_update="resident",
                                         gpu_state_blocks=18)
    gpu = estimate_device_memory(config, args, world=world, kernels="liger")
    assert gpu.resident - host.resident == 14 * sum(shards) + 6 * max(
        min(s, GPU_CHUNK) for s in shards)
    held = 2 * sum(shards) if max_norm else 0
    assert gpu.gradients - host.gradients == held and gpu.after_prefetch == 0
    assert gpu.total - host.total == gpu.resident - host.resident + max(
        0, gpu.gradients - max(host.gradients, host.activations + host.logits))
