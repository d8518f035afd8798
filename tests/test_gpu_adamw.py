"""The one-pass GPU AdamW (slidedp/gpu_adamw.py) against torch's fused AdamW on the FP32 cast of
the same BF16 gradient: on the CPU through Triton's interpreter (the kernel's formula, in a
subprocess with TRITON_INTERPRET=1), on the GPU compiled (the GPU machine). Both within a few
FP32 roundings over several steps, with the clipping divisor, the non-finite skip and a ragged
tail; on the GPU the BF16 copy is the new weights rounded to nearest even, exactly."""

import importlib.util
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.optim.adamw import adamw

from recipes.bench.gpu_adam import main as gpu_adam_bench
from slidedp.gpu_adamw import BLOCK, adamw_step
from tests.conftest import REPO, subprocess_env

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)


def reference(state, grad, step, divisor, found_inf):
    """torch's fused AdamW on the FP32 cast of `grad`."""
    count = torch.full((), float(step - 1), device=grad.device)
    adamw([state[0]], [grad.float()], [state[1]], [state[2]], [], [count], fused=True,
          grad_scale=divisor, found_inf=found_inf, amsgrad=False, maximize=False, **HYPER)


def step_launch(state, grad, out, step, divisor, found_inf):
    adamw_step(*state, grad, out=out, step=step, divisor=divisor, found_inf=found_inf, **HYPER)


def interpreted_launch(state, grad, out, step, divisor, found_inf, programs=0):
    """The kernel itself (adamw_step takes torch's path on the CPU), under TRITON_INTERPRET=1,
    on a program a block or, `programs` > 0, on that many programs striding over the blocks."""
    import triton

    import slidedp.gpu_adamw as g
    b1, b2, p = HYPER["beta1"], HYPER["beta2"], state[0]
    blocks = triton.cdiv(p.numel(), BLOCK)
    g._adamw_kernel[(programs or blocks,)](
        *state, grad, out, divisor if divisor is not None else p,
        found_inf if found_inf is not None else p, p.numel(),
        HYPER["lr"] * HYPER["weight_decay"], b1, 1 - b1, b2, 1 - b2,
        HYPER["lr"] / (1 - b1 ** step), math.sqrt(1 - b2 ** step), HYPER["eps"],
        HAS_OUT=True, HAS_DIVISOR=divisor is not None, HAS_FOUND_INF=found_inf is not None,
        MOMENTS_BF16=False, STRIDED=programs > 0, BLOCK=BLOCK)


def compare(device, launch):
    """Five steps of `launch` against `reference` on a ragged length, with the divisor on odd
    steps, step 3 skipped and step 4 not; returns the state and the BF16 copy."""
    torch.manual_seed(0)
    n = 3 * BLOCK + 77  # a ragged last program
    state = [torch.randn(n, device=device), 0.01 * torch.randn(n, device=device),
             1e-4 * torch.rand(n, device=device)]
    expected = [t.clone() for t in state]
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    zero, one = (torch.tensor(v, device=device) for v in (0.0, 1.0))
    for step in range(1, 6):
        grad = torch.randn(n, device=device).bfloat16()
        divisor = torch.tensor(1.0 + step, device=device) if step % 2 else None
        found_inf = one if step == 3 else zero if step == 4 else None
        before = [t.clone() for t in state]
        launch(state, grad, out, step, divisor, found_inf)
        reference(expected, grad, step, divisor, found_inf)
        if step == 3:  # skipped: nothing written
            assert all(torch.equal(a, b) for a, b in zip(state, before))
        for got, want in zip(state, expected):  # a few FP32 roundings of the tensor's scale
            bound = 2e-6 * want.abs() + 5e-7 * want.abs().max()
            assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    return state, out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("programs", [0, pytest.param(3, marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the compiled capped grid is checked against the "
    "uncapped kernel; the GPU image's Triton interpreter takes no loop bound from a program id"))],
    ids=["a-program-a-block", "a-capped-grid"])
