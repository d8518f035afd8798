"""The fused CPU Adam kernel against torch's fused Adam/AdamW, on every code path this machine has.

Tolerance: the kernel repeats torch's fused CPU kernel operation by operation (float roundings of the
coefficients, lerp, FMAs where torch's x86 build has them), so results are bit-identical to torch's
vectorized body; torch's own scalar tail (the last numel % vector-width elements) rounds one
multiply-add differently, and other torch builds may contract differently, so the comparison allows
a few ulp: rtol 1e-6 (~8 ulp), atol 1e-8. The BF16 output must equal `.to(torch.bfloat16)` of the
kernel's own FP32 result bit for bit.

BF16 moments are held to torch's fused step on FP32 copies of them, rounded back to BF16 after each
step, bit for bit (params included): the tail's ulp differences, all in exp_avg_sq's FP32 value,
vanish in that rounding on these seeds. (A torch build that rounded differently could flip one;
the assertion names the tensor and the first element that differs.)
"""

import multiprocessing
import re
import threading

import pytest
import torch

from slidedp import cpu_adam

RTOL, ATOL = 1e-6, 1e-8
ALL_ISAS = (*cpu_adam.NATIVE_ISAS, cpu_adam.TORCH_ISA)
SIZES = (1, 15, 16, 33, 1023, 2 * 32768 + 7)  # tails, one vector, several pool blocks
OFFSET = 5  # every tensor is a view into a bigger buffer
SENTINEL = 7.0  # exact in bf16 too
MOMENT_DTYPES = pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16],
                                        ids=["fp32_moments", "bf16_moments"])


@pytest.fixture(params=ALL_ISAS)
def isa(request, monkeypatch):
    if request.param not in cpu_adam.available_isas():
        pytest.skip(f"{request.param} not available on this CPU/build")
    monkeypatch.setenv(cpu_adam.ISA_ENV, request.param)
    return request.param


def _views(n: int, *, grad_dtype: torch.dtype, seed: int,
           moment_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random param and zero moments, each the slice [OFFSET, OFFSET + n) of a buffer whose margins
    hold SENTINEL."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = {"param": torch.float32, "exp_avg": moment_dtype, "exp_avg_sq": moment_dtype,
              "bf16_out": torch.bfloat16, "grad": grad_dtype}
    views = {name: torch.full((n + 2 * OFFSET,), SENTINEL, dtype=dtype)[OFFSET:OFFSET + n]
             for name, dtype in dtypes.items()}
    views["param"].copy_(torch.randn(n, generator=gen))
    views["exp_avg"].zero_()
    views["exp_avg_sq"].zero_()
    return views


def _assert_margins_untouched(views: dict[str, torch.Tensor]) -> None:
    for name, view in views.items():
        margins = torch.cat([view._base[:OFFSET], view._base[OFFSET + view.numel():]])
        assert torch.all(margins == SENTINEL), f"the update wrote outside its slice of {name}"


def _reference(param: torch.Tensor, grads: list[torch.Tensor], *, adamw: bool, scale: float,
               moment_dtype: torch.dtype = torch.float32, **hyper):
    """torch's fused optimizer on FP32 state; with BF16 moments its FP32 moments are rounded to BF16
    (nearest even) after each step, so each step starts from the BF16 values widened exactly."""
    p = torch.nn.Parameter(param.clone())
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([p], fused=True, **hyper)
    moments = ("exp_avg", "exp_avg_sq")
    for g in grads:
        p.grad = g.float() * scale
        opt.step()
        for name in moments if moment_dtype != torch.float32 else ():
            opt.state[p][name].copy_(opt.state[p][name].to(moment_dtype))
    return p.detach(), *(opt.state[p][name].to(moment_dtype) for name in moments)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _run(views: dict[str, torch.Tensor], grads: list[torch.Tensor], *, adamw: bool, scale: float, lr: float,
         betas: tuple[float, float], eps: float, weight_decay: float, threads: int = 2) -> None:
    for step, g in enumerate(grads, start=1):
        views["grad"].copy_(g)
        cpu_adam.adam_update(views["param"], views["grad"], views["exp_avg"], views["exp_avg_sq"], step=step,
                             lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                             adamw=adamw, grad_scale=scale, bf16_out=views["bf16_out"], num_threads=threads)


