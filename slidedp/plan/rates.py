"""A machine's rates: what the step-time model (slidedp/plan/steptime.py) turns into seconds.

One `Rates` is one JSON file. The probe (slidedp/plan/probe.py) measures it and caches it in
`cache_dir()`, one file per machine (hostname, device name and count, cores) and model
(architecture, kernels); `slidedp/plan/rates/*.json` ship the machines we know (figures measured
in the dated folders under docs/results/) and the paper's platforms (from published specs,
labelled so), so a plan can be made for hardware one does not have.

GPU compute comes from measured block timings (`blocks`, per sequence at one sequence length)
where the probe took them, else from the FLOP count of the policy (slidedp/plan/workload.py) at
an effective rate (`gpu_tflops`); at a length where attention was timed (`attention_tflops`),
the attention core at its own rate.
"""

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from protocols.model_spec import ModelArgs
from slidedp import native_build
from slidedp.activations import BlockCost, Bytes

SHIPPED = Path(__file__).parent / "rates"
"""The rates files that ship with the planner (`--rates NAME` finds them by name)."""

SCHEMA = 1
"""Version of the file format."""


class MissingRate(KeyError):
    """The rates lack a figure the plan needs (said in one line by `python -m recipes.plan`)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Machine:
    """What the rates were taken on."""

    name: str
    """In words, e.g. "2 x NVIDIA H200 (NV18), 32 cores"."""
    source: Literal["measured", "recorded", "spec"]
    """"measured": by the probe on this machine; "recorded": taken from logged runs
    (docs/results/); "spec": derived from published specifications (not measured)."""
    hostname: str
    """The host (empty for recorded and spec files)."""
    device: str
    """Device name as torch reports it ("cpu" when the device is the CPU)."""
    devices: int
    """Devices (ranks) the rates are for."""
    cores: int
    """CPU cores the ranks share."""
    device_memory_gib: float
    """Memory of one device, GiB (0: unknown)."""
    host_memory_gib: float
    """Host memory, GiB."""
    note: str = ""
    """Where each figure comes from."""

    @property
    def on_cpu(self) -> bool:
        """The device is the CPU (its memory is the host's)."""
        return self.device == "cpu"

    @property
    def device_word(self) -> str:
        """What the ranks compute on, in words: "GPU", or "device" where it is the CPU."""
        return "device" if self.on_cpu else "GPU"

    def key(self) -> str:
        """The cache key of a machine: host, device, count and cores."""
        return f"{self.hostname or 'host'}-{self.device}-x{self.devices}-c{self.cores}".replace(" ", "_")


@dataclass(frozen=True)
class BlockTiming:
    """Measured GPU time of one block (or the head, or the embedding) per sequence."""

    forward_s: float
    """Forward seconds per sequence."""
    backward_s: float
    """Backward seconds per sequence, the policy's replay included."""
    batch: int
    """Sequences per micro-batch it was measured at (divided out)."""


@dataclass(frozen=True)
class Rates:
    """Per-resource rates of one machine (and, where measured, one model on it)."""

    machine: Machine
    """What they were taken on."""
    h2d_gbs: float
    """Pinned host->device copy, GB/s per device, one device copying."""
    d2h_gbs: float
    """Device->host, GB/s per device, one device copying."""
    h2d_together_gbs: float
    """Host->device GB/s per device when every device copies at once (host contention)."""
    d2h_together_gbs: float
    """Device->host GB/s per device when every device copies at once."""
    copy_latency_s: float
    """Fixed cost of one copy (a chunk), seconds."""
    all_gather_gbs: float
    """All-gather of a block across the devices: bytes of the gathered block per second."""
    reduce_scatter_gbs: float
    """Reduce-scatter of a block's gradient: bytes of the whole block per second."""
    collective_latency_s: float
    """Fixed cost of one collective, seconds."""
    dram_gbs: float
    """Host memory bandwidth with every core (STREAM triad: read + write bytes per second)."""
    adam_gparams: dict[int, float]
    """CPU AdamW (BF16 gradient in, 28 B/param), Gparam/s by thread count."""
    grad_sum_gelems: dict[int, float]
    """Host gradient sum (cpu_adam.grad_accumulate of a BF16 source into FP32), Gelem/s by
    thread count."""
    cast_gbs: dict[int, float]
    """FP32 -> BF16 cast into pinned memory on the CPU (delivery without a shadow), GB/s of FP32
    read, by thread count."""
    gpu_tflops: dict[str, float]
    """Effective TFLOP/s of the FLOP model, by "flavor/kernels" or "kernels" (the fallback)."""
    uplink_gbs: float = 0.0
    """A PCIe switch's uplink to the host, GB/s each way, shared by `gpus_per_uplink` devices
    (0: every device has its own path to the host; the totals above still apply)."""
    gpus_per_uplink: int = 1
    """Devices behind one uplink (devices r and r+1 share one when 2)."""
    collective_pcie_share: float = 0.0
    """Share of a collective's traffic on each device (what it sends and receives) that crosses
    its PCIe link and the host: 0 over NVLink/NVSwitch, 1 without any GPU interconnect, between
    for NVLink bridges that join pairs."""
    hbm_gbs: float = 4000.0
    """Device memory bandwidth a memory-bound kernel reaches, GB/s (the embedding's AdamW on the
    GPU, slidedp.embedding_update = "gpu"). Not measured on a GPU: the default is about an
    H200's effective rate (4.8 TB/s peak); where the device is the CPU, the STREAM triad's."""
    compute_dtype: Literal["bf16", "fp32"] = "bf16"
    """What the blocks, the head and the embedding were timed in (a run's: training.dtype in
    single and fsdp2, BF16 in slidedp and deepspeed)."""
    attention_tflops: dict[str, float] = field(default_factory=dict)
    """Causal attention's forward + backward TFLOP/s by `timing_key(flavor, seq)`, measured
    (recipes/bench/attention.py, which counts forward 2 and backward 5 half-size matmuls). Where
    absent the attention core counts as a matmul at `gpu_tflops`, whose fit at 4,096 tokens
    includes it; at long sequences attention is most of a block and runs at neither rate."""
    blocks: dict[str, BlockTiming] = field(default_factory=dict)
    """Measured timings by `timing_key` (blocks under each policy, "head", "embed")."""
    costs: dict[str, BlockCost] = field(default_factory=dict)
    """Measured activation costs by `timing_key` (slidedp/activations/cost.py)."""
    model: str = ""
    """`model_key` of the model whose timings and costs these are (empty: machine rates only)."""
    adam_8bit_gparams: dict[int, float] = field(default_factory=dict)
    """CPU AdamW with 8-bit moments (slidedp.moments_dtype = "8bit"), Gparam/s by thread count:
    bound by its code lookups rather than by bytes, so not derived from `adam_gparams` (empty:
    not measured on this machine)."""
    issue_s: dict[str, float] = field(default_factory=dict)
    """Host seconds to issue (launch, not run) one micro-batch's use of a unit on the GPU, by
    `issue_key(kernels, what)`: a block's forward or backward under a policy, the head, the
    embedding. The same at any batch and width (the same ops are launched); the GPU waits for
    them where they exceed its work (few sequences). 0 where the device is the CPU (its ops run
    as they are issued); a use not measured counts 0."""

    # ---- lookups -------------------------------------------------------------------------------

    def adam(self, threads: int) -> float:
        """AdamW parameters per second with `threads` threads."""
        return by_threads(self.adam_gparams, threads) * 1e9

    def adam_8bit(self, threads: int) -> float:
        """AdamW parameters per second with 8-bit moments, with `threads` threads."""
        if not self.adam_8bit_gparams:
            raise MissingRate(f"rates of {self.machine.name}: no 8-bit AdamW rate measured "
                              "(slidedp.moments_dtype = \"8bit\"; `python -m recipes.probe` on "
                              "that machine measures it)")
        return by_threads(self.adam_8bit_gparams, threads) * 1e9

    def grad_sum(self, threads: int) -> float:
        """Gradient-sum elements per second with `threads` threads."""
        return by_threads(self.grad_sum_gelems, threads) * 1e9

    def cast(self, threads: int) -> float:
        """Cast bytes (FP32 read) per second with `threads` threads."""
        return by_threads(self.cast_gbs, threads) * 1e9

    def tflops(self, flavor: str, kernels: str) -> float:
        """The effective rate of the FLOP model for `flavor` on `kernels`."""
        rate = self.gpu_tflops.get(f"{flavor}/{kernels}", self.gpu_tflops.get(kernels))
        if rate is None:
            raise MissingRate(f"rates of {self.machine.name}: no GPU rate for {flavor} on the "
                           f"{kernels} kernels (gpu_tflops has {', '.join(self.gpu_tflops)})")
        return rate

    def attention(self, flavor: str, seq: int) -> float | None:
        """The measured attention rate of `flavor` at `seq`, if any."""
        return self.attention_tflops.get(timing_key(flavor, seq))

    def issue(self, kernels: str, what: str) -> float:
        """Host seconds to issue `what` on `kernels` (`issue_s`), 0 where not measured."""
        return self.issue_s.get(issue_key(kernels, what), 0.0)

    def with_model(self, model: str, blocks: dict[str, BlockTiming],
                   costs: dict[str, BlockCost]) -> "Rates":
        """These machine rates with one model's timings and costs."""
        return Rates(**{**{f.name: getattr(self, f.name) for f in fields(self)},
                        "model": model, "blocks": blocks, "costs": costs})

    # ---- files ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "Rates":
        if data.get("schema") != SCHEMA:
            raise ValueError(f"rates schema {data.get('schema')!r}, this planner reads {SCHEMA}")
        data = {k: v for k, v in data.items() if k != "schema"}
        for key in ("adam_gparams", "grad_sum_gelems", "cast_gbs", "adam_8bit_gparams"):
            data[key] = {int(t): float(v) for t, v in data.get(key, {}).items()}
        data["machine"] = Machine(**data["machine"])
        data["blocks"] = {k: BlockTiming(**v) for k, v in data.get("blocks", {}).items()}
        data["costs"] = {k: BlockCost(**{**v, "gpu": Bytes(**v["gpu"]), "host": Bytes(**v["host"])})
                         for k, v in data.get("costs", {}).items()}
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write atomically (a rename), so a reader never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)


