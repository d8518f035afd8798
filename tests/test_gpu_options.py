"""The GPU correctness stage (recipes/bench/suite.py runs it before anything it measures): every
SlideDP option the docs measure, on a model of real width deeper than the embedding update's
prefetch point, trains as `single` does on the same GPU, from the same init on the same batches:
per-step losses and gradient norms within BF16 tolerance and the final master weights within
Adam's per-step move. The options are override sets of [slidedp] over one base, as torchtitan's
integration tests list features. GPU only (run on the GPU machine)."""

from dataclasses import dataclass, field, replace
from functools import cache

import pytest
import torch

from models.rope import RopeScaling
from protocols.model_spec import get_flavor
from recipes.parallelize import build_backend
from tests.slidedp_worker import global_batches, make_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU (run on the GPU machine)")

DEVICE, STEPS, LR, BATCH, SEQ = "cuda:0", 4, 1e-3, 2, 1024
# Qwen3-0.6B's width (1024; a tied embedding of 156M parameters, three GPU chunks) with 6 blocks,
# more than the embedding update's prefetch point (slidedp/gpu_update.py PREFETCH_AT_BLOCK): small
# enough that every option builds in seconds, for a stage that runs first in every call.
# tests/test_gpu_update.py checks the embedding update at the 4B and 7B widths.
FLAVOR, LAYERS = "qwen3-0.6B", 6
SEG5 = "segments(qkv+attention_core+o_proj+mlp_up+down_proj)"


@dataclass(frozen=True)
class Option:
    """One SlideDP setting: [slidedp] overrides and what the model or step changes with it."""

    name: str
    slidedp: dict = field(default_factory=dict)
    max_norm: float = 1.0
    kernels: str = "liger"
    yarn: bool = False
    """YaRN x8 over 512 original positions, so that the 1,024-token batches reach past them."""
    bf16_master: bool = False
    """The runtime keeps BF16 master weights (MegaTrain's style): looser weight bounds."""
    max_lr_per_step: float = 2.0
    """How far one step may move the weight that differs most, in lr (the typical element is held
    to the mean bound either way)."""


OPTIONS = [
    Option("base"),  # sharded delivery, GPU reduction, recompute, the host embedding update
    Option("no-clipping", max_norm=0.0),
    Option("replicated-gpu", {"delivery": "replicated"}),
    Option("sharded-cpu", {"reduction": "cpu"}),
    Option("replicated-cpu", {"delivery": "replicated", "reduction": "cpu"}),
    Option("locked", {"reduction": "locked"}),
    Option("no-bf16-shadow", {"bf16_shadow": False}),
    Option("embedding-gpu", {"embedding_update": "gpu"}),
    Option("embedding-gpu-no-clipping", {"embedding_update": "gpu"}, max_norm=0.0),
    Option("keep", {"activation": "keep"}),
    Option("selective", {"activation": "selective"}),
    Option("segments", {"activation": SEG5}),
    Option("ops", {"activation": "ops(matmul+attention)"}),
    Option("offload", {"activation": "selective@offload=0.5",
                       "activation_blocks": "5:keep@offload=1"}),
    Option("keep-selective-mix-gpu-embedding",
           {"keep_blocks": 2, "activation": "selective", "embedding_update": "gpu",
            "window_slots": 2}),
    Option("resident-state", {"embedding_update": "resident", "gpu_state_blocks": 3,
                              "update_order": "next_use"}),
    # Part of the state resident beside offloaded and replayed activations, as the step-time
    # model's choices run them (recipes/reproduce/common.py PLANNED).
    Option("resident-state-offload-mix", {"activation": "ops(matmul+attention)@offload=1.0",
                                          "activation_blocks": "4-5:selective",
                                          "embedding_update": "resident", "gpu_state_blocks": 3,
                                          "update_order": "next_use", "window_slots": 2}),
    # Every unit resident: the norm and clipping are taken on the GPU (gpu_update.device_clip).
    Option("all-resident", {"embedding_update": "resident", "gpu_state_blocks": LAYERS,
                            "update_order": "next_use"}),
    Option("resident-state-no-clipping", {"embedding_update": "resident", "gpu_state_blocks": 6},
           max_norm=0.0),
    # BF16 moments on the host, the embedding's streamed to the GPU and rounded home each step.
    Option("bf16-moments", {"moments_dtype": "bfloat16", "embedding_update": "gpu"}),
    # Every unit resident with BF16 moments, which stay BF16 on the GPU.
    Option("all-resident-bf16-moments", {"embedding_update": "resident", "gpu_state_blocks": LAYERS,
                                         "update_order": "next_use", "moments_dtype": "bfloat16"}),
    # 8-bit moments, every thread pinned to a core. A small element's exp_avg_sq can code below its
    # value (the dynamic-tree table's low codes are far apart, its lowest is 0), so its step
    # m / sqrt(v) can exceed the 1 of exact moments: a few elements move several lr a step.
    Option("8bit-moments-pinned", {"moments_dtype": "8bit", "pin_threads": True}, max_lr_per_step=16.0),
    # Speculative updates: each unit's update as its gradient comes home, redone scaled once the
    # norm says it clips.
    Option("speculative", {"speculative_update": True}),
    Option("next-use", {"update_order": "next_use"}),
    Option("slideformer", {"runtime": "slideformer"}),
    Option("megatrain", {"runtime": "megatrain"}, bf16_master=True),
    Option("yarn", yarn=True),
    Option("torch-kernels", kernels="torch"),
]