def _assert_matches_torch(n: int, *, grad_dtype: torch.dtype, adamw: bool, weight_decay: float,
                          betas: tuple[float, float], scale: float, seed: int,
                          moment_dtype: torch.dtype = torch.float32) -> None:
    views = _views(n, grad_dtype=grad_dtype, seed=seed, moment_dtype=moment_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(3)]
    hyper = {"lr": 1e-2, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay}
    expected = _reference(views["param"], grads, adamw=adamw, scale=scale, moment_dtype=moment_dtype, **hyper)
    _run(views, grads, adamw=adamw, scale=scale, **hyper)
    for name, want in zip(("param", "exp_avg", "exp_avg_sq"), expected):
        if moment_dtype == torch.bfloat16:  # bit for bit (see the module docstring)
            differ = (_bits(views[name]) != _bits(want)).nonzero().flatten()
            assert differ.numel() == 0, (f"{name}, n={n}: {differ.numel()} elements differ from the reference, "
                                         f"first at {differ[0].item()}")
        else:
            torch.testing.assert_close(views[name], want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}, n={n}: {m}")
    assert torch.equal(views["bf16_out"].view(torch.int16), views["param"].to(torch.bfloat16).view(torch.int16))
    _assert_margins_untouched(views)


@MOMENT_DTYPES
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16_grad", "fp32_grad"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_wd", "wd"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_matches_torch(isa, adamw, weight_decay, grad_dtype, moment_dtype):
    for i, n in enumerate(SIZES):
        _assert_matches_torch(n, grad_dtype=grad_dtype, adamw=adamw, weight_decay=weight_decay, betas=(0.9, 0.95),
                              scale=1.0 if i % 2 else 0.37, seed=i, moment_dtype=moment_dtype)


def test_large_lerp_weight(isa):
    """beta1 <= 0.5 takes torch's other lerp formula."""
    _assert_matches_torch(1023, grad_dtype=torch.bfloat16, adamw=True, weight_decay=0.1, betas=(0.3, 0.99),
                          scale=2.0, seed=7)


def test_bf16_rounding_edge_cases(isa):
    """Ties, values that round up to inf, denormals and specials survive a lr=0 step and must convert
    like torch's .to(torch.bfloat16): in a vector without denormals (the hardware conversion), one
    with them (the integer fallback) and the scalar tail."""
    def floats(bits: list[int]) -> torch.Tensor:
        return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)

    normal = floats([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_FFFF, 0xFF7F_8000, 0x0080_0000,
                     0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0x0000_0000, 0x8000_0000, 0x4780_8000, 0xC780_8000,
                     0x0081_8000, 0x3380_0000])
    denormal = floats([0x0000_0001, 0x0000_8000, 0x8001_8000, 0x007F_FFFF, 0x0000_7FFF, 0x8000_8000])
    param = torch.cat([normal, denormal, normal[:10], normal.flip(0), denormal, torch.randn(5)])
    n = param.numel()
    views = _views(n, grad_dtype=torch.float32, seed=0)
    views["param"].copy_(param)
    _run(views, [torch.randn(n)], adamw=True, scale=1.0, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    assert torch.equal(views["param"][~param.isnan()], param[~param.isnan()])  # (a -0 may become +0)
    got, want = views["bf16_out"], views["param"].to(torch.bfloat16)
    not_nan = ~want.isnan()
    assert torch.equal(got.view(torch.int16)[not_nan], want.view(torch.int16)[not_nan])
    assert torch.equal(got.isnan(), want.isnan())


def test_bf16_output_over_its_own_gradient(isa):
    """SlideDP's shadow holds a unit's BF16 gradient until the update overwrites it with the
    weights: the same memory as grad and bf16_out gives what separate buffers give."""
    n = 2 * 32768 + 7
    grads = [torch.randn(n, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(s))
             for s in range(3)]
    apart, shared = (_views(n, grad_dtype=torch.bfloat16, seed=5) for _ in range(2))
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.37,
                 num_threads=3)
    for step, g in enumerate(grads, start=1):
        apart["grad"].copy_(g)
        shared["bf16_out"].copy_(g)
        for v, grad in ((apart, apart["grad"]), (shared, shared["bf16_out"])):
            cpu_adam.adam_update(v["param"], grad, v["exp_avg"], v["exp_avg_sq"], step=step,
                                 bf16_out=v["bf16_out"], **hyper)
    for name in ("param", "exp_avg", "exp_avg_sq", "bf16_out"):
        assert torch.equal(shared[name], apart[name]), name
    _assert_margins_untouched(shared)


