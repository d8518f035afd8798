"""Throughput of one parallelism mode over several batch sizes (and SlideDP routes) in one
process group and one model build, so peers can be measured side by side on the same machine.

It takes the trainer's configuration (recipes/config.py: `--job.config_file=FILE` and
`--section.key=value` flags) with its own [bench] section (recipes/bench/config.py: the sweep
axes and run control); a mistake is one `error:` line and exit code 2, before any work.

    torchrun --nproc_per_node=2 -m recipes.bench.throughput --parallelism.mode=slidedp \
        --model.flavor=qwen3-8B --training.seq_len=4096 --bench.batches 4 8 16 \
        --bench.routes sharded/gpu replicated/gpu --bench.out=runs.jsonl
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --parallelism.mode=slidedp \
        --slidedp.runtime=slideformer ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --parallelism.mode=fsdp2 \
        --activation_checkpoint.mode=full ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --parallelism.mode=fsdp2 \
        --parallelism.fsdp_cpu_offload ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --parallelism.mode=deepspeed \
        --deepspeed.zero_stage=2 ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --bench.reference ...
    python -m recipes.bench.throughput --parallelism.mode=slidedp --model.flavor=qwen3-4B \
        --training.seq_len=262144 --model.rope_scaling_type=yarn --model.rope_scaling_factor=8 \
        --model.original_max_position_embeddings=32768 --bench.points recompute:1 \
        --training.max_norm=0 --bench.warmup=0 --training.steps=1     # long context
    python -m recipes.bench.report runs.jsonl          # markdown table + ratios

Modes: slidedp (slidedp.runtime slideformer or megatrain: those peers' designs as policies of
the same runtime, slidedp/peer_styles.py), fsdp2 and deepspeed (ZeRO-Offload; needs the
deepspeed package) train for real (synthetic tokens, AdamW); `bench.reference` is the
compute-only reference of docs/DESIGN.md §7.1: the BF16 model resident on each GPU,
forward+backward only, no host traffic and no communication (each rank alone; the global rate is
the per-GPU rate x ranks).
Each point: `bench.warmup` steps, then the median of `training.steps` timed steps: by default
each from its start to the next one's, the device synchronized only around them, as the training
loop runs (`bench.sync`). Each row records every timed step's loss, gradient norm and skipped update
(recipes/bench/rows.py: the reference's are rank 0's own, and it updates nothing); a row whose
steps did not train is written marked invalid, and the bench exits non-zero after its last row.
"""

import contextlib
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from models.kernels import Kernels, sdpa_backend_used
from models.meta import on_meta
from protocols.backend import StepResult
from protocols.model_spec import ModelArgs, spec_of
from protocols.reconfigure import Knobs
from recipes.bench.config import (BenchConfig, build_config, mode, parse_bench_config, points,
                                  routes)
from recipes.bench.rows import emit, exit_if_invalid, training
from recipes.bench.timeline import breakdown
from recipes.baselines.activation_checkpoint import apply_activation_checkpointing
from recipes.baselines.eager import clip_grad_norm
from recipes.batches import SyntheticBatches
from recipes.config import ConfigError, resolve_model, run_config
from recipes.metrics import gpu_name, memory, ran_on, throughput
from recipes.model import build_kernels
from recipes.parallelize import build_backend
from recipes.process_group import init_distributed
from slidedp.activations import format_blocks
from slidedp.plan.live import select_live


class _Reference:
    """Forward + backward of the resident BF16 model: the compute-only reference."""

    def __init__(self, args: ModelArgs, *, device: torch.device, ac: str, loss_chunk: int,
                 kernels: Kernels):
        with on_meta():
            model = spec_of(args).model_cls(args, kernels)
        model.to_empty(device=device)
        model.init_weights()
        self.model = model.to(torch.bfloat16)
        apply_activation_checkpointing(self.model, mode=ac)
        self.loss_chunk = loss_chunk

    def step(self, batch) -> StepResult:
        tokens, labels = (t.to(self.model.embed_tokens.weight.device) for t in batch)
        loss_sum = self.model.loss_sum(self.model(tokens), labels, chunk_tokens=self.loss_chunk)
        (loss_sum / labels.numel()).backward()
        # The norm (one fused reduction) shows that backward produced finite gradients.
        grad_norm = clip_grad_norm(list(self.model.parameters()), max_norm=0.0, sharded=False)
        for p in self.model.parameters():
            p.grad = None
        return StepResult(loss_sum=loss_sum.item(), grad_norm=grad_norm)


