"""This machine's rates (slidedp/plan/rates.py), measured once per machine: pinned H2D and D2H
per device with one device copying and with every rank's device copying at once, the latency of
one copy; with several ranks the all-gather and reduce-scatter of a block over the process group
and their latency; on rank 0 alone, CPU AdamW (the runtime's kernel), the host gradient sum and
the FP32 -> BF16 cast by thread count, and host memory bandwidth (STREAM triad,
slidedp/plan/triad.py). On the CPU the device is the CPU and the same code runs (copies are
memory copies, collectives are gloo's). slidedp/plan/probe.py times the model and caches both.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slidedp import cpu_adam
from slidedp.collectives import all_gather_single, reduce_scatter_single
from slidedp.host_state import total_host_bytes
from slidedp.plan.rates import Machine, Rates, this_host
from slidedp.plan.triad import triad_gbs


@dataclass(frozen=True)
class ProbeSizes:
    """How much each measurement moves (tests make them small)."""

    copy_mib: int = 256
    """Bytes of each timed copy and collective (MiB)."""
    host_elems: int = 64_000_000
    """Elements of the host measurements (Adam, gradient sum, cast, triad)."""
    repeats: int = 3
    """Timed repetitions (the median is kept) after one warm-up."""
    block_memory_fraction: float = 0.3
    """Share of the free device memory a timed block's activations may take."""
    block_min_batch: int = 8
    """Sequences a block and the head are timed at, at least, where they fit: at fewer, the GPU
    waits on the host's launches, and a per-sequence time taken there would count those waits
    again at every batch (the launches are counted apart: Rates.issue_s)."""

    @classmethod
    def for_device(cls, device: torch.device) -> "ProbeSizes":
        """The defaults on a GPU; small buffers on the CPU, whose rates serve tests and CPU runs
        (the CPU's own memory copies are no PCIe to characterize, and it launches nothing)."""
        return cls() if device.type == "cuda" else cls(copy_mib=16, host_elems=4_000_000,
                                                       block_min_batch=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def issue_and_run_seconds(fn: Callable[[], None], *, device: torch.device,
                          repeats: int) -> tuple[float, float]:
    """Median seconds of `fn` (after one untimed call) to return, its kernels issued, and to
    finish on the device. Where the device is the CPU its ops run as they are issued: the first
    is 0 (no issue time apart from the run)."""
    fn()
    sync(device)
    issued, done = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        sync(device)
        issued.append(returned - start if device.type == "cuda" else 0.0)
        done.append(time.perf_counter() - start)
    return statistics.median(issued), statistics.median(done)


def median_seconds(fn: Callable[[], None], *, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` to finish on the device (after one untimed call)."""
    return issue_and_run_seconds(fn, device=device, repeats=repeats)[1]


def thread_counts(cores: int) -> list[int]:
    counts = [1 << i for i in range(cores.bit_length()) if 1 << i < cores]
    return counts + [cores]


def barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


# ---- machine rates -----------------------------------------------------------------------------


def _copies(device: torch.device, *, rank: int, world: int, group, sizes: ProbeSizes,
            log: Callable[[str], None]) -> dict[str, float]:
    """H2D and D2H GB/s per device alone (ranks take turns) and together, and one copy's
    latency."""
    n = sizes.copy_mib * 2**20 // 2
    pin = device.type == "cuda"
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin).fill_(1)
    dev = torch.empty(n, dtype=torch.bfloat16, device=device)
    copies = {"h2d": lambda: dev.copy_(host, non_blocking=True),
              "d2h": lambda: host.copy_(dev, non_blocking=True)}
    out = {}
    for direction, fn in copies.items():
        for r in range(world):  # alone: one rank at a time
            barrier(group)
            if r == rank:
                out[f"{direction}_gbs"] = n * 2 / median_seconds(fn, device=device,
                                                                  repeats=sizes.repeats) / 1e9
        barrier(group)
        out[f"{direction}_together_gbs"] = n * 2 / median_seconds(fn, device=device,
                                                                   repeats=sizes.repeats) / 1e9
    small_h, small_d = host[:2048], dev[:2048]
    out["copy_latency_s"] = median_seconds(lambda: small_d.copy_(small_h, non_blocking=True),
                                            device=device, repeats=max(sizes.repeats, 10))
    log(f"copies: H2D {out['h2d_gbs']:.1f} GB/s alone, {out['h2d_together_gbs']:.1f} with "
        f"{world} at once; D2H {out['d2h_gbs']:.1f} / {out['d2h_together_gbs']:.1f}; "
        f"latency {out['copy_latency_s'] * 1e6:.0f} us")
    return out


def _collectives(device: torch.device, *, world: int, group, sizes: ProbeSizes,
                 log: Callable[[str], None]) -> dict[str, float]:
    """All-gather and reduce-scatter of `copy_mib` MiB (bytes of the whole buffer per second)
    and one small collective's latency; nothing to measure on one rank."""
    if world == 1 or group is None:
        return {"all_gather_gbs": 1e6, "reduce_scatter_gbs": 1e6, "collective_latency_s": 0.0}
    n = sizes.copy_mib * 2**20 // 2 // world * world
    full = torch.ones(n, dtype=torch.bfloat16, device=device)
    part = torch.ones(n // world, dtype=torch.bfloat16, device=device)

    def timed(fn) -> float:
        barrier(group)
        return median_seconds(fn, device=device, repeats=sizes.repeats)

    out = {"all_gather_gbs": n * 2 / timed(lambda: all_gather_single(full, part, group=group)) / 1e9,
           "reduce_scatter_gbs": n * 2 / timed(lambda: reduce_scatter_single(part, full, group=group)) / 1e9}
    tiny_full, tiny_part = full[:1024 * world], part[:1024]
    out["collective_latency_s"] = timed(lambda: all_gather_single(tiny_full, tiny_part, group=group))
    log(f"collectives over {world} ranks: all-gather {out['all_gather_gbs']:.1f} GB/s, "
        f"reduce-scatter {out['reduce_scatter_gbs']:.1f} GB/s, latency "
        f"{out['collective_latency_s'] * 1e6:.0f} us")
    return out


def _host(device: torch.device, *, cores: int, sizes: ProbeSizes,
          log: Callable[[str], None]) -> dict[str, object]:
    """AdamW, gradient sum and cast by thread count; the triad with every core."""
    n = sizes.host_elems
    p, m, v = torch.randn(n) * 0.02, torch.zeros(n), torch.zeros(n)
    g, shadow = torch.randn(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    acc = torch.zeros(n)
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    scales = cpu_adam.moment_scales(n)
    m8, v8 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    m8_scale, v8_scale = torch.zeros(scales), torch.zeros(scales)
    adam, adam_8bit, gsum, cast = {}, {}, {}, {}
    before = torch.get_num_threads()
    step = [0]

    def adam_pass(threads: int, *, moments_8bit: bool = False) -> None:
        step[0] += 1
        moments = ({"exp_avg": m8, "exp_avg_sq": v8, "exp_avg_scale": m8_scale,
                    "exp_avg_sq_scale": v8_scale} if moments_8bit else {"exp_avg": m, "exp_avg_sq": v})
        cpu_adam.adam_update(p, g, **moments, step=step[0], lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8,
                             weight_decay=0.1, bf16_out=shadow, num_threads=threads)

    cpu = torch.device("cpu")
    try:
        for t in thread_counts(cores):
            torch.set_num_threads(t)
            adam[t] = n / median_seconds(lambda: adam_pass(t), device=cpu, repeats=sizes.repeats) / 1e9
            adam_8bit[t] = n / median_seconds(lambda: adam_pass(t, moments_8bit=True), device=cpu,
                                               repeats=sizes.repeats) / 1e9
            gsum[t] = n / median_seconds(
                lambda: cpu_adam.grad_accumulate(acc, g, assign=False, want_sumsq=False,
                                                 num_threads=t),
                device=cpu, repeats=sizes.repeats) / 1e9
            cast[t] = 4 * n / median_seconds(lambda: pinned.copy_(p), device=cpu,
                                              repeats=sizes.repeats) / 1e9
    finally:
        torch.set_num_threads(before)
    dram = triad_gbs(elements=n, threads=cores, repeats=sizes.repeats)
    log(f"host: AdamW {adam[max(adam)]:.2f} Gparam/s at {max(adam)} threads "
        f"({adam[1]:.2f} at 1; 8-bit moments {adam_8bit[max(adam)]:.2f}), gradient sum {gsum[max(gsum)]:.2f} Gelem/s, cast "
        f"{cast[max(cast)]:.1f} GB/s, STREAM triad {dram:.1f} GB/s")
    return {"adam_gparams": adam, "adam_8bit_gparams": adam_8bit, "grad_sum_gelems": gsum,
            "cast_gbs": cast, "dram_gbs": dram}


def probe_machine(device: torch.device, *, rank: int = 0, world: int = 1, group=None,
                  sizes: ProbeSizes = ProbeSizes(),
                  log: Callable[[str], None] = print) -> Rates:
    """This machine's rates with `world` ranks (each calls it; `group` spans them). Every rank
    returns rank 0's figures."""
    cores = cpu_adam.host_cores()
    say = log if rank == 0 else (lambda _: None)
    copies = _copies(device, rank=rank, world=world, group=group, sizes=sizes, log=say)
    collectives = _collectives(device, world=world, group=group, sizes=sizes, log=say)
    host: dict = {}
    if rank == 0:
        host = _host(device, cores=cores, sizes=sizes, log=say)
    barrier(group)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # On the CPU the device's memory is the host's.
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else total_host_bytes())
    machine = Machine(name=f"{world} x {name}, {cores} cores ({this_host()})", source="measured",
                      hostname=this_host(), device=name, devices=world, cores=cores,
                      device_memory_gib=memory / 2**30, host_memory_gib=total_host_bytes() / 2**30,
                      note=f"measured by slidedp.plan.probe_machine on {time.strftime('%Y-%m-%d')}")
    rates = None
    if rank == 0:
        # Where the device is the CPU its memory is the host's: the triad's bandwidth.
        bandwidth = {"hbm_gbs": host["dram_gbs"]} if device.type == "cpu" else {}
        rates = Rates(machine=machine, **copies, **collectives, **host, **bandwidth, gpu_tflops={})
    return share(rates, group)


def share(obj, group):
    if group is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