@pytest.mark.parametrize("offset", [0, 8, 5], ids=["32-byte", "16-byte", "2-byte"])
def test_bf16_output_at_each_alignment(isa, offset):
    """An output apart from the gradient is written with streaming stores where a whole vector's
    address allows them (32 bytes for AVX-512's 16 lanes, 16 for AVX2's 8) and plain ones
    elsewhere: the same bits, and nothing outside its slice, at every alignment."""
    n = 2 * 32768 + 7
    views = _views(n, grad_dtype=torch.bfloat16, seed=9)
    base = torch.full((n + 64,), SENTINEL, dtype=torch.bfloat16)
    assert base.data_ptr() % 64 == 0  # so offset 0 is the aligned case the kernel streams
    out = base[offset:offset + n]
    views["grad"].copy_(torch.randn(n, generator=torch.Generator().manual_seed(3)))
    cpu_adam.adam_update(views["param"], views["grad"], views["exp_avg"], views["exp_avg_sq"], step=1,
                         lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bf16_out=out,
                         num_threads=3)
    assert torch.equal(_bits(out), _bits(views["param"].to(torch.bfloat16)))
    assert torch.all(base[:offset] == SENTINEL) and torch.all(base[offset + n:] == SENTINEL)


@MOMENT_DTYPES
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16_grad", "fp32_grad"])
def test_bf16_params_updated_in_place(isa, grad_dtype, moment_dtype):
    """A BF16 master (MegaTrain-style): each step equals widening it to FP32, the FP32 update
    (held to torch's above) and rounding back, bit for bit, moments (FP32 or BF16) included; every
    size's tail."""
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.37,
                 num_threads=3)
    for seed, n in enumerate(SIZES):
        ref = _views(n, grad_dtype=grad_dtype, seed=seed, moment_dtype=moment_dtype)
        master = torch.full((n + 2 * OFFSET,), SENTINEL, dtype=torch.bfloat16)[OFFSET:OFFSET + n]
        master.copy_(ref["param"])
        m, v = torch.zeros(n, dtype=moment_dtype), torch.zeros(n, dtype=moment_dtype)
        gen = torch.Generator().manual_seed(seed + 1)
        for step in (1, 2, 3):
            g = torch.randn(n, generator=gen).to(grad_dtype)
            ref["param"].copy_(master)
            cpu_adam.adam_update(ref["param"], g, ref["exp_avg"], ref["exp_avg_sq"], step=step,
                                 bf16_out=ref["bf16_out"], **hyper)
            cpu_adam.adam_update(master, g, m, v, step=step, **hyper)
            assert torch.equal(master.view(torch.int16), ref["bf16_out"].view(torch.int16)), (n, step)
            assert torch.equal(m, ref["exp_avg"]) and torch.equal(v, ref["exp_avg_sq"]), (n, step)
        _assert_margins_untouched({"master": master})


@MOMENT_DTYPES
def test_paths_and_thread_counts_bit_identical(monkeypatch, moment_dtype):
    native = [i for i in cpu_adam.available_isas() if i != cpu_adam.TORCH_ISA]
    n = 3 * 32768 + 13
    grads = [torch.randn(n, dtype=torch.bfloat16) for _ in range(2)]
    results = {}
    for isa in native:
        monkeypatch.setenv(cpu_adam.ISA_ENV, isa)
        for threads in (1, 3):
            views = _views(n, grad_dtype=torch.bfloat16, seed=3, moment_dtype=moment_dtype)
            _run(views, grads, adamw=True, scale=0.5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 threads=threads)
            results[isa, threads] = [_bits(views[k]) for k in ("param", "exp_avg", "exp_avg_sq", "bf16_out")]
    baseline = next(iter(results))
    for key, bits in results.items():
        assert all(map(torch.equal, bits, results[baseline])), f"{key} differs from {baseline}"


