"""The GPU-resident baselines' activation checkpointing (recipes/baselines/activation_checkpoint.py)
and DeepSpeed ZeRO-Offload (recipes/baselines/zero_offload.py): what backward replays under each
policy, the configuration DeepSpeed gets, the one-line refusals, and, where deepspeed is
installed, ZeRO-2 and ZeRO-3 on 2 CPU ranks against the single-process run. FSDP2 with each
policy and with CPU offload: tests/test_fsdp2.py."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from protocols.model_spec import get_flavor
from recipes.baselines.activation_checkpoint import apply_activation_checkpointing
from recipes.model import build_model

ARGS = get_flavor("qwen3-debug")


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str, args=ARGS) -> collections.Counter:
    """The aten ops that one backward runs (its replays included) with `mode`."""
    model = build_model(args, seed=0)
    apply_activation_checkpointing(model, mode=mode)
    tokens = torch.randint(args.vocab_size, (2, 16))
    loss = model.loss_sum(model(tokens), tokens)
    with _CountOps() as ops:
        loss.backward()
    return ops.counts


@pytest.mark.parametrize("family", ["qwen3-debug", "qwen2.5-debug"])
def test_what_backward_replays(family):
    """full replays every block's projections and its attention (all but down_proj, whose
    output backward does not need: the replay stops early); torchtitan's op-level policy only
    every second projection (k, o, up: addmm for Qwen2.5's biased k), no attention; none
    replays nothing."""
    args = get_flavor(family)
    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    counts = {mode: _backward_ops(mode, args) for mode in ("none", "full", "selective")}
    matmuls = {mode: c[mm] + c[addmm] for mode, c in counts.items()}
    blocks = args.n_layers
    assert matmuls["full"] - matmuls["none"] == 6 * blocks
    assert matmuls["selective"] - matmuls["none"] == 3 * blocks
    assert counts["selective"][addmm] == (blocks if args.qkv_bias else 0)
    assert counts["none"][sdpa] == counts["selective"][sdpa] == 0
    assert counts["full"][sdpa] == blocks


# ---- DeepSpeed ZeRO-Offload ----------------------------------------------------------------------

import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from recipes.baselines.zero_offload import deepspeed_config  # noqa: E402
from recipes.config import ConfigError, JobConfig  # noqa: E402
from recipes.preflight import check_run  # noqa: E402
from tests.conftest import REPO, ranks_fixture, subprocess_env  # noqa: E402
from tests.test_fsdp2 import BASE, make_config, single_reference, train  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def deepspeed_run(tmp_path, *flags: tuple[str, object]) -> JobConfig:
    config = JobConfig()
    config.parallelism.mode = "deepspeed"
    config.job.dump_folder = str(tmp_path)
    for key, value in flags:
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    return config


def test_deepspeed_config_is_zero_offload():
    config = make_config({**BASE, "parallelism.mode": "deepspeed", "deepspeed.zero_stage": 3,
                          "training.nonfinite": "off"})
    ds = deepspeed_config(config, world=2)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 2 * 2 * 2
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}


def test_deepspeed_refusals(tmp_path, monkeypatch):
    """One line each, before anything is built: the package missing, saves, a mode's option in
    another mode."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'^parallelism.mode = "deepspeed" needs the deepspeed '
                                          r"package .*pip install deepspeed==0\.19\.8"):
        check_run(deepspeed_run(tmp_path), world=1, device=torch.device("cpu"), thorough=True)
    monkeypatch.delitem(sys.modules, "deepspeed")
    if HAS_DEEPSPEED:
        with pytest.raises(ConfigError, match="^checkpoint.save_dir: not supported"):
            check_run(deepspeed_run(tmp_path, ("checkpoint.save_dir", str(tmp_path / "ck"))),
                      world=1, device=torch.device("cpu"), thorough=True)
    config = deepspeed_run(tmp_path, ("parallelism.mode", "slidedp"),
                           ("parallelism.fsdp_cpu_offload", True))
    with pytest.raises(ConfigError, match='^parallelism.fsdp_cpu_offload applies to .*"fsdp2"'):
        check_run(config, world=1, device=torch.device("cpu"), thorough=True)


def deepspeed_rank(rank: int, world: int, overrides: dict) -> dict:
    from recipes.baselines.zero_offload import build_deepspeed_backend

    config = make_config(overrides)
    backend = build_deepspeed_backend(config, ARGS, device=torch.device("cpu"))
    optimizer = type(backend.engine.optimizer.optimizer).__name__
    return {"optimizer": optimizer, **train(backend, config, dp_rank=rank, dp_world=world)}


