"""A step whose loss or gradient is NaN/Inf skips its update in every mode (training.nonfinite).

Injected with a forward hook on every RMSNorm (a module call in every mode; SlideDP runs a block
as its segments, not as one module call): "loss" makes the norms' outputs NaN (loss and gradient
are NaN), "grad" leaves the forward alone and makes the gradient flowing back through them NaN
(the loss stays finite). The poisoned step must leave the FP32 weights and
both Adam moments bit for bit as they were, and the run must then go on exactly as a run that
never took that step (with the later steps' own learning rates). Through the CLI, a learning
rate of 1e30 makes the debug model diverge for real: its gradient norm is NaN from step 2 on.
"""

import json
import subprocess
from functools import partial

import pytest
import torch
from safetensors import safe_open

from models.qwen.model import RMSNorm
from protocols.model_spec import get_flavor
from recipes.checkpoint import TRAIN_STATE
from recipes.config import run_config
from recipes.nonfinite import NonFinitePolicy, NonFiniteStop
from recipes.baselines.eager import _create_adam_state, build_fsdp2_backend, build_single_backend
from tests.conftest import ranks_fixture
from tests.slidedp_worker import global_batches, make_config
from tests.test_resume import train_state
from tests.test_train_cli import launch

ARGS = get_flavor("qwen3-debug")
LRS = [1e-3, 2e-3, 3e-3, 2e-3]
POISONED = 2  # the third step
_poison: list[str | None] = [None]


class _NaNGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _poison_norms(module, args, output):
    if _poison[0] is None or not isinstance(module, RMSNorm):
        return None
    return output * float("nan") if _poison[0] == "loss" else _NaNGradient.apply(output)


