"""Fused CPU Adam/AdamW on flat ranges of the host-resident FP32 state.

The kernel (`csrc/cpu_adam.cpp`) reads the BF16 or FP32 gradient, updates the FP32 params and
moments, and optionally writes a BF16 copy of the params, all in one pass over memory; BF16 params
(a BF16 master) and BF16 moments (10 host bytes per parameter instead of 14) are updated in FP32
and rounded back in place, in the same pass, and so are blockwise 8-bit moments (8 bytes per
parameter; torchao's AdamW8bit format: a byte code per element into bitsandbytes' dynamic-tree
table, one FP32 absmax per `MOMENT_BLOCK` elements). It is compiled on first use into
`${SLIDEDP_CACHE_DIR:-~/.cache/slidedp}` (slidedp/native_build.py) and loaded with ctypes, which
releases the GIL for the call, so the runtime can update one slice while other threads move the
next. Without a compiler
the same math runs in torch ops (`torch._fused_adamw_` and separate casts).
The same library holds `grad_accumulate`: the host-side gradient sum / accumulation with the sum of
squares for clipping, also in one pass; and `stream_triad`, STREAM's triad on the same threads, the
host bandwidth the update is measured against (slidedp/plan/triad.py).

`SLIDEDP_CPU_ADAM_ISA=avx512bf16|avx512|avx2|scalar|torch` forces a code path.
"""

import ctypes
import functools
import os
import subprocess
import warnings
from pathlib import Path

import torch
from torch import Tensor

from slidedp.native_build import NativeBuildError, compile_cached

ISA_ENV = "SLIDEDP_CPU_ADAM_ISA"
NATIVE_ISAS = ("avx512bf16", "avx512", "avx2", "scalar")  # best first
TORCH_ISA = "torch"
_ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}  # `Isa` in the C++
_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cpu_adam.cpp"
_MOMENT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}  # `MomentFormat` in the C++
MOMENT_BLOCK = 128
"""Elements per scale of 8-bit moments (`kQBlock` in the C++); layout.SHARD_ALIGN is a multiple."""
# No -march: one build serves every CPU, each ISA path carries its own target attribute.
# -ffp-contract=off keeps every path rounding exactly as written (and as torch's kernel does).
# -O2: the update is explicit vector code, as fast as at -O3 and quicker to build; the loops that
# need -O3's vectorizer ask for it themselves (csrc/cpu_adam.cpp).
_CXX_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-pthread", "-ffp-contract=off",
              "-fno-math-errno", "-Wno-psabi")


def build() -> Path:
    """The kernel's library, compiled ($CXX, else g++) unless this source's build is cached;
    raises NativeBuildError without a compiler or when it fails."""
    return compile_cached(_SOURCE, _CXX_FLAGS, "cpu_adam", compiler=os.environ.get("CXX", "g++"),
                          suffix=".so")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with a warning) when it cannot be built or loaded."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (NativeBuildError, OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"slidedp: CPU Adam kernel unavailable, using the slower torch fallback: {e}",
                      RuntimeWarning, stacklevel=3)
        return None
    lib.slidedp_cpu_adam_isa_supported.argtypes = [ctypes.c_int]
    lib.slidedp_cpu_adam_isa_supported.restype = ctypes.c_int
    lib.slidedp_cpu_adam_update.argtypes = [
        ctypes.c_int,  # isa
        ctypes.c_void_p, ctypes.c_int,  # param, param_is_bf16
        ctypes.c_void_p, ctypes.c_int,  # grad, grad_is_bf16
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # exp_avg, exp_avg_sq, moment_format
        ctypes.c_void_p, ctypes.c_void_p,  # exp_avg_scale, exp_avg_sq_scale
        ctypes.c_void_p, ctypes.c_void_p,  # qmap_signed, qmap_unsigned
        ctypes.c_void_p, ctypes.c_void_p,  # thresholds_signed, thresholds_unsigned
        ctypes.c_void_p,  # bf16_out
        ctypes.c_int64, ctypes.c_int64,  # n, step
        ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double,  # lr .. wd
        ctypes.c_int, ctypes.c_double, ctypes.c_int,  # adamw, grad_scale, num_threads
    ]
    lib.slidedp_cpu_adam_update.restype = ctypes.c_int
    lib.slidedp_pin_helpers.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.slidedp_pin_helpers.restype = ctypes.c_int
    lib.slidedp_grad_accumulate.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,  # acc, src, src_is_bf16, n
        ctypes.c_int, ctypes.c_int, ctypes.c_int,  # assign, want_sumsq, num_threads
    ]
    lib.slidedp_grad_accumulate.restype = ctypes.c_double
    lib.slidedp_stream_triad.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double,  # a, b, c, scalar
        ctypes.c_int64, ctypes.c_int,  # n, num_threads
    ]
    lib.slidedp_stream_triad.restype = None
    return lib


