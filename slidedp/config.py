"""The `[slidedp]` TOML section."""

from dataclasses import dataclass
from typing import Annotated, Literal

from protocols.bounds import Checked, at_least, within
from slidedp.update_order import UpdateOrderName

DeliveryRoute = Literal["replicated", "sharded"]
"""Host->GPU parameter routes (slidedp/routes/delivery.py)."""
ReductionRoute = Literal["gpu", "cpu", "locked"]
"""GPU->host gradient routes (slidedp/update.py)."""
RuntimeName = Literal["slidedp", "slideformer", "megatrain"]
"""The runtime's own policies, or a peer system's re-implemented on it (slidedp/peer_styles.py)."""
EmbeddingUpdate = Literal["host", "gpu", "resident"]
"""Where the embedding's AdamW runs (slidedp/gpu_update.py)."""
MomentsDtype = Literal["float32", "bfloat16", "8bit"]
"""The dtype of the Adam moments in host memory (slidedp/host_state.py)."""
NodesState = Literal["replicated", "sharded"]
"""How several nodes hold the host state (slidedp/nodes.py, slidedp/node_shards.py)."""


@dataclass
class SlideDPConfig(Checked):
    """Knobs of the host-resident streaming runtime (used when parallelism.mode = "slidedp")."""

    runtime: RuntimeName = "slidedp"
    """Whose data-parallel policies to run: "slidedp" (this runtime's), or a re-implementation of
    a peer's published design on the same engine for comparison: "slideformer" (replicated
    delivery, full gradients home, rank 0 alone sums and updates, a barrier per chunk) or
    "megatrain" (BF16 host weights, one locked shared gradient sum, the update after the whole
    backward); a peer style sets delivery, reduction and bf16_shadow itself."""
    delivery: DeliveryRoute = "sharded"
    """Parameter route host->GPU: "replicated" (every rank copies the whole block) or "sharded"
    (each rank copies 1/R, then all-gather on the GPUs)."""
    reduction: ReductionRoute = "gpu"
    """Gradient route GPU->host: "gpu" (reduce-scatter on the GPUs, one aggregated shard per rank
    returns), "cpu" (every rank returns its full gradient, the host sums) or "locked" (every rank
    adds its full gradient into one shared FP32 sum under one host lock; updates then wait for
    the whole backward)."""
    window_slots: Annotated[int, at_least(2)] = 3
    """GPU parameter slots for transformer blocks (>= 2: one computing, one being delivered)."""
    chunk_mib: Annotated[float, within(0, 1024, low_open=True)] = 32.0
    """Chunk size in MiB (at most 1024) for the cast/H2D and D2H/update pipelines inside a block."""
    activation: str = "recompute"
    """Activation policy of every block: "keep", "recompute", "selective" (attention outputs
    saved), "segments(S+S...)" (the named block segments kept, the rest replayed),
    "ops(matmul+attention)" (those ops' outputs saved), each optionally "@offload=F" (a fraction
    F of what the block saves goes to host memory); docs/USAGE.md "Activation policies"."""
    activation_blocks: str = ""
    """Per-block overrides, "BLOCKS:POLICY, ..." with BLOCKS one block or FIRST-LAST (0-based,
    inclusive), e.g. "0-3:keep, 30-35:recompute@offload=0.5"; a later entry wins."""
    keep_blocks: Annotated[int, at_least(0)] = 0
    """Shorthand: the first N blocks keep (before activation_blocks applies)."""
    cpu_threads: Annotated[int, at_least(0)] = 0
    """CPU Adam threads per rank; 0 = this rank's share of the host's cores."""
    pin_threads: bool = False
    """Pin this rank's threads to its share of the cores, one NUMA node's where the host has
    several: the delivery thread and each CPU Adam worker to a core of their own
    (slidedp/affinity.py); off: the OS scheduler places them."""
    speculative_update: bool = False
    """With clipping or the non-finite guard, update each unit as its gradient comes home as if
    nothing clipped, and redo it scaled once the step's norm says it clips (slidedp/speculative.py):
    exact, at the cost of the optimizer state once more in host memory and a copy per update.
    One micro-batch, reduction = "gpu", every update on the host."""
    update_order: UpdateOrderName = "arrival"
    """Which runnable update runs first: "arrival" (as the gradients came home, each update as
    early as possible) or "next_use" (the unit the next step needs first)."""
    embedding_update: EmbeddingUpdate = "host"
    """Where the embedding's AdamW runs: "host" (the CPU Adam, like every unit) or "gpu" (its
    FP32 master and moments come to the GPU during the last blocks' backward, are updated there
    and go home after; the embedding's gradient, the head's too when tied, is the last of
    backward, and its host update is the tail before the next forward; one micro-batch,
    reduction = "gpu"; slidedp/gpu_update.py) or "resident" (its FP32 master and moments stay
    on the GPU and update there; the host copy is refreshed only for saves)."""
    gpu_state_blocks: Annotated[int, at_least(0)] = 0
    """The first N blocks keep their FP32 master and Adam moments and a BF16 copy (this rank's
    shard, 14 B/param) in GPU memory, update there with torch's fused AdamW and are delivered
    from there, the host copy refreshed only for saves: the next forward needs them first, so
    under clipping it no longer waits for their CPU updates. One micro-batch, reduction = "gpu",
    delivery = "sharded" on several ranks (slidedp/gpu_update.py). All of them, with
    embedding_update = "resident": the head's too, and the step's norm and clipping are taken on
    the GPU, so its updates are queued behind backward without a host sync."""
    bf16_shadow: bool = True
    """Keep a BF16 copy of the master weights in shared memory, written by the fused Adam pass,
    as the delivery source (half the H2D bytes; without it the FP32 master is copied and cast on
    the GPU). 2 bytes/param of host memory, none more than without it when updates wait for the
    step's norm: it then also holds the returned gradients."""
    moments_dtype: MomentsDtype = "float32"
    """The Adam moments' dtype in host memory: "bfloat16" takes 10 B/param instead of 14 and 8
    fewer bytes per parameter through DRAM in each update; the fused CPU Adam widens them exactly,
    updates in FP32 and rounds them back to nearest even. "8bit" takes 8 B/param: torchao's
    AdamW8bit format (a dynamic-tree byte code per element, one FP32 absmax per 128), dequantized,
    updated in FP32 and requantized in the same pass; fewer bytes, but the code lookups make
    its update compute-bound (docs/PERFORMANCE.md). Resident optimizer state on the GPU keeps
    BF16 moments as BF16 there too (10 B/param of GPU memory, not 14), updated the same way;
    "8bit" only with every unit's state at home (embedding_update = "host", no
    gpu_state_blocks)."""
    autopolicy: bool = False
    """Choose the routes, chunk, slots and per-block activation policies at start by measuring
    this machine (AutoPolicy: a few steps with lr = 0, then the optimizer state is reset); the
    choice is written to <job.dump_folder>/slidedp_policy.toml, which `policy_file` loads."""
    autopolicy_candidates: str = ""
    """The per-block policies AutoPolicy screens, comma-separated (empty: its default set of
    keep, recompute, selective, op-level saves and segment masks, each with offload 0, 0.5, 1)."""
    policy_file: str = ""
    """A TOML file with a [slidedp] table (AutoPolicy writes one) whose keys replace these."""
    replica_check_every: Annotated[int, at_least(0)] = 100
    """With several nodes, every N steps compare a checksum of each node's replica of the
    master weights and Adam moments with node 0's, and end the run if one diverged (0: never);
    a check waits for its step's updates first (slidedp/nodes.py)."""
    nodes_state: NodesState = "replicated"
    """With several nodes: "replicated" (each node holds the whole host state) or "sharded"
    (each node holds its ranks' 1/N of it; slidedp/node_shards.py)."""
    check_host_memory: bool = True
    """Refuse to start when the host state and the ranks' activation offload pools exceed
    MemAvailable (off for VMs whose memory grows on demand and under-reports at start)."""
