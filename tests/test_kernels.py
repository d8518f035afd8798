"""The kernel switch ([model] kernels / attention): choices, fallback and errors on the CPU; on a
GPU (run on the device machine) the fused path against the plain one, and SlideDP on the fused
path against `single` on the fused path."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import models.kernels as kernels_mod
from models.activation_memory import saved_bytes
from models.kernels import TORCH_KERNELS, KernelsUnavailable, resolve_kernels, sdpa_backend_used
from models.rope import rope_tables
from protocols.model_spec import ModelArgs, get_flavor, get_model_spec
from tests.conftest import REPO, subprocess_env
from tests.test_slidedp import (POLICY_VARIANTS, assert_matches_reference, assert_offload_traffic,
                                run_workers, single_reference)

HAS_LIGER_GPU = torch.cuda.is_available() and not kernels_mod._liger_missing()
gpu_only = pytest.mark.skipif(not HAS_LIGER_GPU,
                              reason="needs a CUDA GPU and liger-kernel (run on the GPU machine)")

QWEN = get_model_spec("qwen")


# ---- the switch (CPU) ----------------------------------------------------------------------------

def test_auto_is_the_plain_path_on_the_cpu_without_a_note():
    k = resolve_kernels("auto", device_type="cpu")
    assert k.name == "torch" and k.note == ""
    assert resolve_kernels("torch", device_type="cuda").name == "torch"


def test_liger_on_the_cpu_is_refused_in_one_line():
    with pytest.raises(KernelsUnavailable, match="needs a CUDA GPU") as e:
        resolve_kernels("liger", device_type="cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(KernelsUnavailable, match="CUDA SDPA backend"):
        resolve_kernels("torch", attention="cudnn", device_type="cpu")


def test_missing_library_falls_back_with_a_note_or_is_an_error(monkeypatch):
    monkeypatch.setattr(kernels_mod, "_liger_missing", lambda: "liger-kernel is not installed (x)")
    k = resolve_kernels("auto", attention="flash", device_type="cuda")
    assert k.name == "torch" and k.attention == "flash"
    assert "plain torch kernels instead" in k.note and "pip install liger-kernel" in k.note
    with pytest.raises(KernelsUnavailable, match="pip install liger-kernel"):
        resolve_kernels("liger", device_type="cuda")


def test_auto_picks_liger_on_cuda_when_it_imports():
    if kernels_mod._liger_missing():
        pytest.skip("liger-kernel not installed here")
    k = resolve_kernels("auto", device_type="cuda")  # building the ops runs nothing
    assert k.name == "liger" and k.note == ""


@pytest.mark.parametrize("flags, message", [
    (["--model.kernels=liger"], "needs a CUDA GPU"),
    (["--model.attention=cudnn"], "CUDA SDPA backend"),
])
def test_cli_refuses_kernels_that_cannot_run_here(flags, message):
    if torch.cuda.is_available():
        pytest.skip("the CPU case")
    proc = subprocess.run([sys.executable, "-m", "recipes.train",
                           "--job.config_file", "train_configs/debug_cpu.toml", *flags],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]


def test_the_model_runs_every_op_through_its_kernels():
    """Swapping one op of the kernel set changes the output: no op bypasses the switch."""
    args = get_flavor("qwen3-debug")
    torch.manual_seed(0)
    model = QWEN.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    base = model(tokens)
    for op in ("rms_norm", "rope", "swiglu"):
        real = getattr(TORCH_KERNELS, op)
        doubled = (lambda *a, f=real: tuple(2 * t for t in f(*a))) if op == "rope" else \
            (lambda *a, f=real: 2 * f(*a))
        swapped = replace(TORCH_KERNELS, **{op: doubled})
        other = QWEN.model_cls(args, swapped)
        other.load_state_dict(model.state_dict())
        assert not torch.allclose(other(tokens), base), op


def test_sdpa_backend_is_recorded_on_the_cpu():
    op = sdpa_backend_used(TORCH_KERNELS, n_heads=4, n_kv_heads=2, head_dim=16, seq_len=32,
                           device=torch.device("cpu"), dtype=torch.float32)
    assert "scaled_dot_product" in op or op == "math"


def test_saved_bytes_counts_activations_not_weights():
    args = get_flavor("qwen3-debug")
    block = QWEN.block_cls(args)
    per_token = []
    for seq in (16, 32):
        x = torch.randn(1, seq, args.dim, requires_grad=True)
        n, out = saved_bytes(block, x, *rope_tables(args, seq, "cpu"), exclude=block.parameters())
        out.sum().backward()
        per_token.append(n / seq)
    # Everything saved grows with the tokens (no weight is counted), and it is at least the
    # block input plus the MLP's three hidden-size tensors.
    assert per_token[0] == pytest.approx(per_token[1], rel=0.02)
    assert per_token[0] >= 4 * (args.dim + 3 * args.hidden_dim)


# ---- the fused path on a GPU ---------------------------------------------------------------------

# Big enough that the Triton kernels take their real code paths (head_dim 128 as in Qwen3),
# small enough for seconds.
_QWEN3 = QWEN.args_cls(family="qwen3", dim=512, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128,
                  hidden_dim=1408, vocab_size=4096, qk_norm=True, qkv_bias=False,
                  tie_embeddings=True)
_QWEN25 = QWEN.args_cls(family="qwen2.5", dim=512, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=64,
                   hidden_dim=1408, vocab_size=4096, qk_norm=False, qkv_bias=True,
                   tie_embeddings=False)


def _loss_and_grads(model: nn.Module, tokens, labels, *, recompute: bool = False):
    model.zero_grad(set_to_none=True)
    h = model.embed_tokens(tokens)
    cos, sin = rope_tables(model.args, tokens.shape[1], tokens.device)
    for block in model.layers:
        h = checkpoint(block, h, cos, sin, use_reentrant=False) if recompute else block(h, cos, sin)
    loss = model.loss_sum(model.norm(h), labels) / labels.numel()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@gpu_only
@pytest.mark.parametrize("args", [_QWEN3, _QWEN25], ids=["qwen3-tied-qknorm", "qwen2.5-untied-bias"])
def test_fused_loss_and_every_gradient_equal_the_plain_path(args):
    device = torch.device("cuda")
    liger = resolve_kernels("liger", device_type="cuda")
    torch.manual_seed(0)
    models = {}
    for name, k, dtype in (("fp32", TORCH_KERNELS, torch.float32), ("plain", TORCH_KERNELS, torch.bfloat16),
                           ("fused", liger, torch.bfloat16)):
        m = QWEN.model_cls(args, k)
        if not models:
            m.init_weights()
        else:
            m.load_state_dict(models["fp32"].state_dict())
        models[name] = m.to(device=device, dtype=dtype)
    tokens = torch.randint(0, args.vocab_size, (2, 256), device=device)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, ::7] = -100  # some ignored targets
    results = {name: _loss_and_grads(m, tokens, labels) for name, m in models.items()}
    (l32, g32), (lp, gp), (lf, gf) = results["fp32"], results["plain"], results["fused"]
    assert lf == pytest.approx(lp, rel=5e-3) and lf == pytest.approx(l32, rel=5e-3)
    for n in g32:
        plain_err, fused_err = _rel(gp[n], g32[n]), _rel(gf[n], g32[n])
        # Within BF16 tolerance of the plain path, and no further from FP32 than BF16 rounding
        # already puts the plain path.
        assert _rel(gf[n], gp[n]) < 3e-2, (n, _rel(gf[n], gp[n]))
        assert fused_err <= 2 * plain_err + 5e-3, (n, fused_err, plain_err)
    # Full recompute on top of the fused kernels gives the same loss and gradients.
    lr_, gr = _loss_and_grads(models["fused"], tokens, labels, recompute=True)
    assert lr_ == pytest.approx(lf, rel=1e-4)
    assert all(_rel(gr[n], gf[n]) < 1e-2 for n in gf)


@gpu_only
@pytest.mark.parametrize("flavor", ["qwen3-debug", "qwen2.5-debug"])
def test_slidedp_on_the_fused_path_equals_single_on_the_fused_path(tmp_path, flavor):
    """Every activation policy on liger's kernels (custom autograd Functions; without QK-norm
    its RoPE works in place), offload on its CUDA stream; without the BF16 shadow too."""
    variants = [{"activation": "recompute"}, {"activation": "keep", "window_slots": 2},
                {"activation": "selective", "keep_blocks": 1}, *POLICY_VARIANTS,
                # FP32 delivery cast on the GPU, gradients held in registered host memory
                {"activation": "recompute", "bf16_shadow": False},
                {"activation": "keep", "bf16_shadow": False, "update_order": "arrival"}]
    kw = dict(flavor=flavor, steps=3, accum=2, max_norm=0.5, device="cuda", kernels="liger")
    results = run_workers(tmp_path, world=1, variants=variants, **kw)
    ref_losses, ref_weights = single_reference(world=1, **kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert_offload_traffic(results)