@functools.cache
def _available() -> tuple[str, ...]:
    lib = _library()
    native = [] if lib is None else [isa for isa in NATIVE_ISAS if lib.slidedp_cpu_adam_isa_supported(_ISA_CODES[isa])]
    return (*native, TORCH_ISA)


def available_isas() -> list[str]:
    """Code paths usable here, best first; 'torch' (the fallback) is always last."""
    return list(_available())


def active_isa() -> str:
    """The path `adam_update` takes: the best available, or the one forced by SLIDEDP_CPU_ADAM_ISA."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return _available()[0]
    if forced not in (*NATIVE_ISAS, TORCH_ISA):
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join((*NATIVE_ISAS, TORCH_ISA))}")
    if forced not in _available():
        raise RuntimeError(f"{ISA_ENV}={forced!r} is not available here (this CPU/build has: "
                           f"{', '.join(_available())})")
    return forced


def host_cores() -> int:
    """The cores this process may run on: its affinity mask (the CPU count where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_num_threads(*, local_world: int | None = None) -> int:
    """This process's share of the cores: its affinity mask split among the node's ranks
    (`local_world`; default LOCAL_WORLD_SIZE, else 1)."""
    cores = host_cores()
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local_world))


@functools.cache
def dynamic_qmap(*, signed: bool) -> Tensor:
    """bitsandbytes' dynamic-tree code (Dettmers, arXiv:1511.04561), 256 sorted FP32 values in
    [-1, 1] (signed) or [0, 1], built as torchao.optim.quant_utils.create_dynamic_map builds it
    (tests/test_cpu_adam.py checks the two are equal): for each decimal exponent 10^-6 .. 10^0,
    the midpoints of an even split of [0.1, 1] into 2^i parts (2^(i+1) unsigned), then 0 and 1.
    Built here because importing torchao takes seconds and is not needed to train."""
    exponent_bits, data_bits = 7, 7  # 8-bit codes less a sign bit (bitsandbytes counts it unsigned too)
    values: list[float] = []
    for i in range(exponent_bits):
        parts = 2 ** (i + data_bits - exponent_bits + (0 if signed else 1))
        edges = torch.linspace(0.1, 1, parts + 1)
        means = ((edges[:-1] + edges[1:]) / 2.0) * 10 ** (i - exponent_bits + 1)
        values += means.tolist()
        if signed:
            values += (-means).tolist()
    values += [0.0, 1.0]
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def _ordered(x: Tensor) -> Tensor:
    """FP32 values as int64 keys in the same order (both zeros at 0)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _unordered(key: Tensor) -> Tensor:
    bits = torch.where(key < 0, (-key) | -(2**31), key)
    return bits.to(torch.int32).view(torch.float32)


@functools.cache
def quantize_thresholds(*, signed: bool) -> Tensor:
    """For each code c of `dynamic_qmap`, the least FP32 value that torchao's
    quantize_8bit_with_qmap codes above c; the last entry is NaN (no value is). torchao takes
    the last value d <= x and steps up to the next, u, when x - d >= (u - d) * 0.5 in FP32;
    that test is monotone in x, so a bisection over the floats in [d, u] finds where it turns,
    and the kernel's code is then the count of thresholds <= x (csrc/cpu_adam.cpp QCode)."""
    qmap = dynamic_qmap(signed=signed)
    down, up = qmap[:-1], qmap[1:]
    half_gap = (up - down) * 0.5
    lo, hi = _ordered(down), _ordered(up)  # up itself codes above: x - d = u - d >= half the gap
    for _ in range(33):  # the keys of [d, u] span < 2^32
        mid = (lo + hi) // 2
        steps_up = (_unordered(mid) - down) >= half_gap
        hi, lo = torch.where(steps_up, mid, hi), torch.where(steps_up, lo, mid + 1)
    return torch.cat([_unordered(hi), torch.tensor([float("nan")])])


def moment_scales(n: int) -> int:
    """FP32 scales of `n` elements of 8-bit moments (a partial last block has its own)."""
    return -(-n // MOMENT_BLOCK)


def pin_helpers(cpus: list[int]) -> None:
    """Pin the kernel's pool helpers 1 .. len(cpus) to `cpus`, one each (slidedp/affinity.py), or
    to the calling thread's own cores where an entry is -1 (undoing a pin); the calling thread,
    worker 0 of every call it makes, stays as it is. Nothing on the torch fallback, which runs on
    torch's threads."""
    lib = _library()
    if lib is None or not cpus or active_isa() == TORCH_ISA:
        return
    failed = lib.slidedp_pin_helpers((ctypes.c_int * len(cpus))(*cpus), len(cpus))
    if failed:
        raise RuntimeError(f"pin_helpers: {failed} of {len(cpus)} helpers could not be pinned to {cpus}")


def _check(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...], numel: int, *, fn: str = "adam_update") -> None:
    if (t.device.type != "cpu" or t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous()
            or t.numel() != numel):
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{fn}: {name} must be a 1-D contiguous CPU {want} tensor of {numel} "
                         f"elements; got shape {tuple(t.shape)}, stride {t.stride()}, {t.dtype} on {t.device}")


