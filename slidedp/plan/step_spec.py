"""What the step-time model (slidedp/plan/steptime.py) needs about one run's step, built from
a run's configuration by slidedp/plan/predict.py's step_spec."""

from dataclasses import dataclass
from typing import Literal

from slidedp.config import MomentsDtype
from slidedp.plan.link import Link
from slidedp.plan.workload import MicroBatchWork

Schedule = Literal["slidedp", "slideformer"]
Speculative = Literal["off", "stands", "redone"]


@dataclass(frozen=True)
class StepSpec:
    """Everything the model needs about one run's step."""

    world: int
    """Ranks (one GPU each) on the host."""
    slots: int
    """slidedp.window_slots."""
    delivery: str
    """"replicated" or "sharded"."""
    reduction: str
    """"gpu" or "cpu"."""
    chunk_elems: int
    """Elements per chunk of the copy and update pipelines."""
    bf16_shadow: bool
    """Deliver from the BF16 shadow (else the delivery thread casts the FP32 master)."""
    micro_batches: int
    """training.grad_accum_steps."""
    deferred: bool
    """Updates wait for the step's norm (clipping or the non-finite guard)."""
    grad_accum: bool
    """The FP32 host gradient buffer exists (accumulation, clipping or the guard)."""
    threads: int
    """CPU Adam threads per rank."""
    cores: int
    """Cores of the host (SlideFormer's rank 0 updates with all of them)."""
    unit_elems: tuple[int, ...]
    """Padded elements of each unit: embedding, blocks, head."""
    work: MicroBatchWork
    """GPU seconds of one micro-batch's uses."""
    offload: tuple[float, ...]
    """Each block's offload fraction."""
    offload_bytes: tuple[int, ...]
    """Each block's offloaded bytes per micro-batch."""
    tokens: int
    """Tokens per step over all ranks."""
    schedule: Schedule = "slidedp"
    """"slidedp", or SlideFormer's data parallelism (module docstring)."""
    kernels: str = ""
    """The model's kernels ("liger", "torch"), for the advice."""
    embedding_on_gpu: bool = False
    """The embedding's AdamW runs on the GPU, its state streamed there each step
    (slidedp.embedding_update = "gpu")."""
    resident_units: frozenset[int] = frozenset()
    """Units whose optimizer state and a BF16 copy stay on the GPU (0 the embedding, 1 + i block
    i: slidedp.gpu_state_blocks, embedding_update = "resident")."""
    moments: MomentsDtype = "float32"
    """The host's Adam moments' format (slidedp.moments_dtype)."""
    speculative: Speculative = "off"
    """Speculative updates of a deferred step (slidedp.speculative_update), as the step's norm
    turns out: "stands" (it does not clip: each update runs as its gradient comes home, after
    copying its state aside) or "redone" (it clips: the deferred updates, each after restoring
    the copy; the speculative passes themselves, which run while backward does, are not
    counted)."""
    nodes: int = 1
    """Nodes of `world` ranks each (replicated host state per node, slidedp/nodes.py); `tokens`
    counts every node's."""
    link: Link | None = None
    """The nodes' network (needed when `nodes` > 1)."""
    sharded_nodes: bool = False
    """The host state is sharded across the nodes (slidedp.nodes_state = "sharded"): every rank
    of every node owns a shard, and the collectives span the nodes."""
    device_sync: bool = False
    """The loop waits for the whole device after each step (the bench's `sync = "step"`): no
    step's deferred updates on the GPU overlap the next step (those on the host still do)."""

    @property
    def waits_for_norm(self) -> bool:
        """The host updates run after the step's norm (deferred, and not standing speculations)."""
        return self.deferred and self.speculative != "stands"

    @property
    def n_blocks(self) -> int:
        return len(self.unit_elems) - 2
