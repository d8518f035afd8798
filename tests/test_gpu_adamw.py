"""The one-pass GPU AdamW (slidedp/gpu_adamw.py) against torch's fused AdamW on the FP32 cast of
the same BF16 gradient: on the CPU through Triton's interpreter (the kernel's formula, in a
subprocess with TRITON_INTERPRET=1), on the GPU compiled (the GPU machine). Both within a few
FP32 roundings over several steps, with the clipping divisor, the non-finite skip and a ragged
tail; on the GPU the BF16 copy is the new weights rounded to nearest even, exactly."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.optim.adamw import adamw

from tests.conftest import REPO, subprocess_env

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)

CHECK = textwrap.dedent("""
    import torch
    from torch.optim.adamw import adamw
    from slidedp.gpu_adamw import BLOCK, adamw_step

    def reference(state, grad, step, divisor, found_inf, hyper):
        count = torch.full((), float(step - 1), device=grad.device)
        adamw([state[0]], [grad.float()], [state[1]], [state[2]], [], [count], fused=True,
              grad_scale=divisor, found_inf=found_inf, amsgrad=False, maximize=False, **hyper)

    def compare(device, launch, hyper):
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
            launch(state, grad, out, step, divisor, found_inf, hyper)
            reference(expected, grad, step, divisor, found_inf, hyper)
            if step == 3:  # skipped: nothing written
                assert all(torch.equal(a, b) for a, b in zip(state, before))
            for got, want in zip(state, expected):  # a few FP32 roundings of the tensor's scale
                bound = 2e-6 * want.abs() + 5e-7 * want.abs().max()
                assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
        return state, out
""")


@pytest.mark.skipif(pytest.importorskip("triton") is None, reason="needs triton")
def test_the_kernels_formula_follows_torchs_fused_adamw_in_the_interpreter():
    script = CHECK + textwrap.dedent("""
        import math, triton
        import slidedp.gpu_adamw as g

        def launch(state, grad, out, step, divisor, found_inf, hyper):
            # adamw_step takes torch's path on the CPU: call the kernel itself, interpreted.
            b1, b2 = hyper["beta1"], hyper["beta2"]
            p = state[0]
            g._adamw_kernel[(triton.cdiv(p.numel(), g.BLOCK),)](
                *state, grad, out, divisor if divisor is not None else p,
                found_inf if found_inf is not None else p, p.numel(),
                hyper["lr"] * hyper["weight_decay"], b1, 1 - b1, b2, 1 - b2,
                hyper["lr"] / (1 - b1 ** step), math.sqrt(1 - b2 ** step), hyper["eps"],
                HAS_OUT=True, HAS_DIVISOR=divisor is not None,
                HAS_FOUND_INF=found_inf is not None, BLOCK=g.BLOCK)

        state, out = compare(torch.device("cpu"), launch, HYPER)
        # The interpreter rounds to BF16 its own way: within one BF16 step of the weights.
        assert ((out.float() - state[0]).abs() <= state[0].abs() * 2 ** -7).all()
        print("ok")
    """)
    env = {**subprocess_env(), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", f"HYPER = {HYPER!r}\n" + script], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_cpu_path_is_torchs_fused_adamw_with_the_copy():
    """Without CUDA adamw_step is torch's fused AdamW on the cast gradient, bit for bit, and
    the copy is its BF16 rounding."""
    namespace: dict = {"HYPER": HYPER}
    exec(CHECK, namespace)
    from slidedp.gpu_adamw import adamw_step

    def launch(state, grad, out, step, divisor, found_inf, hyper):
        adamw_step(*state, grad, out=out, step=step, divisor=divisor, found_inf=found_inf,
                   **hyper)

    state, out = namespace["compare"](torch.device("cpu"), launch, HYPER)
    assert torch.equal(out, state[0].bfloat16())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
def test_the_compiled_kernel_follows_torchs_fused_adamw_on_the_gpu():
    namespace: dict = {"HYPER": HYPER}
    exec(CHECK, namespace)
    from slidedp.gpu_adamw import adamw_step

    def launch(state, grad, out, step, divisor, found_inf, hyper):
        adamw_step(*state, grad, out=out, step=step, divisor=divisor, found_inf=found_inf,
                   **hyper)

    state, out = namespace["compare"](torch.device("cuda", 0), launch, HYPER)
    assert torch.equal(out, state[0].bfloat16())


def test_lengths_must_agree():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="differ in length"):
        from slidedp.gpu_adamw import adamw_step
        adamw_step(p, p.clone(), p.clone(), torch.zeros(7, dtype=torch.bfloat16), out=None,
                   step=1, **HYPER)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_the_gpu_adam_bench_refuses_without_a_gpu(capsys):
    from recipes.bench.gpu_adam import main
    assert main(["--params", "1000"]) == 2
    err = capsys.readouterr().err
    assert err == "error: recipes.bench.gpu_adam needs a CUDA GPU\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the GPU machine)")
def test_the_gpu_adam_bench_times_both_paths(tmp_path):
    from recipes.bench.gpu_adam import main
    out = tmp_path / "rows.json"
    assert main(["--params", "4e6", "--repeats", "3", "--json", str(out)]) == 0
    import json
    rows = json.loads(out.read_text())
    assert [r["what"] for r in rows] == ["one-pass kernel", "torch fused + cast + copy"]
    assert all(r["median_s"] > 0 and r["useful_gbs"] > 0 for r in rows)