def _args(yarn: bool):
    args = replace(get_flavor(FLAVOR), n_layers=LAYERS)
    return replace(args, rope_scaling=RopeScaling("yarn", 8.0, 512)) if yarn else args


def _run(option: Option, mode: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(losses, gradient norms, final master weights on the host) of STEPS steps in `mode`."""
    device = torch.device(DEVICE)
    cfg = make_config({**option.slidedp, "nonfinite": "skip" if option.max_norm else "off"},
                      accum=1, max_norm=option.max_norm, kernels=option.kernels, batch=BATCH,
                      seq=SEQ)
    cfg.training.loss_chunk_tokens = 1024
    cfg.parallelism.mode = mode
    args = _args(option.yarn)
    backend = build_backend(cfg, args, device=device, dp_rank=0, dp_world=1)
    losses, norms = [], []
    try:
        for micro in global_batches(steps=STEPS, accum=1, batch=BATCH, seq=SEQ,
                                    vocab=args.vocab_size, seed=11):
            n = sum(int((y != -100).sum()) for _, y in micro)
            out = backend.train_step(micro, lr=LR, global_target_tokens=n)
            losses.append(out.loss_sum / n)
            norms.append(out.grad_norm)
        weights = {k: t.detach().to("cpu", copy=True) for k, t in
                   backend.named_master_parameters()}
    finally:
        backend.close()
        del backend
        torch.cuda.empty_cache()
    return losses, norms, weights


@cache
def _single(max_norm: float, kernels: str, yarn: bool):
    return _run(Option("single", max_norm=max_norm, kernels=kernels, yarn=yarn), "single")


@pytest.mark.parametrize("option", OPTIONS, ids=[o.name for o in OPTIONS])
def test_option_trains_as_single_on_the_gpu(option: Option):
    ref_losses, ref_norms, ref_weights = _single(option.max_norm, option.kernels, option.yarn)
    losses, norms, weights = _run(option, "slidedp")
    print(f"{option.name}: losses {losses}, norms {norms}; single {ref_losses}, {ref_norms}")
    assert torch.isfinite(torch.tensor(losses + norms)).all(), (losses, norms)
    assert losses == pytest.approx(ref_losses, rel=1e-2), (losses, ref_losses)
    assert norms == pytest.approx(ref_norms, rel=5e-2), (norms, ref_norms)
    if option.max_norm:  # the clipping path ran (the norm falls below 1 as the loss does)
        assert ref_norms[0] > option.max_norm
    assert set(weights) == set(ref_weights)
    diff = torch.cat([(weights[k].float() - w).abs().flatten() for k, w in ref_weights.items()])
    # Adam moves a weight by about lr a step whatever its gradient, so a near-zero gradient whose
    # BF16 rounding differs may move it the other way: up to 2 lr a step anywhere. The typical
    # element must agree far closer: a lost, doubled or misplaced update moves it by ~lr a step.
    # BF16 masters add half an ulp a step.
    print(f"{option.name}: weight diff max {diff.max():.3g} mean {diff.mean():.3g}")
    ulp = max(float(w.abs().max()) for w in ref_weights.values()) * 2.0**-9 \
        if option.bf16_master else 0.0
    assert diff.max() <= STEPS * (option.max_lr_per_step * LR + ulp), diff.max()
    assert diff.mean() <= (0.5 if option.bf16_master else 0.1) * STEPS * LR, diff.mean()

