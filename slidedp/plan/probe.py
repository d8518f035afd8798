"""Measure this machine's and this model's rates (slidedp/plan/rates.py) and cache them.

Machine rates, once per machine: slidedp/plan/probe_machine.py. Model rates, once per model and
sequence length: on rank 0, one block of the model on the device (its kernels, the run's compute
dtype, random weights) timed forward and backward under each policy at the run's micro-batch or
ProbeSizes.block_min_batch if more (fewer sequences if that would not fit; a timing cached below
that floor is timed again), then divided per sequence, the head with the loss and the
embedding, and the host seconds to issue each of these (their kernels launched, before they run);
each policy's activation bytes (slidedp/activations/cost.py, SlideDP's BF16 blocks);
and the effective TFLOP/s of the FLOP model fitted to the kept block. On the CPU the device is
the CPU and the same code runs, so the planner can be tested without a GPU; a model too large to
time there is refused before anything is measured.

The cache: `rates.cache_path(machine, model)` holds both (a file per machine alone as well), so
a second run on the same machine and model measures nothing; `refresh=True` measures again.
"""

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Literal

import torch
from torch import nn

from models.kernels import Kernels
from models.meta import on_meta
from protocols.model_spec import ModelArgs, spec_of
from slidedp.activations import (KEEP, RECOMPUTE, ActivationPolicy, BlockSegments, block_input,
                                 measure_costs, parse_policy)
from slidedp.cpu_adam import host_cores
from slidedp.plan.probe_machine import (ProbeSizes, barrier, issue_and_run_seconds, probe_machine,
                                        share, sync)
from slidedp.plan.rates import (BlockTiming, Machine, Rates, cache_dir, cache_path, load_rates,
                                issue_key, model_key, shipped_names, this_host, timing_key)
from slidedp.plan.workload import segment_flops


PROBE_CPU_MAX_PARAMS = 2_000_000_000
"""On the CPU, models above this size are not timed (a block would take minutes): plan them
from a rates file of their GPU machine."""

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""A run's compute dtype by its name in the configuration (training.dtype)."""
_WARMUP = 2
"""Untimed runs of a block before its timed ones (allocator, kernel selection, caches)."""


# ---- model rates -------------------------------------------------------------------------------


def _block(args: ModelArgs, kernels: Kernels, device: torch.device,
           dtype: torch.dtype) -> nn.Module:
    spec = spec_of(args)
    with on_meta():
        block = spec.block_cls(args, kernels).to(dtype)
    block = block.to_empty(device=device)
    with torch.no_grad():
        for name, p in block.named_parameters():
            spec.init_parameter(name, p)
    return block


def _time_block(policy: ActivationPolicy, block: nn.Module, args: ModelArgs, *, batch: int,
                seq: int, device: torch.device, repeats: int) -> tuple[BlockTiming, dict[str, float]]:
    """The block's timing under `policy` per sequence, and the host seconds to issue its
    forward and backward (per micro-batch: the same at any batch)."""
    weights = dict(block.named_parameters())
    rope = spec_of(args).rope_tables(args, seq, device)
    h = torch.randn(batch, seq, args.dim, device=device, dtype=next(block.parameters()).dtype)
    grad = torch.randn_like(h)
    forward, backward, issue_forward, issue_backward = [], [], [], []
    cuda = device.type == "cuda"
    for i in range(repeats + _WARMUP):
        sink: list[torch.Tensor] = []
        sync(device)
        t0 = time.perf_counter()
        out = policy.forward(BlockSegments(block), block_input(h, sink), weights, rope)
        t0_issued = time.perf_counter()
        sync(device)
        t1 = time.perf_counter()
        out.backward(grad)
        t1_issued = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        del out, sink
        for w in weights.values():
            w.grad = None
        if i >= _WARMUP:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            issue_forward.append(t0_issued - t0 if cuda else 0.0)
            issue_backward.append(t1_issued - t1 if cuda else 0.0)
    base = policy.base
    return (BlockTiming(forward_s=statistics.median(forward) / batch,
                        backward_s=statistics.median(backward) / batch, batch=batch),
            {f"{base}/forward": statistics.median(issue_forward),
             f"{base}/backward": statistics.median(issue_backward)})