def _profiler() -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def main(argv: list[str] | None = None) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg, args = parse_bench_config(sys.argv[1:] if argv is None else argv, world=world)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    b, measured_mode = cfg.bench, mode(cfg)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
                          if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    build_routes = routes(cfg)
    built = build_config(cfg, build_routes[0])
    if world > 1 or measured_mode in ("fsdp2", "deepspeed"):  # they need a process group even alone
        init_distributed(built, device, world=world)
    kernels = build_kernels(built, device=device)
    seq = cfg.training.seq_len
    attention_op = sdpa_backend_used(kernels, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                                     head_dim=args.head_dim, seq_len=seq, device=device)
    flavor = resolve_model(cfg)[0]
    t0 = time.perf_counter()
    if b.reference:
        backend = None
        runner = _Reference(args, device=device, ac=cfg.activation_checkpoint.mode,
                            loss_chunk=cfg.training.loss_chunk_tokens, kernels=kernels)
    else:
        backend = build_backend(built, args, device=device, dp_rank=rank, dp_world=world)
    slidedp = measured_mode == "slidedp"
    if rank == 0:
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in
                           (backend.build_s if slidedp else {}).items())
        print(f"[bench] {measured_mode} {flavor} built in {time.perf_counter() - t0:.1f}s"
              f"{f' ({phases})' if phases else ''}; {kernels.describe()} -> {attention_op}",
              flush=True)
    context = dict(args=args, rank=rank, world=world, device=device)
    keys = dict(flavor=flavor, kernels=kernels.name, attention_op=attention_op, world=world,
                device=device)
    written: list[dict] = []
    for route in build_routes:
        if slidedp:
            delivery, reduction = route.split("/")
            backend.reconfigure(Knobs(delivery=delivery, reduction=reduction))
        for k, p in enumerate(points(cfg)):
            if slidedp:
                backend.reconfigure(Knobs(activation=p.policy, activation_blocks=p.blocks,
                                          keep_blocks=cfg.slidedp.keep_blocks,
                                          update_order=p.update_order, cpu_threads=p.cpu_threads,
                                          embedding_update=p.embedding_update))
            step = (runner.step if b.reference else
                    _train_step(backend, accum=p.accum, tokens=p.batch * seq * world))
            name = f"{measured_mode}_{route.replace('/', '-')}_p{k}_b{p.batch}x{p.accum}"
            measured = _measure(cfg, step, batch=p.batch, name=name, **context)
            s = cfg.slidedp
            state = dict(activation_blocks=p.blocks, keep_blocks=s.keep_blocks,
                         slots=s.window_slots, chunk_mib=s.chunk_mib, update_order=p.update_order,
                         embedding_update=p.embedding_update, gpu_state_blocks=s.gpu_state_blocks,
                         **_runtime_state(cfg, backend, args)) if slidedp else {}
            label = ("-".join(filter(None, (b.label, f"t{p.cpu_threads}")))
                     if p.cpu_threads else None)
            row = _row(cfg, args=args, route=route,
                       ac=p.policy if slidedp else cfg.activation_checkpoint.mode,
                       batch=p.batch, accum=p.accum, slidedp=state, measured=measured,
                       label=label, **keys)
            if rank == 0:
                emit("bench", row, b.out)
                written.append(row)
    if b.autopolicy_batch and slidedp:
        row = _autopolicy(cfg, backend, route=build_routes[-1], keys=keys, **context)
        if rank == 0:
            emit("bench", row, b.out)
            written.append(row)
    if backend is not None:
        t0 = time.perf_counter()
        backend.close()
        if rank == 0:
            print(f"[bench] closed in {time.perf_counter() - t0:.1f}s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_if_invalid(written, b.out)


def _train_step(backend, *, accum: int, tokens: int):
    """One training step of `backend` on a batch split into `accum` micro-batches."""

    def step(data) -> StepResult:
        micro = list(zip(*(t.chunk(accum) for t in data)))
        return backend.train_step(micro, lr=1e-5, global_target_tokens=tokens)

    return step


def _measure(cfg: BenchConfig, step, *, args: ModelArgs, batch: int, name: str, rank: int,
             world: int, device: torch.device) -> dict:
    """`bench.warmup` steps, the median of `training.steps` timed ones (timed as `bench.sync`
    says),
    the means of the backend's counters over them, what each trained (rows.training), and with
    `bench.trace_dir` one profiled step after them."""
    b, seq = cfg.bench, cfg.training.seq_len
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    times, results, traced = [], [], {}
    # SlideDP's host updates of step t run on during step t+1 (all of them with clipping): the
    # warm-up must hold one whole update cycle (the first also faults in the Adam moments' host
    # pages).
    warmup = b.warmup + (mode(cfg) == "slidedp")
    n_timed = warmup + cfg.training.steps
    # The traced step (rank 0 profiles) comes after the timed ones: its overhead stays out.
    trace = bool(b.trace_dir) and b.trace_batch in (0, batch)
    batches = iter(SyntheticBatches(vocab_size=args.vocab_size, seq_len=seq,
                                    local_batch_size=batch, dp_rank=rank, dp_world=world,
                                    seed=cfg.training.seed))
    cuda = device.type == "cuda"
    marks = []  # "window": the timed steps' starts, then the end of the last one's work
    for i in range(n_timed + trace):
        profiling = i == n_timed and rank == 0
        if cuda and (b.sync == "step" or i == warmup):
            torch.cuda.synchronize()
        if warmup <= i < n_timed:
            marks.append(time.perf_counter())  # a step's start: before its data, as in training
        data = next(batches)
        prof = _profiler() if profiling else contextlib.nullcontext()
        start = time.perf_counter()
        with prof:
            result = step(data)
            if cuda and (b.sync == "step" or i >= n_timed - 1):
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if i == n_timed - 1:
            marks.append(time.perf_counter())
        if profiling:
            os.makedirs(b.trace_dir, exist_ok=True)
            path = os.path.join(b.trace_dir, f"{name}.json.gz")
            prof.export_chrome_trace(path)
            traced = {"traced_step_s": elapsed, **breakdown(path, step_time_s=elapsed)}
        elif warmup <= i < n_timed:
            times.append(elapsed)
            results.append(result)
    if b.sync == "window":  # each step from its start to the next one's
        times = [t1 - t0 for t0, t1 in zip(marks, marks[1:])]
    extras = [r.extra for r in results]
    # The loss targets of a step: every position of the batch, the reference's of rank 0 alone.
    targets = batch * seq * (1 if b.reference else world)
    return {"step_time_s": statistics.median(times),
            # A step reports a key only when it has one (update_tail_s: when a step's updates all
            # ended), so each mean is over the steps that have it.
            **{k: statistics.mean(e[k] for e in extras if k in e)
               for k in dict.fromkeys(k for e in extras for k in e)},
            **traced,
            **training([r.loss_sum / targets for r in results], [r.grad_norm for r in results],
                       [r.skipped for r in results])}


def _runtime_state(cfg: BenchConfig, backend, args: ModelArgs) -> dict:
    """The runtime style and the host state the build runs with (the shadow as the host state
    has it: a peer runtime style sets its own)."""
    return {"runtime": cfg.slidedp.runtime, "bf16_shadow": backend.state.plan.bf16_shadow,
            "moments_dtype": backend.state.plan.moments,
            "cpu_threads": backend.optimizer.threads, "pin_threads": cfg.slidedp.pin_threads,
            "speculative_update": cfg.slidedp.speculative_update,
            "host_state_bytes_per_param": backend.state.nbytes / args.num_params()}


def _row(cfg: BenchConfig, *, args: ModelArgs, route: str, ac: str, batch: int, accum: int,
         slidedp: dict, measured: dict, flavor: str, kernels: str, attention_op: str, world: int,
         device: torch.device, label: str | None = None) -> dict:
    """One measured point as a JSONL row (its configuration, then what was measured)."""
    step_time, seq, measured_mode = measured["step_time_s"], cfg.training.seq_len, mode(cfg)
    none = dict.fromkeys(("activation_blocks", "keep_blocks", "slots", "chunk_mib",
                          "update_order", "embedding_update", "gpu_state_blocks", "runtime",
                          "bf16_shadow", "moments_dtype", "cpu_threads", "pin_threads",
                          "speculative_update"))
    return {"mode": measured_mode, "label": cfg.bench.label if label is None else label,
            "flavor": flavor, "route": route, "kernels": kernels, "attention_op": attention_op,
            "ac": ac, **{**none, **slidedp},
            **({"fsdp_cpu_offload": cfg.parallelism.fsdp_cpu_offload}
               if measured_mode == "fsdp2" else {}),
            **({"zero_stage": cfg.deepspeed.zero_stage} if measured_mode == "deepspeed" else {}),
            "rope_scaling": args.rope_scaling and args.rope_scaling.describe(),
            **ran_on(device), "world": world, "seq": seq, "local_batch": batch,
            "accum": accum,
            "max_norm": cfg.training.max_norm, "nonfinite": cfg.training.nonfinite,
            "launch": cfg.bench.launch, "sync": cfg.bench.sync, "step_time_s": step_time,
            **throughput(global_tokens=batch * seq * world, step_time=step_time,
                         flops_per_token=args.flops_per_token(seq), world=world,
                         gpu=gpu_name(device)),
            **memory(device),
            **{k: v for k, v in measured.items() if k != "step_time_s"}}


def _autopolicy(cfg: BenchConfig, backend, *, route: str, keys: dict, args: ModelArgs,
                rank: int, world: int, device: torch.device) -> dict:
    """AutoPolicy (slidedp/plan/live.py) on this build at `bench.autopolicy_batch` sequences per
    GPU, then its choice measured like every point: its row, labelled "autopolicy", with the
    selection's time and steps and the configuration it started from measured by AutoPolicy
    itself."""
    batch = cfg.bench.autopolicy_batch
    start = build_config(cfg, route)
    start = dataclasses.replace(start, training=dataclasses.replace(start.training,
                                                                    local_batch_size=batch))
    s = start.slidedp
    # It starts from the configured policies (slidedp.activation, ...), update order and
    # threads, not the last point's: the row records those.
    backend.reconfigure(Knobs(activation=s.activation, activation_blocks=s.activation_blocks,
                              keep_blocks=s.keep_blocks, update_order=s.update_order,
                              cpu_threads=s.cpu_threads, embedding_update=s.embedding_update))
    flavor = keys["flavor"]
    chosen = select_live(backend, run_config(start), args, flavor=flavor, device=device,
                         rank=rank, world=world, group=dist.group.WORLD if world > 1 else None,
                         out=os.path.join(os.path.dirname(cfg.bench.out) or ".",
                                          f"policy_{flavor}_b{batch}.toml"),
                         steps=cfg.bench.autopolicy_steps)
    setting, policies = chosen["setting"], chosen["policies"]
    tokens = batch * cfg.training.seq_len * world
    measured = _measure(cfg, _train_step(backend, accum=1, tokens=tokens), args=args,
                        batch=batch, name=f"autopolicy_b{batch}", rank=rank, world=world,
                        device=device)
    state = dict(activation_blocks=format_blocks(policies, policies[0]), keep_blocks=0,
                 slots=setting.window_slots, chunk_mib=setting.chunk_mib,
                 update_order=s.update_order, embedding_update=s.embedding_update,
                 gpu_state_blocks=s.gpu_state_blocks, **_runtime_state(cfg, backend, args))
    return _row(cfg, args=args, route=f"{setting.delivery}/{setting.reduction}",
                ac=policies[0].name, batch=batch, accum=1, slidedp=state, label="autopolicy",
                measured={**measured, "selection_s": chosen["selection_s"],
                          "selection_steps": chosen["steps"],
                          "autopolicy_given_s": chosen["baseline_s"],
                          "autopolicy_chosen_s": chosen["step_s"]}, **keys)


if __name__ == "__main__":
    main()