def test_the_kernels_formula_follows_torchs_fused_adamw_in_the_interpreter(programs):
    """Also with fewer programs than blocks (3 for 4: one program strides over two)."""
    script = textwrap.dedent(f"""
        import functools, torch
        from tests.test_gpu_adamw import compare, interpreted_launch
        launch = functools.partial(interpreted_launch, programs={programs})
        state, out = compare(torch.device("cpu"), launch)
        # The interpreter rounds to BF16 its own way: within one BF16 step of the weights.
        assert ((out.float() - state[0]).abs() <= state[0].abs() * 2 ** -7).all()
        print("ok")
    """)
    env = {**subprocess_env(), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_cpu_path_is_torchs_fused_adamw_with_the_copy():
    """Without CUDA adamw_step is torch's fused AdamW on the cast gradient, and the copy is the
    new weights' BF16 rounding."""
    state, out = compare(torch.device("cpu"), step_launch)
    assert torch.equal(out, state[0].bfloat16())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
def test_the_compiled_kernel_follows_torchs_fused_adamw_on_the_gpu():
    state, out = compare(torch.device("cuda", 0), step_launch)
    assert torch.equal(out, state[0].bfloat16())


def compare_bf16_moments(device, exact: bool):
    """Five steps with BF16 moments (resident ones, slidedp/gpu_update.py) against torch's fused
    AdamW on their FP32 widening, the moments rounded back to BF16 after each step as the CPU
    Adam rounds them: `exact` (the CPU's path, which is that) or within one BF16 rounding of
    the moments and its effect on the weights (the compiled kernel's own FP32 arithmetic: a
    rounding that falls the other way feeds the next step, so a few BF16 steps over 5 steps)."""
    torch.manual_seed(0)
    n = 3 * BLOCK + 77
    state = [torch.randn(n, device=device), (0.01 * torch.randn(n, device=device)).bfloat16(),
             (1e-4 * torch.rand(n, device=device)).bfloat16()]
    expected = [state[0].clone(), state[1].float(), state[2].float()]
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    for step in range(1, 6):
        grad = torch.randn(n, device=device).bfloat16()
        divisor = torch.tensor(2.0, device=device) if step % 2 else None
        step_launch(state, grad, out, step, divisor, None)
        reference(expected, grad, step, divisor, None)
        expected[1], expected[2] = (t.bfloat16().float() for t in expected[1:])
        assert state[1].dtype == state[2].dtype == torch.bfloat16
        if exact:
            assert all(torch.equal(got.float(), want) for got, want in zip(state, expected))
            continue
        for got, want in zip(state[1:], expected[1:]):
            # Near a moment's zero crossing an earlier step's rounding is large beside it: the
            # bound is relative plus a floor of the tensor's scale; nearly every element is equal.
            bound = want.abs() * 2 ** -6 + want.abs().max() * 2 ** -7
            assert ((got.float() - want).abs() <= bound).all()
            assert (got.float() == want).float().mean() > 0.95
        assert ((state[0] - expected[0]).abs() <= HYPER["lr"] * 2 ** -5 * step).all()
    assert torch.equal(out, state[0].bfloat16())


def test_bf16_moments_are_widened_updated_and_rounded_back_on_the_cpu_path():
    compare_bf16_moments(torch.device("cpu"), exact=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
def test_the_compiled_kernel_keeps_bf16_moments_as_the_cpu_adam_does():
    compare_bf16_moments(torch.device("cuda", 0), exact=False)


def test_lengths_must_agree():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="differ in length"):
        adamw_step(p, p.clone(), p.clone(), torch.zeros(7, dtype=torch.bfloat16), out=None,
                   step=1, **HYPER)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
@pytest.mark.parametrize("programs,warps", [(2, 4), (1, 16), (5, 1)])
def test_a_capped_grid_updates_as_a_program_a_block_does(programs, warps):
    """The capped grid is the same arithmetic per element: bit for bit the uncapped kernel's."""
    torch.manual_seed(0)
    n = 5 * BLOCK * 16 + 77
    state = [torch.randn(n, device="cuda"), 0.01 * torch.randn(n, device="cuda"),
             1e-4 * torch.rand(n, device="cuda")]
    capped = [t.clone() for t in state]
    grad = torch.randn(n, device="cuda").bfloat16()
    outs = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    divisor = torch.tensor(3.0, device="cuda")
    adamw_step(*state, grad, out=outs[0], step=2, divisor=divisor, **HYPER)
    adamw_step(*capped, grad, out=outs[1], step=2, divisor=divisor, programs=programs,
               warps=warps, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip([*state, outs[0]], [*capped, outs[1]]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)"))])
def test_a_grid_cap_or_program_size_out_of_range_is_refused(device):
    p = torch.zeros(8, device=device)
    for programs, warps in ((-1, 4), (0, 3), (0, 64)):
        with pytest.raises(ValueError, match="programs must be >= 0 and warps a power of two"):
            adamw_step(p, p.clone(), p.clone(), torch.zeros(8, dtype=torch.bfloat16,
                                                           device=device),
                       out=None, step=1, programs=programs, warps=warps, **HYPER)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_the_gpu_adam_bench_refuses_without_a_gpu(capsys):
    assert gpu_adam_bench(["--params", "1000"]) == 2
    err = capsys.readouterr().err
    assert err == "error: recipes.bench.gpu_adam needs a CUDA GPU\n"


def test_the_gpu_adam_bench_refuses_a_grid_cap_or_program_size_before_allocating(capsys):
    assert gpu_adam_bench(["--overlap", "--warps", "4", "3"]) == 2
    assert gpu_adam_bench(["--overlap", "--programs", "0", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == 2 * "error: --programs must be >= 0 and --warps among (1, 2, 4, 8, 16, 32)\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
def test_the_gpu_adam_bench_times_both_paths(tmp_path):
    out = tmp_path / "rows.json"
    assert gpu_adam_bench(["--params", "4e6", "--repeats", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["what"] for r in rows] == ["one-pass kernel", "torch fused + cast + copy"]
    assert all(r["median_s"] > 0 and r["useful_gbs"] > 0 for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
def test_the_gpu_adam_bench_times_the_update_beside_gemms(tmp_path):
    out = tmp_path / "rows.json"
    assert gpu_adam_bench(["--params", "4e6", "--repeats", "3", "--json", str(out), "--overlap",
                           "--gemm", "1024", "256", "512", "--gemm-calls", "4",
                           "--programs", "0", "8", "--warps", "4"]) == 0
    rows = [r for r in json.loads(out.read_text()) if r["what"] == "update beside GEMMs"]
    assert [(r["programs"], r["warps"]) for r in rows] == [(0, 4), (8, 4)]
    # Times this short are mostly launch latency: only their form is checked here.
    assert all(min(r["chain_s"], r["update_s"], r["pair_s"]) > 0 for r in rows)
    assert all(r["exposed_s"] == r["pair_s"] - r["chain_s"] for r in rows)
