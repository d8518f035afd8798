"""FSDP2 on 2 real ranks (gloo, CPU) equals the single-process run on the same global batch:
per-step losses, pre-clip gradient norms (which expose any division of the gradient by the
world size, to which Adam itself is blind) and final weights."""

import math
import os

import pytest
import torch

from protocols.model_spec import get_flavor
from recipes.config import JobConfig
from recipes.baselines.eager import build_fsdp2_backend, build_single_backend
from recipes.batches import build_batches
from recipes.loop import build_lr_schedule, train_steps
from recipes.model import build_model
from tests.conftest import REPO, ranks_fixture

ARGS = get_flavor("qwen3-debug")
TINY = os.path.join(REPO, "tests", "assets", "tiny")
WORLD = 2

# Chat data: only assistant tokens are targets, so ranks hold different target counts and the
# normalization by the global count is exercised. Clipping is on (the norm starts near 3).
BASE = {
    "training.dataset": "files", "training.dataset_path": os.path.join(TINY, "chat.jsonl"),
    "model.tokenizer_dir": TINY, "training.steps": 4, "training.seq_len": 64,
    "training.local_batch_size": 2, "training.grad_accum_steps": 2, "training.max_norm": 1.0,
    "optimizer.lr": 3e-3, "lr_scheduler.warmup_steps": 1,
}


def make_config(overrides: dict) -> JobConfig:
    config = JobConfig()
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    return config


def train(backend, config: JobConfig, *, dp_rank: int, dp_world: int) -> dict:
    batches = build_batches(config, ARGS, dp_rank=dp_rank, dp_world=dp_world)
    outs = list(train_steps(backend, batches, build_lr_schedule(config),
                            steps=config.training.steps,
                            grad_accum_steps=config.training.grad_accum_steps,
                            device=torch.device("cpu")))
    weights = {n: t.clone() for n, t in backend.named_master_parameters()}
    backend.close()
    return {"losses": [o.loss for o in outs], "grad_norms": [o.result.grad_norm for o in outs],
            "weights": weights}


def fsdp2_rank(rank: int, world: int, overrides: dict) -> dict:
    config = make_config(overrides)
    backend = build_fsdp2_backend(config, ARGS, device=torch.device("cpu"))
    return train(backend, config, dp_rank=rank, dp_world=world)


def single_reference(overrides: dict) -> dict:
    """The same global batch in one process: local batch x WORLD."""
    batch = overrides["training.local_batch_size"] * WORLD
    config = make_config({**overrides, "training.local_batch_size": batch})
    backend = build_single_backend(config, ARGS, device=torch.device("cpu"))
    return train(backend, config, dp_rank=0, dp_world=1)


# dtype, activation checkpointing, and how closely each matches `single`.
MATCHES = {
    "fp32-none": ("fp32", "none", 1e-5, 1e-7),
    # BF16: FSDP2 casts parameters (MixedPrecisionPolicy), single autocasts matmuls only, so
    # they round differently.
    "bf16-full": ("bf16", "full", 2e-2, 1e-4),
}


def matches_overrides(dtype: str, ac: str) -> dict:
    return {**BASE, "training.dtype": dtype, "activation_checkpoint.mode": ac}


@pytest.mark.parametrize("run", MATCHES)
def test_fsdp2_matches_single_process(request, fsdp2_runs, run):
    dtype, ac, rtol, mean_weight_diff = MATCHES[run]
    ranks = fsdp2_runs[request.node.name]
    ref = single_reference(matches_overrides(dtype, ac))
    got = ranks[0]
    assert got["losses"] == pytest.approx(ref["losses"], rel=rtol)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=rtol)
    assert ref["grad_norms"][0] > BASE["training.max_norm"]  # clipping did act
    assert ranks[1]["losses"] == got["losses"]  # every rank reports the global loss
    assert set(got["weights"]) == set(ref["weights"])
    diff = torch.cat([(got["weights"][n] - w).abs().flatten() for n, w in ref["weights"].items()])
    # Adam moves a weight by up to lr per step whatever its gradient's size, so summation-order
    # noise on a near-zero gradient may move a few elements that far; the typical one must agree.
    assert diff.max() <= BASE["optimizer.lr"] * BASE["training.steps"]
    assert diff.mean() <= mean_weight_diff


def fsdp2_meta_init_rank(rank: int, world: int) -> dict:
    config = make_config({"parallelism.mode": "fsdp2", "training.init_on_meta": True,
                          "training.steps": 1, "training.seq_len": 32,
                          "training.local_batch_size": 2, "training.dtype": "fp32"})
    backend = build_fsdp2_backend(config, ARGS, device=torch.device("cpu"))
    initial = {n: t.clone() for n, t in backend.named_master_parameters()}
    return {"initial": initial, **train(backend, config, dp_rank=rank, dp_world=world)}


def test_fsdp2_init_on_meta_equals_cpu_init(request, fsdp2_runs):
    result = fsdp2_runs[request.node.name][0]
    reference = dict(build_model(ARGS, seed=JobConfig().training.seed).named_parameters())
    assert set(result["initial"]) == set(reference)
    for name, value in result["initial"].items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
    # Random init predicts uniform guesses: loss ln(vocab).
    assert result["losses"][0] == pytest.approx(math.log(ARGS.vocab_size), abs=0.1)


def fsdp2_variants_rank(rank: int, world: int, variants: list[dict]) -> list[dict]:
    return [fsdp2_rank(rank, world, overrides) for overrides in variants]


_FP32, _BF16 = {**BASE, "training.dtype": "fp32"}, {**BASE, "training.dtype": "bf16"}
# Each test's FSDP2 runs, by the test's name: all in one pair of processes.
fsdp2_runs = ranks_fixture({
    **{f"test_fsdp2_matches_single_process[{run}]": (fsdp2_rank, (matches_overrides(*m[:2]),))
       for run, m in MATCHES.items()},
    "test_fsdp2_init_on_meta_equals_cpu_init": (fsdp2_meta_init_rank, ()),
    "test_fsdp2_selective_checkpointing_and_cpu_offload_match_the_plain_run": (
        fsdp2_variants_rank, ([_FP32, {**_FP32, "activation_checkpoint.mode": "selective"},
                               {**_FP32, "parallelism.fsdp_cpu_offload": True},
                               _BF16, {**_BF16, "activation_checkpoint.mode": "selective"}],)),
}, world=WORLD)


def test_fsdp2_selective_checkpointing_and_cpu_offload_match_the_plain_run(request, fsdp2_runs):
    """torchtitan's op-level selective checkpointing recomputes exactly what forward computed
    (FP32, and BF16 with its casts), and CPUOffloadPolicy moves the same shards through host
    memory: each gives the plain run's losses, norms and weights."""
    runs = fsdp2_runs[request.node.name][0]
    for plain, variant in ((runs[0], runs[1]), (runs[0], runs[2]), (runs[3], runs[4])):
        assert variant["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        assert variant["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-6)
        for name, weight in plain["weights"].items():
            torch.testing.assert_close(variant["weights"][name], weight, rtol=1e-6, atol=1e-7,
                                       msg=name)
