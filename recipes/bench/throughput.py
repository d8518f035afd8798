"""Throughput of one parallelism mode over several batch sizes (and SlideDP routes) in one
process group and one model build, so peers can be measured side by side on the same machine.

    torchrun --nproc_per_node=2 -m recipes.bench.throughput --mode slidedp --flavor qwen3-8B \\
        --seq 4096 --batches 4,8,16 --routes sharded/gpu,replicated/gpu --out runs.jsonl
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --mode slidedp --runtime slideformer ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --mode fsdp2 --ac full ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --mode fsdp2 --fsdp-cpu-offload ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --mode deepspeed --zero-stage 2 ...
    torchrun --nproc_per_node=2 -m recipes.bench.throughput --mode reference --ac full ...
    python -m recipes.bench.throughput --mode slidedp --flavor qwen3-4B --seq 262144 \
        --rope-scaling-type yarn --rope-scaling-factor 8 --original-max-position-embeddings 32768 \
        --points recompute:1 --max-norm 0 --warmup 0 --steps 1     # long context
    python -m recipes.bench.throughput --report runs.jsonl          # markdown table + ratios

Modes: slidedp (--runtime slideformer or megatrain: those peers' designs as policies of the
same runtime, slidedp/peer_styles.py), fsdp2 (--ac none/full/selective, --fsdp-cpu-offload) and
deepspeed (ZeRO-Offload, --zero-stage 2/3; needs the deepspeed package) train for real (synthetic tokens, AdamW); `reference` is the
compute-only reference of docs/DESIGN.md §7.1: the BF16 model resident on each GPU,
forward+backward only, no host traffic and no communication (each rank alone; the global rate is
the per-GPU rate x ranks).
Each point: `--warmup` steps, then the median of `--steps` timed steps (device synchronized).
Each row records every timed step's loss, gradient norm and skipped update (recipes/bench/rows.py:
the reference's are rank 0's own, and it updates nothing); a row whose steps did not train is
written marked invalid, and the bench exits non-zero after its last row.
"""

import argparse
import contextlib
import os
import statistics
import time
from typing import get_args

import torch
import torch.distributed as dist

from models.kernels import Kernels, sdpa_backend_used
from protocols.backend import StepResult
from protocols.model_spec import ModelArgs, spec_of
from protocols.reconfigure import Knobs
from recipes.config import ConfigError, JobConfig, resolve_model, run_config
from recipes.metrics import gpu_name, memory, throughput
from recipes.bench.rows import emit, exit_if_invalid, read_rows, training
from recipes.bench.timeline import breakdown
from recipes.baselines.activation_checkpoint import apply_activation_checkpointing
from recipes.baselines.eager import clip_grad_norm
from recipes.model import build_kernels
from recipes.parallelize import build_backend
from recipes.preflight import check_mode_options, check_seq_len
from recipes.train import SyntheticBatches, init_distributed
from slidedp.activations import format_blocks
from slidedp.plan.live import MEASURED_STEPS, select_live
from slidedp.config import EmbeddingUpdate, MomentsDtype, RuntimeName
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.update_order import UPDATE_ORDERS


class _Reference:
    """Forward + backward of the resident BF16 model: the compute-only reference."""

    def __init__(self, args: ModelArgs, *, device: torch.device, ac: str, loss_chunk: int,
                 kernels: Kernels):
        with torch.device("meta"):
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