def _eager_state(backend) -> dict[str, torch.Tensor]:
    """Full FP32 weights, Adam moments and step counts (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(backend.model, backend.optimizer)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.clone()  # noqa: E731
    state = {f"model.{k}": full(v) for k, v in model.items()}
    for name, moments in optim["state"].items():
        state.update({f"optim.{name}.{k}": full(v) for k, v in moments.items()})
    return state


def _slidedp_state(backend) -> dict[str, torch.Tensor]:
    dict(backend.named_master_parameters())  # waits for every rank's pending updates
    # The shadow too: a skipped step's gradients waited in it, and the weights must come back.
    return {r: getattr(backend.state, r).clone()
            for r in ("master", "exp_avg", "exp_avg_sq", "shadow") if r in backend.state.regions}


def _build(mode: str, variant: dict, *, accum: int, max_norm: float, rank: int, world: int):
    config = make_config(variant, accum=accum, max_norm=max_norm)
    if mode == "slidedp":
        from slidedp.engine import SlideDPBackend

        return (SlideDPBackend(run_config(config), ARGS, device=torch.device("cpu"), dp_rank=rank,
                               dp_world=world), _slidedp_state)
    build = build_single_backend if mode == "single" else build_fsdp2_backend
    return build(config, ARGS, device=torch.device("cpu")), _eager_state


def _run(mode: str, variant: dict, *, accum: int, max_norm: float, rank: int, world: int,
         poison: str | None) -> dict:
    """Steps 0..3 with step POISONED poisoned, or (poison None) the same without that step."""
    backend, state_of = _build(mode, variant, accum=accum, max_norm=max_norm, rank=rank,
                               world=world)
    data = global_batches(steps=len(LRS), accum=accum, batch=2 * world, seq=16,
                          vocab=ARGS.vocab_size, seed=7)
    out = {"skipped": [], "losses": [], "norms": []}
    for i, (micro, lr) in enumerate(zip(data, LRS)):
        if i == POISONED and poison is None:
            continue
        ntok = sum(int((y != -100).sum()) for _, y in micro)
        mine = [(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]) for x, y in micro]
        if i == POISONED:
            out["before"] = state_of(backend)
            _poison[0] = poison
        try:
            result = backend.train_step(mine, lr=lr, global_target_tokens=ntok)
        finally:
            _poison[0] = None
        if i == POISONED:
            out["after"] = state_of(backend)
        out["skipped"].append(result.skipped)
        out["losses"].append(result.loss_sum / ntok)
        out["norms"].append(result.grad_norm)
    out["final"] = state_of(backend)
    if mode == "slidedp":
        out["adam_steps"] = backend.adam_steps
    backend.close()
    return out


def _compare(rank: int, world: int, mode: str, variant: dict, accum: int, max_norm: float,
             poison: str, *, reference: bool = True) -> dict:
    """The poisoned run and, unless `reference` is false, the run without that step."""
    handle = torch.nn.modules.module.register_module_forward_hook(_poison_norms)
    try:
        kw = dict(accum=accum, max_norm=max_norm, rank=rank, world=world)
        runs = {"poisoned": _run(mode, variant, poison=poison, **kw)}
        if reference:
            runs["reference"] = _run(mode, variant, poison=None, **kw)
        return runs
    finally:
        handle.remove()


def assert_skipped_exactly(poisoned: dict, reference: dict, *, poison: str) -> None:
    assert poisoned["skipped"] == [False, False, True, False]
    assert reference["skipped"] == [False, False, False]
    loss, norm = poisoned["losses"][POISONED], poisoned["norms"][POISONED]
    assert torch.isnan(torch.tensor(norm))
    assert torch.isnan(torch.tensor(loss)) if poison == "loss" else loss == loss
    for key, before in poisoned["before"].items():  # nothing moved
        assert torch.equal(poisoned["after"][key], before), key
    for key, value in reference["final"].items():  # and the run went on as if never poisoned
        assert torch.equal(poisoned["final"][key], value), key
    kept = [x for i, x in enumerate(poisoned["losses"]) if i != POISONED]
    assert kept == reference["losses"]


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_single_skips_a_nonfinite_step_exactly(poison):
    result = _compare(0, 1, "single", {}, 1, 1.0, poison)
    assert_skipped_exactly(result["poisoned"], result["reference"], poison=poison)
    # Adam's step count did not advance on the skipped step.
    steps = {k: v for k, v in result["poisoned"]["final"].items() if k.endswith(".step")}
    assert steps and all(int(v) == 3 for v in steps.values())


_ALL_RESIDENT = {"reduction": "gpu", "embedding_update": "resident",
                 "gpu_state_blocks": ARGS.n_layers}
# Every way SlideDP updates: the guard's deferred updates without clipping (both routes), the
# clipped ones (their gradients waiting in the shadow, or without one in the BF16 buffer), with
# accumulation, every unit's update on the device; and "off", which updates during backward.
SLIDEDP_CASES = {"gpu": ({"reduction": "gpu"}, 1, 0.0, "loss"),
                 "cpu": ({"reduction": "cpu", "delivery": "replicated"}, 1, 0.0, "grad"),
                 "gpu-clip": ({"reduction": "gpu"}, 1, 0.05, "grad"),
                 "gpu-clip-no-shadow": ({"reduction": "gpu", "bf16_shadow": False}, 1, 0.05,
                                        "loss"),
                 "cpu-accum": ({"reduction": "cpu"}, 2, 0.0, "loss"),
                 # Speculative updates: undone on the skipped step, standing (guard) or redone
                 # scaled (clipping) on the others.
                 "gpu-speculative": ({"reduction": "gpu", "speculative_update": True}, 1, 0.0, "grad"),
                 "gpu-clip-speculative": ({"reduction": "gpu", "speculative_update": True}, 1, 0.05,
                                          "loss"),
                 # Every unit's state on the device: found_inf skips the fused AdamW there.
                 "resident-clip": (_ALL_RESIDENT, 1, 0.05, "grad"),
                 "resident-guard": (_ALL_RESIDENT, 1, 0.0, "loss")}
# Each two-rank test's comparison, by the test's name: all in one launch of two ranks.
two_ranks = ranks_fixture({
    "test_fsdp2_skips_a_nonfinite_step_exactly": (_compare, ("fsdp2", {}, 2, 0.0, "grad")),
    **{f"test_slidedp_skips_a_nonfinite_step_exactly[{name}]": (_compare, ("slidedp", *case))
       for name, case in SLIDEDP_CASES.items()},
    "test_slidedp_without_the_guard_updates_during_backward": (
        partial(_compare, reference=False), ("slidedp", {"nonfinite": "off"}, 1, 0.0, "grad")),
}, world=2)


def test_fsdp2_skips_a_nonfinite_step_exactly(request, two_ranks):
    result = two_ranks[request.node.name][0]
    assert_skipped_exactly(result["poisoned"], result["reference"], poison="grad")


@pytest.mark.parametrize("case", SLIDEDP_CASES)
def test_slidedp_skips_a_nonfinite_step_exactly(request, two_ranks, case):
    result = two_ranks[request.node.name][0]
    poison = SLIDEDP_CASES[case][-1]
    assert_skipped_exactly(result["poisoned"], result["reference"], poison=poison)
    assert result["poisoned"]["adam_steps"] == result["reference"]["adam_steps"] == 3


def test_slidedp_without_the_guard_updates_during_backward(request, two_ranks):
    """"off": nothing is checked, nothing waits for the norm: the poisoned update goes in."""
    poisoned = two_ranks[request.node.name][0]["poisoned"]
    assert poisoned["skipped"] == [False] * 4
    assert torch.isnan(poisoned["after"]["master"]).any()


def test_precreated_adam_state_changes_nothing():
    """_create_adam_state leaves the weights bit for bit and the run identical to one whose
    optimizer creates its state at the first step."""
    config = make_config({}, accum=1, max_norm=1.0)
    runs = []
    for precreate in (False, True):
        backend = build_single_backend(config, ARGS, device=torch.device("cpu"))
        if not precreate:  # undo what the backend did at construction
            backend.optimizer.state.clear()
        else:
            weights = {k: v.clone() for k, v in backend.model.state_dict().items()}
            _create_adam_state(backend.optimizer)
            assert all(torch.equal(v, weights[k]) for k, v in backend.model.state_dict().items())
        x = torch.randint(0, ARGS.vocab_size, (2, 16))
        for lr in LRS:
            backend.train_step([(x, x)], lr=lr, global_target_tokens=x.numel())
        runs.append(_eager_state(backend))
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_policy_counts_in_a_row_and_in_total():
    consecutive = NonFinitePolicy("stop_consecutive", limit=2, log=False)
    for step, skipped in enumerate([True, False, True, False], start=1):
        consecutive.observe(step, skipped=skipped, loss=1.0, grad_norm=float("nan"))
    with pytest.raises(NonFiniteStop, match="2 steps in a row"):
        consecutive.observe(6, skipped=True, loss=1.0, grad_norm=float("inf"))
        consecutive.observe(7, skipped=True, loss=1.0, grad_norm=float("inf"))
    total = NonFinitePolicy("stop_total", limit=3, log=False)
    for step, skipped in enumerate([True, False, True, False], start=1):
        total.observe(step, skipped=skipped, loss=1.0, grad_norm=float("nan"))
    with pytest.raises(NonFiniteStop, match=r"3 steps in total.*after step 5"):
        total.observe(5, skipped=True, loss=float("nan"), grad_norm=float("nan"))
    forever = NonFinitePolicy("skip", limit=1, log=False)
    for step in range(1, 10):
        forever.observe(step, skipped=True, loss=1.0, grad_norm=float("nan"))


DIVERGE = ["--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0", "--metrics.log_freq=1",
           "--training.seq_len=32"]


def _cli(out, *flags: str, ngpu: int = 1) -> subprocess.CompletedProcess:
    return launch(f"--job.dump_folder={out}", *DIVERGE, *flags, ngpu=ngpu)


def _records(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_diverging_run_stops_after_n_skipped_steps_in_a_row(tmp_path):
    proc = _cli(tmp_path, "--training.steps=20", "--checkpoint.save_dir=",
                "--training.nonfinite=stop_consecutive", "--training.max_nonfinite_steps=2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: training.nonfinite = 'stop_consecutive': 2 steps in a row had a "
                      "non-finite loss or gradient norm (training.max_nonfinite_steps = 2); "
                      "stopped after step 3, the weights are those of the last finite step"]
    records = _records(tmp_path)
    assert [r["update_skipped"] for r in records] == [False, True, True]
    assert "update skipped" in proc.stderr


@pytest.mark.parametrize("mode", ["single", "slidedp"])
def test_skipped_steps_leave_the_saved_state_as_it_was(tmp_path, mode):
    """"skip" goes on to the end; every step after the first diverged, so the final save holds
    exactly the weights and Adam state of step 1's save."""
    flags = ["--training.steps=4", "--training.nonfinite=skip", "--checkpoint.interval=1",
             f"--checkpoint.save_dir={tmp_path}/hf", "--checkpoint.keep_latest_k=0"]
    if mode == "slidedp":
        flags += ["--parallelism.mode=slidedp", "--training.local_batch_size=4"]
    proc = _cli(tmp_path, *flags, ngpu=2 if mode == "slidedp" else 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["update_skipped"] for r in _records(tmp_path)] == [False, True, True, True]
    first, last = (train_state(tmp_path / "hf" / f"step-{n}", tmp_path) for n in (1, 4))
    assert first.keys() == last.keys()
    differ = {k for k, v in first.items()
              if not (torch.equal(v, last[k]) if isinstance(v, torch.Tensor) else v == last[k])}
    if mode == "single":  # the loop's step count and the lr last set moved, Adam's count not
        assert differ == {"steps_done.", "optim.param_groups.0.lr."}, differ
        return
    assert not differ, differ
    for n, steps in ((1, "1"), (4, "4")):
        with safe_open(tmp_path / "hf" / f"step-{n}" / TRAIN_STATE /
                       "slidedp-rank0-of-2.safetensors", framework="pt") as f:
            assert f.metadata() == {"steps_done": steps, "adam_steps": "1"}
