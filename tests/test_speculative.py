"""Speculative updates (slidedp.speculative_update, slidedp/speculative.py): bit for bit the
deferred updates, whether the norm clips or not, with the redo counted per step; refused where
they cannot serve; their host regions. The two-rank runs: tests/test_slidedp.py (the clipping
case) and tests/test_nonfinite.py (a skipped step undone)."""

import pytest
import torch

from protocols.model_spec import get_flavor
from recipes.config import run_config
from slidedp.config import SlideDPConfig
from slidedp.host_state import HostStatePlan, host_state_bytes
from slidedp.layout import StateLayout
from tests.slidedp_worker import global_batches, make_config

ARGS = get_flavor("qwen3-debug")


def _train(variant: dict, *, max_norm: float, steps: int = 4):
    from slidedp.engine import SlideDPBackend

    backend = SlideDPBackend(run_config(make_config(variant, accum=1, max_norm=max_norm)), ARGS,
                             device=torch.device("cpu"), dp_rank=0, dp_world=1)
    results = []
    try:
        for micro in global_batches(steps=steps, accum=1, batch=2, seq=16, vocab=ARGS.vocab_size, seed=3):
            n = sum(int((y != -100).sum()) for _, y in micro)
            results.append(backend.train_step(micro, lr=1e-3, global_target_tokens=n))
        weights = {k: t.detach().clone() for k, t in backend.named_master_parameters()}
    finally:
        backend.close()
    return results, weights


def test_speculative_updates_are_the_deferred_ones_bit_for_bit():
    """max_norm 4.1 sits among this run's gradient norms (4.47, 4.21, 3.72, 4.01), so two steps
    clip (their updates redone scaled) and two do not (the speculative ones stand)."""
    deferred, want = _train({}, max_norm=4.1)
    speculative, got = _train({"speculative_update": True}, max_norm=4.1)
    assert [r.loss_sum for r in speculative] == [r.loss_sum for r in deferred]
    assert [r.grad_norm for r in speculative] == [r.grad_norm for r in deferred]
    assert all(torch.equal(got[k], want[k]) for k in want)
    redone = [r.extra["speculative_redo"] for r in speculative]
    assert redone == [float(r.grad_norm + 1e-6 > 4.1) for r in deferred]
    assert 0 < sum(redone) < len(redone)  # both outcomes ran
    assert all("speculative_redo" not in r.extra for r in deferred)


@pytest.mark.parametrize("change,accum", [({"reduction": "cpu"}, 1), ({}, 2),
                                          ({"gpu_state_blocks": 1}, 1),
                                          ({"runtime": "slideformer"}, 1)])
def test_refused_before_anything_is_allocated(change, accum):
    from recipes.config import ConfigError
    from recipes.preflight import check_mode_options
    from slidedp.engine import SlideDPBackend

    cfg = make_config({"speculative_update": True, **change}, accum=accum, max_norm=1.0)
    cfg.parallelism.mode = "slidedp"
    with pytest.raises(ConfigError, match="speculative_update needs"):
        check_mode_options(cfg, ARGS, world=1)
    with pytest.raises(ValueError, match="speculative_update needs"):
        SlideDPBackend(run_config(cfg), ARGS, device=torch.device("cpu"), dp_rank=0, dp_world=1)


def test_its_host_regions():
    """The optimizer state once more and the BF16 gradient beside the shadow: 14 + 12 + 2 = 28
    B/param with FP32 moments; nothing when the updates are not deferred."""
    big = get_flavor("qwen3-8B")
    layout = StateLayout(big, world=1)
    on = SlideDPConfig(speculative_update=True)
    clipped = HostStatePlan.for_run(on, grad_accum_steps=1, max_norm=1.0, nonfinite="off")
    assert clipped.redo and clipped.grad_bf16
    assert host_state_bytes(layout, clipped) / big.num_params() == pytest.approx(28, abs=0.01)
    free = HostStatePlan.for_run(on, grad_accum_steps=1, max_norm=0.0, nonfinite="off")
    assert not free.redo
    bf16 = HostStatePlan.for_run(SlideDPConfig(speculative_update=True, moments_dtype="bfloat16"),
                                 grad_accum_steps=1, max_norm=1.0, nonfinite="off")
    assert host_state_bytes(layout, bf16) / big.num_params() == pytest.approx(20, abs=0.01)