def _config(a: argparse.Namespace, route: str) -> JobConfig:
    cfg = JobConfig()
    cfg.parallelism.mode = a.mode
    cfg.model.flavor = a.flavor
    cfg.model.kernels, cfg.model.attention = a.kernels, a.attention
    cfg.model.rope_scaling_type = a.rope_scaling_type
    cfg.model.rope_scaling_factor = a.rope_scaling_factor
    cfg.model.original_max_position_embeddings = a.original_max_position_embeddings
    cfg.training.seq_len, cfg.training.max_norm = a.seq, a.max_norm
    cfg.training.nonfinite = a.nonfinite
    cfg.training.init_on_meta = a.mode != "deepspeed"  # DeepSpeed partitions a built model
    cfg.activation_checkpoint.mode = a.ac
    cfg.parallelism.fsdp_cpu_offload = a.mode == "fsdp2" and a.fsdp_cpu_offload
    # The host state must hold the largest accumulation run (SlideDP's FP32 buffer); DeepSpeed
    # takes one count (checked in main).
    cfg.training.grad_accum_steps = max(int(n) for n in a.accum.split(","))
    # The first point's batch: SlideDP's start-up report (activation bytes per block, the offload
    # pool) is for it, and DeepSpeed's engine is configured for that one micro-batch shape.
    cfg.training.local_batch_size = _specs(a)[0][2][0]
    if a.mode == "deepspeed":
        cfg.deepspeed.zero_stage, cfg.deepspeed.cpu_threads = a.zero_stage, a.ds_threads
    cfg.slidedp.runtime = a.runtime
    cfg.slidedp.delivery, cfg.slidedp.reduction = route.split("/")
    cfg.slidedp.activation, cfg.slidedp.keep_blocks = a.activation, a.keep_blocks
    cfg.slidedp.activation_blocks = a.activation_blocks
    cfg.slidedp.window_slots, cfg.slidedp.chunk_mib = a.slots, a.chunk_mib
    cfg.slidedp.bf16_shadow = not a.no_shadow
    cfg.slidedp.update_order = a.update_order.split(",")[0]
    cfg.slidedp.embedding_update = a.embedding_update.split(",")[0]
    cfg.slidedp.gpu_state_blocks = a.gpu_state_blocks
    cfg.slidedp.moments_dtype = a.moments_dtype
    cfg.slidedp.pin_threads = a.pin_threads
    cfg.slidedp.speculative_update = a.speculative_update
    cfg.slidedp.check_host_memory = not a.no_memory_check
    cfg.slidedp.autopolicy_candidates = a.autopolicy_candidates
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("slidedp", "fsdp2", "deepspeed", "reference"))
    p.add_argument("--flavor", default="qwen3-8B")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--kernels", default="auto", choices=("auto", "liger", "torch"),
                   help="[model] kernels of every mode")
    p.add_argument("--attention", default="auto",
                   choices=("auto", "cudnn", "flash", "efficient", "math"),
                   help="[model] attention: the SDPA backend")
    p.add_argument("--rope-scaling-type", default="model",
                   choices=("model", "none", "linear", "dynamic", "yarn"), help="[model] key")
    p.add_argument("--rope-scaling-factor", type=float, default=0.0, help="[model] key")
    p.add_argument("--original-max-position-embeddings", type=int, default=0, help="[model] key")
    p.add_argument("--batches", default="4,8,16", help="local batch sizes (sequences per GPU)")
    p.add_argument("--routes", default="sharded/gpu", help="slidedp: delivery/reduction list; "
                   "the first one's reduction decides whether the host staging region exists")
    p.add_argument("--runtime", default="slidedp", choices=get_args(RuntimeName),
                   help="slidedp: slidedp.runtime, SlideDP's own policies or a peer's "
                        "re-implemented (slideformer, megatrain: their own routes, not --routes)")
    p.add_argument("--ac", default="full", choices=("none", "full", "selective"),
                   help="fsdp2/deepspeed/reference checkpointing (activation_checkpoint.mode)")
    p.add_argument("--fsdp-cpu-offload", action="store_true",
                   help="fsdp2: CPUOffloadPolicy (parallelism.fsdp_cpu_offload)")
    p.add_argument("--zero-stage", type=int, default=2, choices=(2, 3), help="deepspeed: ZeRO stage")
    p.add_argument("--ds-threads", type=int, default=0,
                   help="deepspeed: DeepSpeedCPUAdam threads per rank (0: the rank's share)")
    p.add_argument("--activation", default="recompute", help="slidedp default block policy")
    p.add_argument("--points", nargs="*", default=[],
                   help="slidedp: POLICY[|BLOCKS]:B1,B2,... entries run in one build, in order "
                        "(e.g. recompute:16,32 keep:1,2,4 'selective|0-3:keep:24'); replaces "
                        "--activation and --batches (BLOCKS: --activation-blocks for the entry)")
    p.add_argument("--keep-blocks", type=int, default=0, help="slidedp: first N blocks keep activations")
    p.add_argument("--activation-blocks", default="",
                   help='slidedp: per-block policies over each point\'s, e.g. "0-3:keep, 30-35:'
                        'recompute@offload=0.5" (slidedp.activation_blocks)')
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--chunk-mib", type=float, default=32.0)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--nonfinite", default="off", choices=("off", "skip", "stop_consecutive"),
                   help="training.nonfinite; off (the default here): SlideDP without clipping "
                        "updates during backward instead of waiting for the step's norm")
    p.add_argument("--accum", default="1",
                   help="slidedp/fsdp2: list of micro-batch counts each local batch is split "
                        "into (deepspeed: one count)")
    p.add_argument("--no-shadow", action="store_true",
                   help="slidedp: no BF16 shadow (slidedp.bf16_shadow = false: FP32 delivery, "
                        "cast on the GPU)")
    p.add_argument("--update-order", default="arrival",
                   help="slidedp: list of slidedp.update_order values (next_use, arrival), each "
                        "point run in each, one after the other, in the same build")
    p.add_argument("--embedding-update", default="host",
                   help="slidedp: list of slidedp.embedding_update values (host, gpu, "
                        "resident), each point measured under each in one build")
    p.add_argument("--gpu-state-blocks", type=int, default=0,
                   help="slidedp: slidedp.gpu_state_blocks (the first N blocks' optimizer state "
                        "on the GPU)")
    p.add_argument("--moments-dtype", default="float32", choices=get_args(MomentsDtype),
                   help="slidedp: slidedp.moments_dtype (the host's Adam moments)")
    p.add_argument("--speculative-update", action="store_true",
                   help="slidedp: slidedp.speculative_update (updates as gradients arrive, redone if the norm clips)")
    p.add_argument("--pin-threads", action="store_true",
                   help="slidedp: slidedp.pin_threads (each runtime thread and CPU Adam worker on a core)")
    p.add_argument("--cpu-threads", default="0",
                   help="slidedp: list of slidedp.cpu_threads values (0: the rank's share of the "
                        "cores), each point run with each in the same build; a count other than "
                        "0 is appended to the row's label as -tN")
    p.add_argument("--no-memory-check", action="store_true",
                   help="slidedp: skip the MemAvailable check (VMs whose memory grows on demand)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--label", default="")
    p.add_argument("--launch", type=int, default=1,
                   help="which launch of the same point this is (recipes/bench/headline.py)")
    p.add_argument("--trace-dir", default="",
                   help="profile one more step after the timed ones on rank 0: Chrome trace + the "
                        "per-stream breakdown of recipes/bench/timeline.py in the row")
    p.add_argument("--trace-batch", type=int, default=0,
                   help="with --trace-dir: trace only this local batch size (0: every one)")
    p.add_argument("--autopolicy", type=int, default=0,
                   help="slidedp: after the points, run AutoPolicy at this many sequences per GPU "
                        "and measure its choice (its policy file beside --out)")
    p.add_argument("--autopolicy-candidates", default="",
                   help="slidedp.autopolicy_candidates for --autopolicy (empty: its default set)")
    p.add_argument("--autopolicy-steps", type=int, default=MEASURED_STEPS,
                   help="steps per AutoPolicy measurement (the first after a change is dropped)")
    p.add_argument("--out", default="outputs/bench/throughput.jsonl",
                   help="JSONL file the rows are appended to (its folder is made)")
    p.add_argument("--report", nargs="*", help="print the markdown table of these JSONL files")
    a = p.parse_args()
    if a.report:
        print(report(a.report))
        return
    try:  # the flavor with the RoPE scaling flags, and --seq within its positions
        args = resolve_model(_config(a, "sharded/gpu"))[1]
        check_seq_len(a.seq, args)
        check_mode_options(_config(a, "sharded/gpu"), args,  # e.g. deepspeed not installed
                           world=int(os.environ.get("WORLD_SIZE", "1")))
        if a.mode == "deepspeed" and "," in a.accum:
            raise ConfigError("--accum: deepspeed takes one micro-batch count per build")
        if set(a.update_order.split(",")) - set(UPDATE_ORDERS):
            raise ConfigError(f"--update-order: each one of {', '.join(UPDATE_ORDERS)}")
        if set(a.embedding_update.split(",")) - set(get_args(EmbeddingUpdate)):
            raise ConfigError(f"--embedding-update: each one of {', '.join(get_args(EmbeddingUpdate))}")
        if not all(t.isdigit() for t in a.cpu_threads.split(",")):
            raise ConfigError("--cpu-threads: a list of counts >= 0")
    except ConfigError as e:
        p.error(str(e))
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 or a.mode in ("fsdp2", "deepspeed"):  # they need a process group even alone
        init_distributed(_config(a, "sharded/gpu"), device, world=world)
    routes = a.routes.split(",") if a.mode == "slidedp" else ["-"]
    if a.mode == "slidedp" and RUNTIME_STYLES[a.runtime].routes:  # a peer style's own routes
        routes = ["/".join(RUNTIME_STYLES[a.runtime].routes)]
    kernels = build_kernels(_config(a, "sharded/gpu"), device=device)
    attention_op = sdpa_backend_used(kernels, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                                     head_dim=args.head_dim, seq_len=a.seq, device=device)
    t0 = time.perf_counter()
    if a.mode == "reference":
        runner = _Reference(args, device=device, ac=a.ac, loss_chunk=4096, kernels=kernels)
    else:
        backend = build_backend(_config(a, routes[0] if a.mode == "slidedp" else "sharded/gpu"),
                                args, device=device, dp_rank=rank, dp_world=world)
    if rank == 0:
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in
                           (backend.build_s if a.mode == "slidedp" else {}).items())
        print(f"[bench] {a.mode} {a.flavor} built in {time.perf_counter() - t0:.1f}s"
              f"{f' ({phases})' if phases else ''}; {kernels.describe()} -> {attention_op}",
              flush=True)
    orders = a.update_order.split(",") if a.mode == "slidedp" else [None]
    thread_counts = [int(t) for t in a.cpu_threads.split(",")] if a.mode == "slidedp" else [0]
    embeddings = a.embedding_update.split(",") if a.mode == "slidedp" else [None]
    points = [(policy, blocks, b, int(n), order, threads, embedding)
              for policy, blocks, batches in _specs(a) for b in batches
              for n in a.accum.split(",") for order in orders for threads in thread_counts
              for embedding in embeddings]
    context = dict(args=args, rank=rank, world=world, device=device)
    keys = dict(kernels=kernels.name, attention_op=attention_op, world=world, device=device)
    written: list[dict] = []
    for route in routes:
        if a.mode == "slidedp":
            delivery, reduction = route.split("/")
            backend.reconfigure(Knobs(delivery=delivery, reduction=reduction))
        for k, (policy, blocks, batch, accum, order, threads, embedding) in enumerate(points):
            if a.mode == "slidedp":
                backend.reconfigure(Knobs(activation=policy, activation_blocks=blocks,
                                          keep_blocks=a.keep_blocks, update_order=order,
                                          cpu_threads=threads, embedding_update=embedding))
            step = (runner.step if a.mode == "reference" else
                    _train_step(backend, accum=accum, tokens=batch * a.seq * world))
            measured = _measure(a, step, batch=batch,
                                name=f"{a.mode}_{route.replace('/', '-')}_p{k}_b{batch}x{accum}",
                                **context)
            slidedp = dict(activation_blocks=blocks, keep_blocks=a.keep_blocks,
                           slots=a.slots, chunk_mib=a.chunk_mib, update_order=order,
                           embedding_update=embedding, gpu_state_blocks=a.gpu_state_blocks,
                           **_runtime_state(a, backend, args)) if a.mode == "slidedp" else {}
            row = _row(a, args=args, route=route, ac=a.ac if a.mode != "slidedp" else policy,
                       batch=batch, accum=accum, slidedp=slidedp, measured=measured,
                       label="-".join(filter(None, (a.label, f"t{threads}"))) if threads else None,
                       **keys)
            if rank == 0:
                emit("bench", row, a.out)
                written.append(row)
    if a.autopolicy and a.mode == "slidedp":
        row = _autopolicy(a, backend, route=routes[-1], keys=keys, **context)
        if rank == 0:
            emit("bench", row, a.out)
            written.append(row)
    if a.mode != "reference":
        t0 = time.perf_counter()
        backend.close()
        if rank == 0:
            print(f"[bench] closed in {time.perf_counter() - t0:.1f}s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_if_invalid(written, a.out)


def point_specs(points: list[str], *, blocks: str = "") -> list[tuple[str, str, list[int]]]:
    """`POLICY[|BLOCKS]:B1,B2` entries as (policy, per-block policies, batches): BLOCKS (the
    slidedp.activation_blocks syntax, colons and all) overrides `blocks` for that entry."""
    specs = []
    for spec in points:
        policy, batches = spec.rsplit(":", 1)
        policy, _, own = policy.partition("|")
        specs.append((policy, own or blocks, [int(b) for b in batches.split(",")]))
    return specs


def _specs(a: argparse.Namespace) -> list[tuple[str, str, list[int]]]:
    """The points: `--points ...` (point_specs), else `--activation` over `--batches`."""
    return point_specs(a.points or [f"{a.activation}:{a.batches}"], blocks=a.activation_blocks)


def _train_step(backend, *, accum: int, tokens: int):
    """One training step of `backend` on a batch split into `accum` micro-batches."""

    def step(data) -> StepResult:
        micro = list(zip(*(t.chunk(accum) for t in data)))
        return backend.train_step(micro, lr=1e-5, global_target_tokens=tokens)

    return step


def _measure(a: argparse.Namespace, step, *, args: ModelArgs, batch: int, name: str, rank: int,
             world: int, device: torch.device) -> dict:
    """`--warmup` steps, the median of `--steps` timed ones (device synchronized), the means of
    the backend's counters over them, what each trained (rows.training), and with
    `--trace-dir` one profiled step after them."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    times, results, traced = [], [], {}
    # SlideDP's host updates of step t run on during step t+1 (all of them with clipping): the
    # warm-up must hold one whole update cycle (the first also faults in the Adam moments' host
    # pages).
    warmup = a.warmup + (a.mode == "slidedp")
    n_timed = warmup + a.steps
    # The traced step (rank 0 profiles) comes after the timed ones: its overhead stays out.
    trace = bool(a.trace_dir) and a.trace_batch in (0, batch)
    batches = iter(SyntheticBatches(vocab_size=args.vocab_size, seq_len=a.seq,
                                    local_batch_size=batch, dp_rank=rank, dp_world=world, seed=0))
    for i in range(n_timed + trace):
        data = next(batches)
        profiling = i == n_timed and rank == 0
        prof = _profiler() if profiling else contextlib.nullcontext()
        start = time.perf_counter()
        with prof:
            result = step(data)
            if device.type == "cuda":
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if profiling:
            os.makedirs(a.trace_dir, exist_ok=True)
            path = os.path.join(a.trace_dir, f"{name}.json.gz")
            prof.export_chrome_trace(path)
            traced = {"traced_step_s": elapsed, **breakdown(path, step_time_s=elapsed)}
        elif warmup <= i < n_timed:
            times.append(elapsed)
            results.append(result)
    extras = [r.extra for r in results]
    # The loss targets of a step: every position of the batch, the reference's of rank 0 alone.
    targets = batch * a.seq * (1 if a.mode == "reference" else world)
    return {"step_time_s": statistics.median(times),
            # A step reports a key only when it has one (update_tail_s: when a step's updates all
            # ended), so each mean is over the steps that have it.
            **{k: statistics.mean(e[k] for e in extras if k in e)
               for k in dict.fromkeys(k for e in extras for k in e)},
            **traced,
            **training([r.loss_sum / targets for r in results], [r.grad_norm for r in results],
                       [r.skipped for r in results])}


def _runtime_state(a: argparse.Namespace, backend, args: ModelArgs) -> dict:
    """The runtime style and the host state the build runs with (the shadow as the host state
    has it: a peer runtime style sets its own)."""
    return {"runtime": a.runtime, "bf16_shadow": backend.state.plan.bf16_shadow,
            "moments_dtype": backend.state.plan.moments,
            "cpu_threads": backend.optimizer.threads, "pin_threads": a.pin_threads,
            "speculative_update": a.speculative_update,
            "host_state_bytes_per_param": backend.state.nbytes / args.num_params()}


def _row(a: argparse.Namespace, *, args: ModelArgs, route: str, ac: str, batch: int, accum: int,
         slidedp: dict, measured: dict, kernels: str, attention_op: str, world: int,
         device: torch.device, label: str | None = None) -> dict:
    """One measured point as a JSONL row (its configuration, then what was measured)."""
    step_time = measured["step_time_s"]
    none = dict.fromkeys(("activation_blocks", "keep_blocks", "slots", "chunk_mib",
                          "update_order", "embedding_update", "gpu_state_blocks", "runtime",
                          "bf16_shadow", "moments_dtype", "cpu_threads", "pin_threads",
                          "speculative_update"))
    return {"mode": a.mode, "label": a.label if label is None else label, "flavor": a.flavor,
            "route": route, "kernels": kernels, "attention_op": attention_op, "ac": ac,
            **{**none, **slidedp},
            **({"fsdp_cpu_offload": a.fsdp_cpu_offload} if a.mode == "fsdp2" else {}),
            **({"zero_stage": a.zero_stage} if a.mode == "deepspeed" else {}),
            "rope_scaling": args.rope_scaling and args.rope_scaling.describe(),
            "world": world, "seq": a.seq, "local_batch": batch, "accum": accum,
            "max_norm": a.max_norm, "nonfinite": a.nonfinite, "launch": a.launch,
            "step_time_s": step_time,
            **throughput(global_tokens=batch * a.seq * world, step_time=step_time,
                         flops_per_token=args.flops_per_token(a.seq), world=world,
                         gpu=gpu_name(device)),
            **memory(device),
            **{k: v for k, v in measured.items() if k != "step_time_s"}}


def _autopolicy(a: argparse.Namespace, backend, *, route: str, keys: dict, args: ModelArgs,
                rank: int, world: int, device: torch.device) -> dict:
    """AutoPolicy (slidedp/plan/live.py) on this build at `--autopolicy` sequences per GPU,
    then its choice measured like every point: its row, labelled "autopolicy", with the
    selection's time and steps and the configuration it started from measured by AutoPolicy
    itself."""
    cfg = _config(a, route)
    cfg.training.local_batch_size = a.autopolicy
    # It starts from the configured policies (--activation, ...), update order and threads, not
    # the last point's: the row records those.
    backend.reconfigure(Knobs(activation=a.activation, activation_blocks=a.activation_blocks,
                              keep_blocks=a.keep_blocks, update_order=cfg.slidedp.update_order,
                              cpu_threads=int(a.cpu_threads.split(",")[0]),
                              embedding_update=cfg.slidedp.embedding_update))
    chosen = select_live(backend, run_config(cfg), args, flavor=a.flavor, device=device, rank=rank,
                         world=world, group=dist.group.WORLD if world > 1 else None,
                         out=os.path.join(os.path.dirname(a.out) or ".",
                                          f"policy_{a.flavor}_b{a.autopolicy}.toml"),
                         steps=a.autopolicy_steps)
    s, policies = chosen["setting"], chosen["policies"]
    tokens = a.autopolicy * a.seq * world
    measured = _measure(a, _train_step(backend, accum=1, tokens=tokens), args=args,
                        batch=a.autopolicy, name=f"autopolicy_b{a.autopolicy}", rank=rank,
                        world=world, device=device)
    slidedp = dict(activation_blocks=format_blocks(policies, policies[0]), keep_blocks=0,
                   slots=s.window_slots, chunk_mib=s.chunk_mib, update_order=cfg.slidedp.update_order,
                   embedding_update=cfg.slidedp.embedding_update,
                   gpu_state_blocks=a.gpu_state_blocks, **_runtime_state(a, backend, args))
    return _row(a, args=args, route=f"{s.delivery}/{s.reduction}", ac=policies[0].name,
                batch=a.autopolicy, accum=1, slidedp=slidedp, label="autopolicy",
                measured={**measured, "selection_s": chosen["selection_s"],
                          "selection_steps": chosen["steps"],
                          "autopolicy_given_s": chosen["baseline_s"],
                          "autopolicy_chosen_s": chosen["step_s"]}, **keys)


def system_name(row: dict) -> str:
    """The system a row measured, as tables name it: the mode with its variant and label."""
    name = row["mode"]
    if row.get("runtime") not in (None, "slidedp"):  # a peer re-implemented on SlideDP
        name = f"{row['runtime']}-style"
    if row.get("fsdp_cpu_offload"):
        name += " cpu-offload"
    if row.get("zero_stage"):
        name += f" ZeRO-{row['zero_stage']}"
    if row.get("update_order") == "next_use":  # not the default slidedp.update_order
        name += " next_use"
    if row.get("embedding_update") in ("gpu", "resident"):  # not the default
        name += f" {row['embedding_update']}-embedding"
    if row.get("gpu_state_blocks"):
        name += f" gpu-state-{row['gpu_state_blocks']}"
    if row.get("pin_threads"):  # not the default
        name += " pinned"
    if row.get("speculative_update"):
        name += " speculative"
    if row.get("moments_dtype") in ("bfloat16", "8bit"):  # not the default
        name += f" {'bf16' if row['moments_dtype'] == 'bfloat16' else '8bit'}-moments"
    return name + (f" {row['label']}" if row.get("label") else "")


def report(paths: list[str]) -> str:
    """Markdown table; ratios against the compute-only reference at the same batch, seq and
    kernels (same checkpointing where both exist; an unlabelled reference row) and against the
    best FSDP2 throughput on the same kernels. Files with rows whose steps did not train are
    refused (rows.read_rows)."""
    rows = [r for path in paths for r in read_rows(path)]
    refs = {(r["flavor"], r["kernels"], r["local_batch"], r["seq"], r["ac"]): r["tokens_per_s"]
            for r in rows if r["mode"] == "reference" and not r["label"]}  # labelled: variants
    best_fsdp2: dict[tuple[str, str], float] = {}
    for r in rows:
        if r["mode"] == "fsdp2" and not r.get("fsdp_cpu_offload"):  # GPU-resident only
            key = (r["flavor"], r["kernels"])
            best_fsdp2[key] = max(best_fsdp2.get(key, 0.0), r["tokens_per_s"])
    lines = ["| model | kernels | system | route | activations | seq/GPU | tokens/s | TFLOP/s/GPU | MFU | peak GPU GiB (alloc/reserved) | host RSS GiB | vs reference | vs FSDP2 peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ac = (r["ac"] + (f"+keep{r['keep_blocks']}" if r.get("keep_blocks") else "")
              + (f" [{r['activation_blocks']}]" if r.get("activation_blocks") else ""))
        ref_ac = "full" if r["ac"] == "recompute" else ("none" if r["ac"] == "keep" else r["ac"])
        ref = refs.get((r["flavor"], r["kernels"], r["local_batch"], r["seq"], ref_ac))
        vs_ref = f"{r['tokens_per_s'] / ref:.1%}" if ref else "–"
        peak = best_fsdp2.get((r["flavor"], r["kernels"]))
        vs_fsdp = f"{r['tokens_per_s'] / peak:.3f}x" if peak else "–"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "–"
        tflops = f"{r['tflops_per_gpu']:.0f}" if "tflops_per_gpu" in r else "–"  # CPU rows: none
        mem = (f"{r['peak_mem_alloc_gib']:.1f}/{r['peak_mem_reserved_gib']:.1f}"
               if r.get("peak_mem_alloc_gib") is not None else "–")
        accum = r.get("accum", 1)
        batch = f"{r['local_batch']} ({accum}x{r['local_batch'] // accum})" if accum > 1 else r["local_batch"]
        lines.append(f"| {r['flavor']} | {r['kernels']} | {system_name(r)} | "
                     f"{r['route']} | {ac} | {batch} | {r['tokens_per_s']:,.0f} | {tflops} | "
                     f"{mfu} | {mem} | {r['peak_rss_gib']:.1f} | {vs_ref} | {vs_fsdp} |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