def test_concurrent_callers(isa):
    """Two Python threads updating at once (the pool takes one multi-threaded job at a time)."""
    errors = []

    def worker(seed: int) -> None:
        try:
            _assert_matches_torch(2 * 32768 + 3, grad_dtype=torch.bfloat16, adamw=True, weight_decay=0.1,
                                  betas=(0.9, 0.95), scale=1.0, seed=seed)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _child_update(queue) -> None:
    torch.set_num_threads(1)  # torch's own OpenMP pool does not survive fork(); ours must
    views = _views(4 * 32768, grad_dtype=torch.float32, seed=0)
    views["grad"].fill_(1.0)
    cpu_adam.adam_update(views["param"], views["grad"], views["exp_avg"], views["exp_avg_sq"], step=1, lr=1e-3,
                         beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, num_threads=2)
    queue.put(bool(torch.all(views["exp_avg"] != 0)))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_gets_a_fresh_pool(isa):
    if isa == cpu_adam.TORCH_ISA:
        pytest.skip("tests the kernel's thread pool")
    _run(_views(4 * 32768, grad_dtype=torch.float32, seed=0), [torch.randn(4 * 32768)], adamw=True, scale=1.0,
         lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # parent pool has started threads
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_update, args=(queue,))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in adam_update")
    assert child.exitcode == 0 and queue.get(timeout=5)


def test_validation():
    p, m, v, g = (torch.zeros(8) for _ in range(4))
    hyper = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    bad_calls = {
        "grad": dict(grad=torch.zeros(8, dtype=torch.float16)),
        "exp_avg": dict(exp_avg=torch.zeros(16)[::2]),
        "exp_avg_sq": dict(exp_avg_sq=torch.zeros(2, 4)),
        "param": dict(param=torch.zeros(8, dtype=torch.float64)),
        "bf16_out": dict(bf16_out=torch.zeros(7, dtype=torch.bfloat16)),
        "own bf16 output": dict(param=torch.zeros(8, dtype=torch.bfloat16),
                                bf16_out=torch.zeros(8, dtype=torch.bfloat16)),
        "step": dict(step=0),
        "num_threads": dict(num_threads=0),
    }
    for what, change in bad_calls.items():
        args = {"param": p, "grad": g, "exp_avg": m, "exp_avg_sq": v, **hyper, **change}
        with pytest.raises(ValueError, match=what):
            cpu_adam.adam_update(**args)