def zero_offload_overrides(stage: int) -> dict:
    return {**BASE, "parallelism.mode": "deepspeed", "deepspeed.zero_stage": stage,
            "deepspeed.cpu_threads": 1, "deepspeed.pin_memory": False,
            "activation_checkpoint.mode": "full"}


# Both stages' runs, by the test's name: one launch of two ranks.
deepspeed_runs = ranks_fixture({
    f"test_deepspeed_zero_offload_matches_single_process[{stage}]": (
        deepspeed_rank, (zero_offload_overrides(stage),)) for stage in (2, 3)}, world=2)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install '.[deepspeed]')")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_offload_matches_single_process(request, deepspeed_runs, stage):
    """ZeRO-2 / ZeRO-3 with DeepSpeedCPUAdam on 2 CPU ranks (DeepSpeed's CPU accelerator) give
    the single-process BF16 run's losses and pre-clip norms, within BF16 rounding: the loss
    scaling undoes DeepSpeed's averaging over ranks and micro-batches."""
    overrides = zero_offload_overrides(stage)
    ranks = deepspeed_runs[request.node.name]
    ref = single_reference({**overrides, "parallelism.mode": "single"})
    got = ranks[0]
    assert got["optimizer"] == "DeepSpeedCPUAdam"
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-2)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=3e-2)
    assert ranks[1]["losses"] == got["losses"]
    diff = torch.cat([(got["weights"][n] - w).abs().flatten() for n, w in ref["weights"].items()])
    assert diff.max() <= BASE["optimizer.lr"] * BASE["training.steps"]
    assert diff.mean() <= 2e-4


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install '.[deepspeed]')")
def test_one_rank_deepspeed_bench_runs_without_a_launcher(tmp_path):
    """The bench on one rank makes its own process group, with no launcher's environment (as the
    suites launch it on one GPU); DeepSpeed's engine needs LOCAL_RANK, and an engine a batch is
    built and closed in one process. Every row trains: finite loss and norm, nothing skipped."""
    env = {k: v for k, v in subprocess_env().items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = tmp_path / "runs.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.bench.throughput", "--parallelism.mode=deepspeed",
         "--deepspeed.zero_stage=2", "--model.flavor=qwen3-debug", "--model.kernels=torch",
         "--training.seq_len=32", "--training.max_norm=1.0", "--training.steps=2",
         "--bench.warmup=0", "--bench.batches", "1", "2", f"--bench.out={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["local_batch"] for r in rows] == [1, 2]
    assert all(r["valid"] and len(r["loss"]) == 2 and not any(r["skipped"]) for r in rows)
    assert all(math.isfinite(x) for r in rows for x in r["loss"] + r["grad_norm"])

def test_memory_estimate_of_the_offloading_baselines():
    """FSDP2's CPU offload keeps the sharded 16 B/param off the GPU; ZeRO-Offload keeps BF16
    weights and gradients there (ZeRO-2: all of them, ZeRO-3: a shard), and the host check
    counts what they offload."""
    from recipes.preflight import check_host_memory, device_memory

    args, world = get_flavor("qwen3-8B"), 2
    n = args.num_params()

    def estimate(**overrides):
        return device_memory(make_config({"training.seq_len": 4096, **overrides}), args,
                             world=world, kernels="liger")

    plain, offload = estimate(**{"parallelism.mode": "fsdp2"}), estimate(
        **{"parallelism.mode": "fsdp2", "parallelism.fsdp_cpu_offload": True})
    assert plain.resident - offload.resident == pytest.approx(n * 12 / world, abs=1)
    assert plain.gradients - offload.gradients == pytest.approx(n * 4 / world, abs=1)
    zero2 = estimate(**{"parallelism.mode": "deepspeed", "deepspeed.zero_stage": 2})
    zero3 = estimate(**{"parallelism.mode": "deepspeed", "deepspeed.zero_stage": 3})
    assert zero2.resident == zero2.gradients == 2 * n
    assert zero3.resident < zero2.resident and zero3.gradients < zero2.gradients
    config = make_config({"parallelism.mode": "deepspeed"})
    need = 4 * n + 16 * n // world  # the FP32 model each rank builds + its offloaded shard
    check_host_memory(config, args, world=world, on_cpu=False, available=0,
                      total=int(world * need * 1.09))
    with pytest.raises(ConfigError, match="^host memory: 2 rank"):
        check_host_memory(config, args, world=world, on_cpu=False, available=0,
                          total=int(world * need / 1.11))