def load_rates(name_or_path: str) -> Rates:
    """A rates file by path, or by the name of a shipped one (`h200x2` for rates/h200x2.json)."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = SHIPPED / f"{name_or_path}.json"
        if not shipped.is_file():
            raise FileNotFoundError(f"no rates file {name_or_path!r} (shipped: {shipped_names()})")
        path = shipped
    try:
        return Rates.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a rates file ({e})") from None


def shipped_names() -> str:
    """The shipped rates files by name, comma-separated."""
    return ", ".join(sorted(p.stem for p in SHIPPED.glob("*.json")))


def by_threads(table: dict[int, float], threads: int) -> float:
    """A rate measured at some thread counts, at `threads`: linear between the counts measured,
    proportional below the first, flat above the last (no extrapolation of scaling)."""
    counts = sorted(table)
    if threads <= counts[0]:
        return table[counts[0]] * threads / counts[0]
    for lo, hi in zip(counts, counts[1:]):
        if threads <= hi:
            return table[lo] + (table[hi] - table[lo]) * (threads - lo) / (hi - lo)
    return table[counts[-1]]


def model_key(args: ModelArgs, kernels: str, dtype: str = "bf16") -> str:
    """The cache key of a model: its architecture (a hash: a custom hf_dir has no flavor name),
    the kernels and the dtype it computes in (FP32 timings apart from the BF16 ones)."""
    digest = hashlib.sha1(repr(args).encode()).hexdigest()[:10]
    suffix = "" if dtype == "bf16" else f"-{dtype}"
    return f"{args.family}-d{args.dim}-l{args.n_layers}-{digest}-{kernels}{suffix}"


def timing_key(what: str, seq: int) -> str:
    """Key of a measured timing or cost: a policy's name (or "head", "embed") at `seq`."""
    return f"{what}@{seq}"


def issue_key(kernels: str, what: str) -> str:
    """Key of a measured issue time: the kernels and the use ("keep/forward", "head", ...)."""
    return f"{kernels}/{what}"


def cache_dir() -> Path:
    """`$SLIDEDP_RATES_DIR`, else `rates/` in the runtime's cache (`$SLIDEDP_CACHE_DIR`, else
    ~/.cache/slidedp)."""
    if os.environ.get("SLIDEDP_RATES_DIR"):
        return Path(os.environ["SLIDEDP_RATES_DIR"])
    return native_build.cache_dir() / "rates"


def cache_path(machine: Machine, model: str) -> Path:
    """Where the probe caches the rates of `machine` for `model`."""
    return cache_dir() / f"{machine.key()}--{model}.json"


def this_host() -> str:
    return socket.gethostname()