@pytest.mark.parametrize("exp_avg_dtype, exp_avg_sq_dtype",
                         [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_mixed_moment_dtypes_refused(isa, exp_avg_dtype, exp_avg_sq_dtype):
    """Both moments of one dtype: a mix is refused before anything is written."""
    p, g = torch.ones(8), torch.ones(8)
    m, v = torch.zeros(8, dtype=exp_avg_dtype), torch.zeros(8, dtype=exp_avg_sq_dtype)
    want = (f"adam_update: exp_avg and exp_avg_sq must share one dtype (both float32, bfloat16 or uint8); "
            f"got exp_avg {exp_avg_dtype}, exp_avg_sq {exp_avg_sq_dtype}")
    with pytest.raises(ValueError, match=re.escape(want)):
        cpu_adam.adam_update(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert torch.all(p == 1) and torch.all(m == 0) and torch.all(v == 0)


def test_bf16_moments_track_fp32_moments():
    """BF16 moments stay on the FP32 moments' trajectory: 20 AdamW steps (lr 1e-3, gradients ~1e-3
    with a persistent direction plus noise, as in training) from one start. Each rounding moves a
    moment by at most 2^-9 of itself, so the params drift from the FP32-moment run by ~2e-3 of the
    distance they travel (measured here: 2.03e-3 to 2.08e-3 over five seeds, at most 0.11 lr for
    any element). Bounds: 5e-3 of the distance in norm and lr / 4 per element; and the drift is not
    zero, so the moments really were BF16."""
    n, steps, lr = 1 << 14, 20, 1e-3
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=gen)
    direction = torch.randn(n, generator=gen)
    grads = [((0.2 * direction + torch.randn(n, generator=gen)) * 1e-3).to(torch.bfloat16) for _ in range(steps)]
    params = {}
    for dtype in (torch.float32, torch.bfloat16):
        p, m, v = start.clone(), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
        for step, g in enumerate(grads, start=1):
            cpu_adam.adam_update(p, g, m, v, step=step, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        params[dtype] = p
    drift = params[torch.bfloat16] - params[torch.float32]
    travelled = params[torch.float32] - start
    assert travelled.abs().max() > 10 * lr  # the run moved the params far enough to mean something
    relative = float(drift.norm() / travelled.norm())
    assert 1e-4 < relative < 5e-3, relative
    assert float(drift.abs().max()) < lr / 4, float(drift.abs().max()) / lr


def _run_8bit(n: int, *, steps: int, seed: int, **hyper) -> dict[str, torch.Tensor]:
    """`steps` AdamW steps on 8-bit moments from zero, every tensor a view between SENTINEL
    margins; gradients spread over six decades, as real ones are."""
    gen = torch.Generator().manual_seed(seed)
    k = cpu_adam.moment_scales(n)
    sizes = {"param": n, "exp_avg": n, "exp_avg_sq": n, "exp_avg_scale": k, "exp_avg_sq_scale": k, "bf16_out": n}
    dtypes = {"exp_avg": torch.uint8, "exp_avg_sq": torch.uint8, "bf16_out": torch.bfloat16}
    t = {name: torch.full((size + 2 * OFFSET,), SENTINEL, dtype=dtypes.get(name, torch.float32))
         [OFFSET:OFFSET + size] for name, size in sizes.items()}
    t["param"].copy_(torch.randn(n, generator=gen))
    for name in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        t[name].zero_()
    for step in range(1, steps + 1):
        spread = torch.logspace(-6, 0, n)[torch.randperm(n, generator=gen)]
        grad = (torch.randn(n, generator=gen) * spread).to(torch.bfloat16)
        cpu_adam.adam_update(grad=grad, step=step, **t, **hyper)
    return t


@pytest.mark.parametrize("n", [1, 127, 128 * 5 + 3, 32768 + 128 * 3 + 17])  # tails, several pool blocks
def test_8bit_moments_are_torchao_quantized_fused_steps(isa, n, monkeypatch):
    """Each ISA's 8-bit step equals, bit for bit, torch's fused AdamW on the dequantized moments,
    requantized as torchao does (the torch path; its quantizer is torchao's: the next test), and
    writes nothing outside its views."""
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, num_threads=3)
    got = _run_8bit(n, steps=3, seed=n, **hyper)
    monkeypatch.setenv(cpu_adam.ISA_ENV, cpu_adam.TORCH_ISA)
    want = _run_8bit(n, steps=3, seed=n, **hyper)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
        whole = t._base if t._base is not None else t
        assert torch.all(whole[:OFFSET] == SENTINEL) and torch.all(whole[OFFSET + t.numel():] == SENTINEL), name
    if n > 1000:  # the codes span the table, not a few entries
        assert got["exp_avg_sq"].unique().numel() > 50


def test_8bit_code_tables_are_torchao_s():
    """The dynamic-tree tables are torchao's, and counting thresholds picks torchao's codes on
    random inputs, every threshold, the float just below each, and every table value; whole
    moments quantize and dequantize as torchao's functions do, blocks and scales included."""
    from torchao.optim.quant_utils import (create_dynamic_map, dequant_with_qmap,
                                           quantize_8bit_with_qmap, scale_tensor)

    for signed in (True, False):
        qmap = cpu_adam.dynamic_qmap(signed=signed)
        assert torch.equal(qmap, torch.tensor(create_dynamic_map(signed=signed), dtype=torch.float32))
        thresholds = cpu_adam.quantize_thresholds(signed=signed)[:-1]
        assert bool((thresholds.diff() > 0).all())
        gen = torch.Generator().manual_seed(int(signed))
        low = -1.0 if signed else 0.0
        x = torch.cat([torch.rand(1 << 16, generator=gen) * (1 - low) + low, thresholds,
                       torch.nextafter(thresholds, torch.tensor(-2.0)), qmap]).clamp(min=low)
        assert torch.equal(torch.searchsorted(thresholds, x, right=True), quantize_8bit_with_qmap(x, qmap).long())
        moment = torch.randn(128 * 9, generator=gen) * torch.logspace(-8, 0, 128 * 9)
        moment = moment if signed else moment.abs()
        codes, scale = torch.empty(moment.numel(), dtype=torch.uint8), torch.empty(9)
        cpu_adam.quantize_moment(moment, signed=signed, codes=codes, scale=scale)
        scaled, want_scale = scale_tensor(moment.view(9, 128), 128)
        assert torch.equal(codes, quantize_8bit_with_qmap(scaled, qmap).view(-1))
        assert torch.equal(scale, want_scale)
        assert torch.equal(cpu_adam.dequantize_moment(codes, scale, signed=signed),
                           dequant_with_qmap(codes.view(9, 128), qmap, scale).view(-1))


def test_8bit_moments_track_fp32_moments():
    """8-bit moments stay near the FP32 moments' trajectory over the 20 steps of the BF16 test:
    each requantization moves a moment by up to half a code step (a few % of its block's max),
    so the drift is ~6x the BF16 one (measured here: 1.32e-2 to 1.36e-2 of the distance travelled
    over five seeds, at most 0.48 lr for any element); bounds 4e-2 and lr, and above the BF16
    drift's bound, so the moments really were 8-bit."""
    n, steps, lr = 1 << 14, 20, 1e-3
    gen = torch.Generator().manual_seed(0)
    start, direction = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    grads = [((0.2 * direction + torch.randn(n, generator=gen)) * 1e-3).to(torch.bfloat16) for _ in range(steps)]
    k = cpu_adam.moment_scales(n)
    runs = {"fp32": (torch.zeros(n), torch.zeros(n), {}),
            "8bit": (torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                     {"exp_avg_scale": torch.zeros(k), "exp_avg_sq_scale": torch.zeros(k)})}
    params = {}
    for name, (m, v, scales) in runs.items():
        p = start.clone()
        for step, g in enumerate(grads, start=1):
            cpu_adam.adam_update(p, g, m, v, step=step, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8,
                                 weight_decay=0.1, **scales)
        params[name] = p
    drift, travelled = params["8bit"] - params["fp32"], params["fp32"] - start
    relative = float(drift.norm() / travelled.norm())
    assert 5e-3 < relative < 4e-2, relative
    assert float(drift.abs().max()) < lr, float(drift.abs().max()) / lr


def test_8bit_moments_refusals():
    p, g = torch.ones(256), torch.ones(256)
    m, v = torch.zeros(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="uint8 \\(8-bit\\) moments need exp_avg_scale"):
        cpu_adam.adam_update(p, g, m, v, **hyper)
    with pytest.raises(ValueError, match="exp_avg_sq_scale must be a 1-D contiguous CPU torch.float32 tensor of 2"):
        cpu_adam.adam_update(p, g, m, v, exp_avg_scale=torch.zeros(2), exp_avg_sq_scale=torch.zeros(3), **hyper)
    with pytest.raises(ValueError, match="scales are for uint8"):
        cpu_adam.adam_update(p, g, torch.zeros(256), torch.zeros(256), exp_avg_scale=torch.zeros(2),
                             exp_avg_sq_scale=torch.zeros(2), **hyper)
    assert torch.all(p == 1)


@pytest.mark.parametrize("isa", ["native", cpu_adam.TORCH_ISA])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_grad_accumulate_and_sumsq(monkeypatch, isa, src_dtype):
    if isa != "native":
        monkeypatch.setenv(cpu_adam.ISA_ENV, isa)
    gen = torch.Generator().manual_seed(3)
    n = 3 * (1 << 15) + 77  # several work blocks and a ragged end
    srcs = [torch.randn(n, generator=gen).to(src_dtype) for _ in range(3)]
    acc = torch.full((n,), 7.0)
    assert cpu_adam.grad_accumulate(acc, srcs[0], assign=True, want_sumsq=False, num_threads=3) == 0.0
    torch.testing.assert_close(acc, srcs[0].float(), rtol=0, atol=0)
    outs = [acc.clone() for _ in range(3)]
    sums = [cpu_adam.grad_accumulate(out, srcs[1], assign=False, want_sumsq=True, num_threads=t)
            for out, t in zip(outs, (1, 2, 5))]
    want = acc + srcs[1].float()
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert sums[0] == pytest.approx(float((want.double() ** 2).sum()), rel=1e-5)
    assert len(set(sums)) == 1  # independent of the thread count
    with pytest.raises(ValueError, match="grad_accumulate: src"):
        cpu_adam.grad_accumulate(acc, srcs[2][:-1], assign=False, want_sumsq=False)


@pytest.mark.parametrize("isa", ["native", cpu_adam.TORCH_ISA])
def test_stream_triad(monkeypatch, isa):
    """STREAM's triad on views at odd offsets (the unaligned and ragged paths), from one
    and several threads, and which loop ran; the bandwidth figure counts STREAM's bytes."""
    from slidedp.plan import triad

    if isa != "native":
        monkeypatch.setenv(cpu_adam.ISA_ENV, isa)
    gen = torch.Generator().manual_seed(4)
    n = 3 * (1 << 15) + 77
    alignments = set()
    for offset in (0, 1):  # one of them leaves `a` off a 16-byte boundary (the scalar loop)
        a = torch.full((n + 2 * OFFSET,), SENTINEL, dtype=torch.float64)[OFFSET + offset:OFFSET + offset + n]
        alignments.add(a.data_ptr() % 16 == 0)
        b, c = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2))
        for threads in (1, 3):
            a.fill_(0.0)
            ran = cpu_adam.stream_triad(a, b, c, scalar=3.0, num_threads=threads)
            assert ran == ("slidedp" if isa == "native" else cpu_adam.TORCH_ISA)
            torch.testing.assert_close(a, b + 3.0 * c, rtol=1e-12, atol=1e-12)  # torch's may fuse
        base = a._base
        assert torch.all(base[:OFFSET + offset] == SENTINEL) and torch.all(base[OFFSET + offset + n:] == SENTINEL)
    assert alignments == {True, False}
    with pytest.raises(ValueError, match="stream_triad: c"):
        cpu_adam.stream_triad(a, b, c.float(), scalar=3.0, num_threads=1)
    gbs, ran = triad.triad(elements=1 << 16, threads=2, repeats=2)
    assert gbs > 0 and ran == ("slidedp" if isa == "native" else cpu_adam.TORCH_ISA)


