"""Measure this machine's rates (slidedp/plan/rates.py) and cache them.

Machine rates, once per machine: pinned H2D and D2H per device with one device copying and with
every rank's device copying at once, the latency of one copy; with several ranks the
all-gather and reduce-scatter of a block over the process group and their latency; on rank 0
alone, CPU AdamW (the runtime's kernel), the host gradient sum and the FP32 -> BF16 cast by
thread count, and host memory bandwidth (STREAM triad, slidedp/plan/triad.py). Model rates,
once per model and sequence length: on rank 0, one block of the model on the device (its
kernels, the run's compute dtype, random weights) timed forward and backward under each policy
at the run's micro-batch (fewer sequences if it would not fit, then divided per sequence), the
head with the loss and the embedding; each policy's activation bytes (slidedp/activations/cost.py,
SlideDP's BF16 blocks); and the effective TFLOP/s of the FLOP model fitted to the kept block. On
the CPU the device is the CPU and the same code runs (copies are memory copies, collectives are
gloo's, the device's memory bandwidth is the triad's), so the planner can be tested without a
GPU; a model too large to time there is refused before anything is measured.

The cache: `rates.cache_path(machine, model)` holds both (a file per machine alone as well), so
a second run on the same machine and model measures nothing; `refresh=True` measures again.
"""

import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from models.kernels import Kernels
from protocols.model_spec import ModelArgs, spec_of
from slidedp import cpu_adam
from slidedp.activations import (KEEP, RECOMPUTE, ActivationPolicy, BlockSegments, block_input,
                                 measure_costs, parse_policy)
from slidedp.collectives import all_gather_single, reduce_scatter_single
from slidedp.host_state import total_host_bytes
from slidedp.plan.rates import (BlockTiming, Machine, Rates, cache_dir, cache_path, load_rates,
                                model_key, shipped_names, this_host, timing_key)
from slidedp.plan.triad import triad_gbs
from slidedp.plan.workload import segment_flops

PROBE_CPU_MAX_PARAMS = 2_000_000_000
"""On the CPU, models above this size are not timed (a block would take minutes): plan them
from a rates file of their GPU machine."""

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""A run's compute dtype by its name in the configuration (training.dtype)."""


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

    @classmethod
    def for_device(cls, device: torch.device) -> "ProbeSizes":
        """The defaults on a GPU; small buffers on the CPU, whose rates serve tests and CPU runs
        (the CPU's own memory copies are no PCIe to characterize)."""
        return cls() if device.type == "cuda" else cls(copy_mib=16, host_elems=4_000_000)