def _time_head_and_embed(args: ModelArgs, kernels: Kernels, *, batch: int, seq: int,
                         loss_chunk: int, device: torch.device, dtype: torch.dtype,
                         repeats: int) -> tuple[dict[str, BlockTiming], dict[str, float]]:
    """The head's (forward and backward as one) and the embedding's timings per sequence, and
    the host seconds to issue each (per micro-batch)."""
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

    head_issue, head_s = issue_and_run_seconds(head_step, device=device, repeats=repeats)
    out = {"head": BlockTiming(forward_s=head_s / batch, backward_s=0.0, batch=batch)}
    grad = torch.randn(batch, seq, args.dim, **on)
    state: dict = {}

    def embed_forward() -> None:
        state["h"] = spec.embed(emb, tokens)

    def embed_backward() -> None:
        embed_forward()
        state["h"].backward(grad)
        for w in emb.values():
            w.grad = None

    fwd_issue, fwd = issue_and_run_seconds(embed_forward, device=device, repeats=repeats)
    both_issue, both = issue_and_run_seconds(embed_backward, device=device, repeats=repeats)
    out["embed"] = BlockTiming(forward_s=fwd / batch, backward_s=max(both - fwd, 0.0) / batch,
                               batch=batch)
    return out, {"head": head_issue, "embed/forward": fwd_issue,
                 "embed/backward": max(both_issue - fwd_issue, 0.0)}


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
    blocks, costs, issue = dict(rates.blocks), dict(rates.costs), dict(rates.issue_s)
    policies = list(dict.fromkeys(policies))
    new_costs = [p for p in policies if timing_key(p.name, seq) not in costs]
    if new_costs:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            measured = measure_costs(new_costs, args, kernels, device=device, seq_len=seq)
        costs.update({timing_key(p.name, seq): c for p, c in measured.items()})
    bases = list(dict.fromkeys(p.base for p in policies))
    keep_key = timing_key("keep", seq)
    keep_cost = costs.get(keep_key) or measure_costs(
        [KEEP], args, kernels, device=device, seq_len=seq)[KEEP]
    costs.setdefault(keep_key, keep_cost)
    dtype = DTYPES[compute_dtype]
    # The costs are of BF16 blocks: FP32 keeps twice their bytes.
    b = _probe_batch(keep_cost.gpu.at(1, seq) * dtype.itemsize / 2,
                     max(batch, sizes.block_min_batch), device, sizes)
    # A timing cached at fewer sequences than the floor, where more fit now, is timed again.
    floor = min(sizes.block_min_batch, b)
    timed = {k for k, t in blocks.items() if t.batch >= floor}
    missing = [base for base in bases if timing_key(base, seq) not in timed]
    head_missing = timing_key("head", seq) not in timed
    if missing or head_missing:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            block = _block(args, kernels, device, dtype)
            # A first use of each kind of op (checkpointing, SDPA, kernel selection) costs far
            # more than its steady state; the engine pays it once at its first step.
            for warm in (KEEP, RECOMPUTE):
                _time_block(warm, block, args, batch=b, seq=seq, device=device, repeats=1)
            issued: dict[str, float] = {}
            for base in missing:
                blocks[timing_key(base, seq)], times = _time_block(
                    parse_policy(base), block, args, batch=b, seq=seq, device=device,
                    repeats=sizes.repeats)
                issued.update(times)
            del block
            if head_missing:
                timings, times = _time_head_and_embed(args, kernels, batch=b, seq=seq,
                                                      loss_chunk=loss_chunk, device=device,
                                                      dtype=dtype, repeats=sizes.repeats)
                blocks.update({timing_key(what, seq): t for what, t in timings.items()})
                issued.update(times)
        issue.update({issue_key(kernels.name, what): s for what, s in issued.items()})
        for base in missing:
            t = blocks[timing_key(base, seq)]
            log(f"block under {base}: forward {t.forward_s * 1e3:.2f} ms, backward "
                f"{t.backward_s * 1e3:.2f} ms per sequence of {seq} (timed at {t.batch}); "
                f"issued in {issued[f'{base}/forward'] * 1e3:.2f} and "
                f"{issued[f'{base}/backward'] * 1e3:.2f} ms")
    tflops = dict(rates.gpu_tflops)
    keep = blocks.get(keep_key)
    if keep is not None:  # the FLOP model's rate for policies never timed, fitted to keep
        flops = 3 * sum(segment_flops(args, seq).values()) * seq
        tflops[f"{flavor}/{kernels.name}"] = flops / (keep.forward_s + keep.backward_s) / 1e12
    return replace(rates.with_model(key, blocks, costs), gpu_tflops=tflops,
                   compute_dtype=compute_dtype, issue_s=issue)


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
        before = (rates.blocks, rates.costs, rates.issue_s)
        rates = probe_model(rates, args, flavor=flavor, kernels=kernels, policies=policies, seq=seq,
                            batch=batch, loss_chunk=loss_chunk, device=device,
                            compute_dtype=compute_dtype, sizes=sizes, log=say)
        if (rates.blocks, rates.costs, rates.issue_s) != before or not path.is_file():
            rates.save(path)
            say(f"[probe] rates cached in {path}")
    barrier(group)
    return share(rates, group)


def _cached_machine(device: torch.device, world: int) -> Rates | None:
    """This machine's cached rates, if any (the key: host, device name and count, cores)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    probe_key = Machine(name="", source="measured", hostname=this_host(), device=name,
                        devices=world, cores=host_cores(), device_memory_gib=0, host_memory_gib=0).key()
    path = cache_dir() / f"{probe_key}.json"
    return load_rates(str(path)) if path.is_file() else None