def adam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool = True,
                grad_scale: float = 1.0, bf16_out: Tensor | None = None,
                exp_avg_scale: Tensor | None = None, exp_avg_sq_scale: Tensor | None = None,
                num_threads: int | None = None) -> None:
    """One Adam(W) step in place on a flat range, as torch.optim.AdamW/Adam(fused=True) would do it.

    param/exp_avg/exp_avg_sq: 1-D contiguous float32 CPU tensors (views into bigger buffers are fine);
    param may be bf16 instead (a BF16 master): read exactly into FP32, updated there and rounded
    back in place (round-to-nearest-even), so it takes no bf16_out. exp_avg and exp_avg_sq share one
    dtype: float32, bf16 (the step is then the FP32 step on exact FP32 copies of them, each rounded
    back to bf16 in place, round-to-nearest-even) or uint8, blockwise 8-bit codes with their FP32
    scales in exp_avg_scale / exp_avg_sq_scale (`moment_scales(n)` each; the range starts at a
    block's start): the step is the FP32 step on the dequantized moments, which are then
    requantized as torchao's AdamW8bit does (absmax per block into `dynamic_qmap`; the params
    take the unrounded moments). All-zero codes and scales are zero moments.
    grad: bf16 or float32, same length, used as grad * grad_scale. adamw=False is Adam with L2 weight
    decay. step counts from 1 (after the increment). bf16_out, when given, receives the updated
    params rounded to bf16 (round-to-nearest-even); it may be the very memory of a bf16 grad (each
    element's gradient is read before its output is written: SlideDP's shadow holds the gradient
    until the update overwrites it with the weights); apart from the gradient it is written with
    non-temporal stores on x86, which skip reading its lines first. num_threads defaults to
    `default_num_threads()`.
    """
    n = param.numel()
    _check("param", param, (torch.float32, torch.bfloat16), n)
    _check("grad", grad, (torch.bfloat16, torch.float32), n)
    moment_dtypes = tuple(_MOMENT_FORMATS)
    _check("exp_avg", exp_avg, moment_dtypes, n)
    _check("exp_avg_sq", exp_avg_sq, moment_dtypes, n)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"adam_update: exp_avg and exp_avg_sq must share one dtype (both float32, "
                         f"bfloat16 or uint8); got exp_avg {exp_avg.dtype}, exp_avg_sq {exp_avg_sq.dtype}")
    quantized = exp_avg.dtype == torch.uint8
    if quantized:
        for name, t in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
            if t is None:
                raise ValueError(f"adam_update: uint8 (8-bit) moments need {name}")
            _check(name, t, (torch.float32,), moment_scales(n))
    elif exp_avg_scale is not None or exp_avg_sq_scale is not None:
        raise ValueError(f"adam_update: scales are for uint8 (8-bit) moments, not {exp_avg.dtype}")
    if bf16_out is not None:
        _check("bf16_out", bf16_out, (torch.bfloat16,), n)
        if param.dtype == torch.bfloat16:
            raise ValueError("adam_update: bf16 params are their own bf16 output; pass no bf16_out")
    if step < 1:
        raise ValueError(f"adam_update: step counts from 1, got {step}")
    threads = default_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"adam_update: num_threads must be >= 1, got {threads}")
    isa = active_isa()
    if n == 0:
        return
    if isa == TORCH_ISA:
        _torch_update(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, bf16_out=bf16_out,
                      scales=(exp_avg_scale, exp_avg_sq_scale) if quantized else None)
        return
    maps = ((dynamic_qmap(signed=True), dynamic_qmap(signed=False), quantize_thresholds(signed=True),
             quantize_thresholds(signed=False)) if quantized else ())
    rc = _library().slidedp_cpu_adam_update(
        _ISA_CODES[isa], param.data_ptr(), int(param.dtype == torch.bfloat16), grad.data_ptr(),
        int(grad.dtype == torch.bfloat16),
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _MOMENT_FORMATS[exp_avg.dtype],
        exp_avg_scale.data_ptr() if quantized else None, exp_avg_sq_scale.data_ptr() if quantized else None,
        *(t.data_ptr() for t in maps) if maps else (None,) * 4,
        None if bf16_out is None else bf16_out.data_ptr(),
        n, step, lr, beta1, beta2, eps, weight_decay, int(adamw), grad_scale, threads)
    if rc != 0:
        raise RuntimeError(f"adam_update: the kernel refused ISA {isa!r} (code {rc})")