def test_isa_env_var(monkeypatch):
    monkeypatch.setenv(cpu_adam.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="expected one of"):
        cpu_adam.active_isa()
    missing = [i for i in cpu_adam.NATIVE_ISAS if i not in cpu_adam.available_isas()]
    if missing:
        monkeypatch.setenv(cpu_adam.ISA_ENV, missing[0])
        with pytest.raises(RuntimeError, match="not available"):
            cpu_adam.active_isa()
    monkeypatch.delenv(cpu_adam.ISA_ENV)
    assert cpu_adam.active_isa() == cpu_adam.available_isas()[0]


@pytest.fixture
def fresh_build_state():
    cpu_adam._library.cache_clear()
    cpu_adam._available.cache_clear()
    yield
    cpu_adam._library.cache_clear()
    cpu_adam._available.cache_clear()


def test_fallback_without_compiler(fresh_build_state, monkeypatch, tmp_path):
    monkeypatch.delenv(cpu_adam.ISA_ENV, raising=False)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("SLIDEDP_CACHE_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="torch fallback"):
        assert cpu_adam.available_isas() == [cpu_adam.TORCH_ISA]
    assert cpu_adam.active_isa() == cpu_adam.TORCH_ISA
    _assert_matches_torch(1023, grad_dtype=torch.bfloat16, adamw=True, weight_decay=0.1, betas=(0.9, 0.95),
                          scale=0.5, seed=0)