_WARMUP = 2
"""Untimed runs of a block before its timed ones (allocator, kernel selection, caches)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], None], *, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _thread_counts(cores: int) -> list[int]:
    counts = [1 << i for i in range(cores.bit_length()) if 1 << i < cores]
    return counts + [cores]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _barrier(group) -> None:
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
            _barrier(group)
            if r == rank:
                out[f"{direction}_gbs"] = n * 2 / _median_seconds(fn, device=device,
                                                                  repeats=sizes.repeats) / 1e9
        _barrier(group)
        out[f"{direction}_together_gbs"] = n * 2 / _median_seconds(fn, device=device,
                                                                   repeats=sizes.repeats) / 1e9
    small_h, small_d = host[:2048], dev[:2048]
    out["copy_latency_s"] = _median_seconds(lambda: small_d.copy_(small_h, non_blocking=True),
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
        _barrier(group)
        return _median_seconds(fn, device=device, repeats=sizes.repeats)

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
        for t in _thread_counts(cores):
            torch.set_num_threads(t)
            adam[t] = n / _median_seconds(lambda: adam_pass(t), device=cpu, repeats=sizes.repeats) / 1e9
            adam_8bit[t] = n / _median_seconds(lambda: adam_pass(t, moments_8bit=True), device=cpu,
                                               repeats=sizes.repeats) / 1e9
            gsum[t] = n / _median_seconds(
                lambda: cpu_adam.grad_accumulate(acc, g, assign=False, want_sumsq=False,
                                                 num_threads=t),
                device=cpu, repeats=sizes.repeats) / 1e9
            cast[t] = 4 * n / _median_seconds(lambda: pinned.copy_(p), device=cpu,
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
    cores = _cores()
    say = log if rank == 0 else (lambda _: None)
    copies = _copies(device, rank=rank, world=world, group=group, sizes=sizes, log=say)
    collectives = _collectives(device, world=world, group=group, sizes=sizes, log=say)
    host: dict = {}
    if rank == 0:
        host = _host(device, cores=cores, sizes=sizes, log=say)
    _barrier(group)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # On the CPU the device's memory is the host's.
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else total_host_bytes())
    machine = Machine(name=f"{world} x {name}, {cores} cores ({this_host()})", source="measured",
                      hostname=this_host(), device=name, devices=world, cores=cores,
                      device_memory_gib=memory / 2**30, host_memory_gib=total_host_bytes() / 2**30,
                      note=f"measured by slidedp.plan.probe on {time.strftime('%Y-%m-%d')}")
    rates = None
    if rank == 0:
        # Where the device is the CPU its memory is the host's: the triad's bandwidth.
        bandwidth = {"hbm_gbs": host["dram_gbs"]} if device.type == "cpu" else {}
        rates = Rates(machine=machine, **copies, **collectives, **host, **bandwidth, gpu_tflops={})
    return _share(rates, group)


def _share(obj, group):
    if group is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


# ---- model rates -------------------------------------------------------------------------------


def _block(args: ModelArgs, kernels: Kernels, device: torch.device,
           dtype: torch.dtype) -> nn.Module:
    spec = spec_of(args)
    with torch.device("meta"):
        block = spec.block_cls(args, kernels).to(dtype)
    block = block.to_empty(device=device)
    with torch.no_grad():
        for name, p in block.named_parameters():
            spec.init_parameter(name, p)
    return block


def _time_block(policy: ActivationPolicy, block: nn.Module, args: ModelArgs, *, batch: int,
                seq: int, device: torch.device, repeats: int) -> BlockTiming:
    weights = dict(block.named_parameters())
    rope = spec_of(args).rope_tables(args, seq, device)
    h = torch.randn(batch, seq, args.dim, device=device, dtype=next(block.parameters()).dtype)
    grad = torch.randn_like(h)
    forward, backward = [], []
    for i in range(repeats + _WARMUP):
        sink: list[torch.Tensor] = []
        _sync(device)
        t0 = time.perf_counter()
        out = policy.forward(BlockSegments(block), block_input(h, sink), weights, rope)
        _sync(device)
        t1 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        t2 = time.perf_counter()
        del out, sink
        for w in weights.values():
            w.grad = None
        if i >= _WARMUP:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return BlockTiming(forward_s=statistics.median(forward) / batch,
                       backward_s=statistics.median(backward) / batch, batch=batch)


def _time_head_and_embed(args: ModelArgs, kernels: Kernels, *, batch: int, seq: int,
                         loss_chunk: int, device: torch.device, dtype: torch.dtype,
                         repeats: int) -> dict[str, BlockTiming]:
    spec, on = spec_of(args), dict(dtype=dtype, device=device)
    units = dict(spec.units(args))  # the embedding's and the head's parameters by kind

    def drawn(kind: str) -> dict[str, torch.Tensor]:
        weights = {}
        for name, local, shape in units[kind]:
            weights[local] = torch.empty(shape, **on)
            spec.init_parameter(name, weights[local])
        return {local: w.requires_grad_() for local, w in weights.items()}

    emb, head = drawn("embed"), drawn("head")
    head_loss = spec.head_loss(args, kernels)
    tokens = torch.randint(args.vocab_size, (batch, seq), device=device)
    h = torch.randn(batch, seq, args.dim, **on)

    def head_step() -> None:
        x = h.detach().requires_grad_()
        head_loss(head, emb, x, tokens, chunk_tokens=loss_chunk).backward()
        for w in (*head.values(), *emb.values()):
            w.grad = None

    out = {"head": BlockTiming(forward_s=_median_seconds(head_step, device=device, repeats=repeats)
                               / batch, backward_s=0.0, batch=batch)}
    grad = torch.randn(batch, seq, args.dim, **on)
    state: dict = {}

    def embed_forward() -> None:
        state["h"] = spec.embed(emb, tokens)

    def embed_backward() -> None:
        embed_forward()
        state["h"].backward(grad)
        for w in emb.values():
            w.grad = None

    fwd = _median_seconds(embed_forward, device=device, repeats=repeats)
    both = _median_seconds(embed_backward, device=device, repeats=repeats)
    out["embed"] = BlockTiming(forward_s=fwd / batch, backward_s=max(both - fwd, 0.0) / batch,
                               batch=batch)
    return out


def _probe_batch(keep_bytes_per_seq: float, batch: int, device: torch.device,
                 sizes: ProbeSizes) -> int:
    """The largest micro-batch <= `batch` whose kept activations fit the probe's share of the
    device's free memory (the block is timed per sequence)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = 8 * 2**30
    fits = int(free * sizes.block_memory_fraction // max(keep_bytes_per_seq, 1))
    return max(1, min(batch, fits))


def probe_model(rates: Rates, args: ModelArgs, *, flavor: str, kernels: Kernels,
                policies: Iterable[ActivationPolicy], seq: int, batch: int, loss_chunk: int,
                device: torch.device, compute_dtype: Literal["bf16", "fp32"] = "bf16",
                sizes: ProbeSizes = ProbeSizes(),
                log: Callable[[str], None] = print) -> Rates:
    """`rates` with the timings and costs of `policies` (and the head, the embedding) of the
    model at `seq` in `compute_dtype` added, where they are not there yet."""
    key = model_key(args, kernels.name, compute_dtype)
    if rates.model not in ("", key):
        raise ValueError(f"these rates hold another model's timings ({rates.model})")
    blocks, costs = dict(rates.blocks), dict(rates.costs)
    policies = list(dict.fromkeys(policies))
    new_costs = [p for p in policies if timing_key(p.name, seq) not in costs]
    if new_costs:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            measured = measure_costs(new_costs, args, kernels, device=device, seq_len=seq)
        costs.update({timing_key(p.name, seq): c for p, c in measured.items()})
    bases = list(dict.fromkeys(p.base for p in policies))
    missing = [b for b in bases if timing_key(b, seq) not in blocks]
    keep_key = timing_key("keep", seq)
    if missing or timing_key("head", seq) not in blocks:
        keep_cost = costs.get(keep_key) or measure_costs(
            [KEEP], args, kernels, device=device, seq_len=seq)[KEEP]
        costs.setdefault(keep_key, keep_cost)
        dtype = DTYPES[compute_dtype]
        # The costs are of BF16 blocks: FP32 keeps twice their bytes.
        b = _probe_batch(keep_cost.gpu.at(1, seq) * dtype.itemsize / 2, batch, device, sizes)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            block = _block(args, kernels, device, dtype)
            # A first use of each kind of op (checkpointing, SDPA, kernel selection) costs far
            # more than its steady state; the engine pays it once at its first step.
            for warm in (KEEP, RECOMPUTE):
                _time_block(warm, block, args, batch=b, seq=seq, device=device, repeats=1)
            for base in missing:
                blocks[timing_key(base, seq)] = _time_block(parse_policy(base), block, args, batch=b,
                                                            seq=seq, device=device,
                                                            repeats=sizes.repeats)
            del block
            if timing_key("head", seq) not in blocks:
                for what, t in _time_head_and_embed(args, kernels, batch=b, seq=seq,
                                                    loss_chunk=loss_chunk, device=device,
                                                    dtype=dtype, repeats=sizes.repeats).items():
                    blocks[timing_key(what, seq)] = t
        for base in missing:
            t = blocks[timing_key(base, seq)]
            log(f"block under {base}: forward {t.forward_s * 1e3:.2f} ms, backward "
                f"{t.backward_s * 1e3:.2f} ms per sequence of {seq} (timed at {t.batch})")
    tflops = dict(rates.gpu_tflops)
    keep = blocks.get(keep_key)
    if keep is not None:  # the FLOP model's rate for policies never timed, fitted to keep
        flops = 3 * sum(segment_flops(args, seq).values()) * seq
        tflops[f"{flavor}/{kernels.name}"] = flops / (keep.forward_s + keep.backward_s) / 1e12
    return replace(rates.with_model(key, blocks, costs), gpu_tflops=tflops,
                   compute_dtype=compute_dtype)


def probe(args: ModelArgs, *, flavor: str, kernels: Kernels, policies: Iterable[ActivationPolicy],
          seq: int, batch: int, loss_chunk: int, device: torch.device,
          compute_dtype: Literal["bf16", "fp32"] = "bf16", rank: int = 0, world: int = 1,
          group=None, refresh: bool = False, sizes: ProbeSizes | None = None,
          log: Callable[[str], None] = print) -> Rates:
    """The rates of this machine and model in `compute_dtype`: from the cache, measuring only
    what is missing (all of it with `refresh`), and the cache updated. Every rank calls it; rank
    0 measures the host and the model and writes the files, every rank returns the same Rates."""
    if device.type == "cpu" and args.num_params() > PROBE_CPU_MAX_PARAMS:
        raise ValueError(f"{flavor} ({args.num_params() / 1e9:.1f}B parameters) is too large to "
                         f"time on the CPU: plan it from the rates of its GPU machine ([plan] "
                         f"rates or --rates: a file, or one shipped: {shipped_names()})")
    say = log if rank == 0 else (lambda _: None)
    sizes = sizes or ProbeSizes.for_device(device)
    machine_rates = _cached_machine(device, world) if not refresh else None
    if machine_rates is None:
        say(f"[probe] measuring this machine ({world} rank(s) on {device.type})")
        machine_rates = probe_machine(device, rank=rank, world=world, group=group, sizes=sizes, log=say)
        if rank == 0:
            machine_rates.save(cache_dir() / f"{machine_rates.machine.key()}.json")
    key = model_key(args, kernels.name, compute_dtype)
    path = cache_path(machine_rates.machine, key)
    rates = None
    if rank == 0:
        rates = load_rates(str(path)) if path.is_file() and not refresh else machine_rates.with_model(key, {}, {})
        before = (len(rates.blocks), len(rates.costs))
        rates = probe_model(rates, args, flavor=flavor, kernels=kernels, policies=policies, seq=seq,
                            batch=batch, loss_chunk=loss_chunk, device=device,
                            compute_dtype=compute_dtype, sizes=sizes, log=say)
        if (len(rates.blocks), len(rates.costs)) != before or not path.is_file():
            rates.save(path)
            say(f"[probe] rates cached in {path}")
    _barrier(group)
    return _share(rates, group)


def _cached_machine(device: torch.device, world: int) -> Rates | None:
    """This machine's cached rates, if any (the key: host, device name and count, cores)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    probe_key = Machine(name="", source="measured", hostname=this_host(), device=name,
                        devices=world, cores=_cores(), device_memory_gib=0, host_memory_gib=0).key()
    path = cache_dir() / f"{probe_key}.json"
    return load_rates(str(path)) if path.is_file() else None