def grad_accumulate(acc: Tensor, src: Tensor, *, assign: bool, want_sumsq: bool,
                    num_threads: int | None = None) -> float:
    """acc = src (assign) or acc + src, in one multi-threaded pass that also returns the sum of
    squares of the result when `want_sumsq` (else 0.0). acc: 1-D contiguous float32 CPU tensor;
    src: bf16 or float32, same length. The sum does not depend on the thread count."""
    n = acc.numel()
    _check("acc", acc, (torch.float32,), n, fn="grad_accumulate")
    _check("src", src, (torch.bfloat16, torch.float32), n, fn="grad_accumulate")
    if active_isa() == TORCH_ISA:
        if assign:
            acc.copy_(src)
        else:
            acc.add_(src)
        return float(torch.dot(acc, acc)) if want_sumsq else 0.0
    threads = default_num_threads() if num_threads is None else num_threads
    return _library().slidedp_grad_accumulate(acc.data_ptr(), src.data_ptr(), int(src.dtype == torch.bfloat16),
                                              n, int(assign), int(want_sumsq), threads)


def stream_triad(a: Tensor, b: Tensor, c: Tensor, *, scalar: float, num_threads: int) -> str:
    """a = b + scalar * c (1-D contiguous float64 CPU tensors of one length) with STREAM's loop on
    the update's thread pool; torch.add on torch's threads where the kernel cannot be built, or
    SLIDEDP_CPU_ADAM_ISA=torch. Returns which ran: "slidedp" or "torch"."""
    n = a.numel()
    for name, t in (("a", a), ("b", b), ("c", c)):
        _check(name, t, (torch.float64,), n, fn="stream_triad")
    if num_threads < 1:
        raise ValueError(f"stream_triad: num_threads must be >= 1, got {num_threads}")
    if active_isa() == TORCH_ISA:
        torch.add(b, c, alpha=scalar, out=a)
        return TORCH_ISA
    _library().slidedp_stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), scalar, n, num_threads)
    return "slidedp"


def _torch_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool, grad_scale: float,
                  bf16_out: Tensor | None, scales: tuple[Tensor, Tensor] | None) -> None:
    """The fallback: torch's fused kernel plus the casts around it (torch's intra-op threads). BF16
    params or moments are widened to FP32 copies and copied back (`copy_` into bf16 rounds to nearest
    even, as the kernel does); 8-bit moments are dequantized and requantized as torchao does."""
    if grad.dtype != torch.float32 or grad_scale != 1.0:
        grad = grad.float() * grad_scale
    if param.dtype == torch.bfloat16:
        param, bf16_out = param.float(), param
    stored = (exp_avg, exp_avg_sq)
    if scales is not None:
        exp_avg, exp_avg_sq = (dequantize_moment(c, s, signed=signed)
                               for c, s, signed in zip(stored, scales, (True, False)))
    elif exp_avg.dtype == torch.bfloat16:
        exp_avg, exp_avg_sq = exp_avg.float(), exp_avg_sq.float()
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    fused([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
          beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    for i, (dst, src) in enumerate(zip(stored, (exp_avg, exp_avg_sq))):
        if scales is not None:
            quantize_moment(src, signed=i == 0, codes=dst, scale=scales[i])
        elif dst.dtype != torch.float32:
            dst.copy_(src)
    if bf16_out is not None:
        bf16_out.copy_(param)


def _blocks(x: Tensor) -> Tensor:
    """x as rows of MOMENT_BLOCK, zero-padded (a zero changes no block's absmax)."""
    pad = -x.numel() % MOMENT_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, MOMENT_BLOCK)


def dequantize_moment(codes: Tensor, scale: Tensor, *, signed: bool) -> Tensor:
    """FP32 values of 8-bit moment codes and their block scales (exp_avg: signed), as torchao's
    dequant_with_qmap computes them (table value times the block's scale)."""
    values = dynamic_qmap(signed=signed)[codes.long()]
    return (_blocks(values) * scale.view(-1, 1)).view(-1)[:codes.numel()]


def quantize_moment(x: Tensor, *, signed: bool, codes: Tensor, scale: Tensor) -> None:
    """8-bit codes and block scales of FP32 `x` into `codes` and `scale`, the ones torchao's
    scale_tensor and quantize_8bit_with_qmap give (tests/test_cpu_adam.py): each block divided by
    its absmax (at least 1e-12), coded by counting `quantize_thresholds`, as the kernel does."""
    blocks = _blocks(x)
    block_scale = blocks.abs().amax(dim=1).clamp(min=1e-12)
    scaled = (blocks / block_scale.view(-1, 1)).view(-1)[:x.numel()]
    thresholds = quantize_thresholds(signed=signed)[:-1].contiguous()
    codes.copy_(torch.searchsorted(thresholds, scaled, right=True))
    scale.copy_(block_scale)
