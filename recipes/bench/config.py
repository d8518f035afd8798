"""The bench's configuration: the trainer's JobConfig (the same TOML, the same `--section.key=value`
flags, parsed by recipes/config.py's `parse_config`) with the bench's own [bench] section, the
sweep axes and run control, beside it.

A sweep axis is a list of values of one trainer key, each measured in turn in the same build;
empty, it is that key's one value. `points` and the routes are the SlideDP axes of a build.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Literal, NamedTuple, cast, get_args

from protocols.bounds import Checked, at_least
from protocols.model_spec import ModelArgs
from recipes.config import ConfigError, JobConfig, parse_config, resolve_model
from recipes.job_config import ActivationCheckpoint, Model, Training
from recipes.preflight import check_mode_options, check_seq_len
from slidedp.activations import block_policies
from slidedp.config import DeliveryRoute, EmbeddingUpdate, ReductionRoute
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.live import MEASURED_STEPS
from slidedp.update_order import UpdateOrderName

# Every delivery/reduction pair, spelled as rows record it.
Route = Literal[tuple(f"{d}/{r}" for d in get_args(DeliveryRoute)  # type: ignore[misc]
                      for r in get_args(ReductionRoute))]


@dataclass
class Bench(Checked):
    """The bench's sweep axes and run control (recipes/bench/throughput.py; the trainer has no
    [bench] section)."""

    reference: bool = False
    """Measure the compute-only reference (docs/DESIGN.md §7.1) instead of training: the BF16
    model resident on each GPU, forward+backward only, with activation_checkpoint.mode; needs
    parallelism.mode = "single"."""
    batches: list[Annotated[int, at_least(1)]] = field(default_factory=list)
    """Local batch sizes (sequences per GPU) measured in turn; empty: training.local_batch_size."""
    accum: list[Annotated[int, at_least(1)]] = field(default_factory=list)
    """Micro-batch counts each local batch is split into, each measured (deepspeed: one);
    empty: training.grad_accum_steps."""
    points: list[str] = field(default_factory=list)
    """slidedp: "POLICY[|BLOCKS]:B1,B2,..." entries measured in order in place of
    slidedp.activation over `batches` (e.g. "recompute:16,32", "selective|0-3:keep:24"; BLOCKS:
    that entry's slidedp.activation_blocks)."""
    routes: list[Route] = field(default_factory=list)
    """slidedp: "delivery/reduction" routes measured in turn (a peer runtime style runs its own);
    empty: slidedp.delivery/slidedp.reduction."""
    update_orders: list[UpdateOrderName] = field(default_factory=list)
    """slidedp: update orders each point is measured under; empty: slidedp.update_order."""
    embedding_updates: list[EmbeddingUpdate] = field(default_factory=list)
    """slidedp: embedding updates each point is measured under; empty: slidedp.embedding_update."""
    cpu_threads: list[Annotated[int, at_least(0)]] = field(default_factory=list)
    """slidedp: CPU Adam thread counts each point is measured with (a count other than 0 is
    appended to the row's label as -tN); empty: slidedp.cpu_threads."""
    warmup: Annotated[int, at_least(0)] = 1
    """Untimed steps of each point before its training.steps timed ones (SlideDP takes one more:
    its host updates run into the next step)."""
    sync: Literal["window", "step"] = "window"
    """When the timed steps wait for the device. "window": before the first and after the last,
    as the training loop runs (it never waits for the whole device): a step's time runs from its
    start to the next one's, so GPU work a step leaves queued (SlideDP's clipped GPU updates)
    overlaps the next step as in training. "step": after every step, so nothing overlaps."""
    label: str = ""
    """The rows' label (tables name a system by its mode and label)."""
    launch: Annotated[int, at_least(1)] = 1
    """Which launch of the same point this is (recipes/bench/headline.py)."""
    out: str = "outputs/bench/throughput.jsonl"
    """JSONL file the rows are appended to (its folder is made)."""
    trace_dir: str = ""
    """Profile one more step after the timed ones on rank 0: its Chrome trace goes here and the
    per-stream breakdown (recipes/bench/timeline.py) into the row; empty: none."""
    trace_batch: Annotated[int, at_least(0)] = 0
    """With trace_dir: trace only this local batch size (0: every one)."""
    autopolicy_batch: Annotated[int, at_least(0)] = 0
    """slidedp: after the points, run AutoPolicy (slidedp/plan/live.py) at this many sequences
    per GPU with slidedp.autopolicy_candidates and measure its choice (its policy file beside
    `out`); 0: not."""
    autopolicy_steps: Annotated[int, at_least(1)] = MEASURED_STEPS
    """Steps per AutoPolicy measurement (the first after a change is dropped)."""


@dataclass
class BenchConfig(JobConfig):
    """JobConfig with the bench's defaults for the trainer keys below and the [bench] section."""

    model: Model = field(default_factory=lambda: Model(flavor="qwen3-8B"))
    # Timed steps per point; no non-finite check by default, so that SlideDP without clipping
    # updates during backward instead of waiting for the step's norm.
    training: Training = field(default_factory=lambda: Training(seq_len=4096, steps=2,
                                                                nonfinite="off"))
    activation_checkpoint: ActivationCheckpoint = field(
        default_factory=lambda: ActivationCheckpoint(mode="full"))
    bench: Bench = field(default_factory=Bench)


class PointSpec(NamedTuple):
    policy: str
    """slidedp.activation of the entry."""
    blocks: str
    """slidedp.activation_blocks of the entry."""
    batches: list[int]


class Point(NamedTuple):
    """One measured point of a build."""

    policy: str
    blocks: str
    batch: int
    accum: int
    update_order: str | None
    cpu_threads: int
    embedding_update: str | None


def point_specs(points: list[str], *, blocks: str = "") -> list[PointSpec]:
    """`POLICY[|BLOCKS]:B1,B2` entries: BLOCKS (the slidedp.activation_blocks syntax, colons and
    all) overrides `blocks` for that entry; ValueError for one that does not read so."""
    specs = []
    for spec in points:
        policy, sep, batches = spec.rpartition(":")
        policy, _, own = policy.partition("|")
        if not (sep and policy and all(b.strip().isdigit() and int(b) > 0
                                       for b in batches.split(","))):
            raise ValueError(f"{spec!r}: expected POLICY[|BLOCKS]:B1,B2,... with batches >= 1")
        specs.append(PointSpec(policy, own or blocks, [int(b) for b in batches.split(",")]))
    return specs


def mode(cfg: BenchConfig) -> str:
    """What the bench measures, as rows name it: parallelism.mode, or "reference"."""
    return "reference" if cfg.bench.reference else cfg.parallelism.mode


def specs(cfg: BenchConfig) -> list[PointSpec]:
    """The entries of the points: bench.points, else slidedp.activation over the batches."""
    batches = cfg.bench.batches or [cfg.training.local_batch_size]
    entries = cfg.bench.points or [f"{cfg.slidedp.activation}:{','.join(map(str, batches))}"]
    return point_specs(entries, blocks=cfg.slidedp.activation_blocks)


def points(cfg: BenchConfig) -> list[Point]:
    """Every point of a build, in the order measured: entries x batches x accumulation x update
    orders x CPU threads x embedding updates (the last three SlideDP's alone)."""
    b, s = cfg.bench, cfg.slidedp
    slidedp = cfg.parallelism.mode == "slidedp" and not b.reference
    orders = (b.update_orders or [s.update_order]) if slidedp else [None]
    threads = (b.cpu_threads or [s.cpu_threads]) if slidedp else [0]
    embeddings = (b.embedding_updates or [s.embedding_update]) if slidedp else [None]
    return [Point(spec.policy, spec.blocks, batch, accum, order, t, embedding)
            for spec in specs(cfg) for batch in spec.batches
            for accum in b.accum or [cfg.training.grad_accum_steps]
            for order in orders for t in threads for embedding in embeddings]


def routes(cfg: BenchConfig) -> list[str]:
    """The routes a SlideDP build runs in turn (a peer style's own: its one); ["-"] otherwise."""
    if cfg.parallelism.mode != "slidedp" or cfg.bench.reference:
        return ["-"]
    if own := RUNTIME_STYLES[cfg.slidedp.runtime].routes:
        return ["/".join(own)]
    return list(cfg.bench.routes) or [f"{cfg.slidedp.delivery}/{cfg.slidedp.reduction}"]


def build_config(cfg: BenchConfig, route: str) -> BenchConfig:
    """The configuration a build starts with: the first point's batch and settings (SlideDP's
    start-up report is for them; DeepSpeed's engine takes that one micro-batch shape), the
    largest accumulation (SlideDP's FP32 gradient buffer holds it), and `route`."""
    first = points(cfg)[0]
    slidedp = cfg.slidedp
    if route != "-":
        delivery, reduction = route.split("/")
        slidedp = dataclasses.replace(
            slidedp, delivery=delivery, reduction=reduction, cpu_threads=first.cpu_threads,
            update_order=first.update_order, embedding_update=first.embedding_update)
    # Weights made on the meta device and initialized in place: DeepSpeed partitions a built
    # model, and checkpoint weights are loaded before sharding.
    meta = cfg.parallelism.mode in ("fsdp2", "slidedp") and not cfg.model.hf_dir
    training = dataclasses.replace(cfg.training, local_batch_size=first.batch,
                                   grad_accum_steps=max(p.accum for p in points(cfg)),
                                   init_on_meta=meta)
    return dataclasses.replace(cfg, training=training, slidedp=slidedp)


def check(cfg: BenchConfig, *, world: int) -> ModelArgs:
    """The model's architecture, after what the bench's settings ask of it and of each other is
    checked: a ConfigError names the key."""
    b, parallel = cfg.bench, cfg.parallelism.mode
    if b.reference and parallel != "single":
        raise ConfigError('bench.reference: measures the model resident on each GPU alone; '
                          f'parallelism.mode must stay "single", got "{parallel}"')
    if parallel == "deepspeed" and len(b.accum) > 1:
        raise ConfigError("bench.accum: deepspeed takes one micro-batch count per build")
    args = resolve_model(cfg)[1]
    try:
        entries = specs(cfg)
        if mode(cfg) == "slidedp":  # the other modes take activation_checkpoint.mode
            for spec in entries:
                block_policies(args.n_layers, default=spec.policy, blocks=spec.blocks,
                               keep_blocks=cfg.slidedp.keep_blocks)
    except ValueError as e:
        raise ConfigError(f"bench.points: {e}") from None
    check_seq_len(cfg.training.seq_len, args)
    if not b.reference:
        check_mode_options(build_config(cfg, routes(cfg)[0]), args, world=world)
    return args


def parse_bench_config(argv: list[str], *, world: int = 1) -> tuple[BenchConfig, ModelArgs]:
    """The bench's configuration of `argv` (`--job.config_file`, `--section.key=value`) and the
    model's architecture; a ConfigError on any mistake, before any work starts."""
    cfg = cast(BenchConfig, parse_config(argv, BenchConfig))
    return cfg, check(cfg, world=world)
