"""The one authoritative training state of a node, in shared memory.

Local rank 0 creates an anonymous memory file (memfd: no name in any filesystem, and not bounded
by /dev/shm's size), the other local ranks open it through /proc/<pid>/fd/<fd> and map it, and it
closes its descriptor once all have mapped it: the memory then lives exactly as long as some rank
still maps it, so it is released on normal exit, on an exception and when a rank is killed (there
are no stale segments to clean up by hand). A node that holds only its ranks' shards
(slidedp/node_shards.py) maps the same offsets and touches only those, so only their pages
exist. On CUDA machines the ranges that DMA engines touch are registered
as pinned memory (cudaHostRegister), so each byte exists once and copies are asynchronous.

Regions (elements = StateLayout.total, i.e. every unit padded to world * SHARD_ALIGN):
  master fp32, exp_avg fp32, exp_avg_sq fp32     12 bytes/param, always (a BF16 master, 10 in
                                                  all, for slidedp.runtime = "megatrain"; BF16
                                                  moments, 8, for slidedp.moments_dtype =
                                                  "bfloat16"; 8-bit, 6, for "8bit")
  exp_avg_scale fp32, exp_avg_sq_scale fp32       4/128 bytes/param each, only for 8-bit moments
                                                  (one absmax per cpu_adam.MOMENT_BLOCK elements)
  shadow bf16                                     2 bytes/param, when bf16_shadow (delivery source;
                                                  with one micro-batch it also holds each unit's
                                                  returned gradient until the unit's update)
  grad_bf16 bf16                                  2 bytes/param, without the shadow when updates
                                                  wait for the step's norm (clipping or the
                                                  non-finite guard), one micro-batch, gpu route
  grad_accum fp32                                 4 bytes/param, only with gradient accumulation
                                                  or reduction="locked" (one sum every rank adds
                                                  its whole gradient into, under one lock)
  staging bf16 x world                            2*R bytes/param, only for reduction="cpu"
                                                  (every rank returns its full gradient; it also
                                                  holds a deferred step's gradients)
  redo_* (as their regions)                       the optimizer state once more, only for
                                                  slidedp.speculative_update (slidedp/speculative.py;
                                                  with the bf16 grad buffer beside the shadow)
  control int64                                   per-unit version / ready / consumed counters
"""

import fcntl
import mmap
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from slidedp.config import MomentsDtype, SlideDPConfig
from slidedp.cpu_adam import MOMENT_BLOCK, moment_scales
from slidedp.layout import SHARD_ALIGN, NodeShards, StateLayout, Unit
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.routes import REDUCTIONS
from slidedp.streams import register_host, unregister_host

_CONTROL_FIELDS = ("version", "ready", "consumed")
STATE_LABEL = "slidedp-host-state"
"""The shared host state's memfd name (/proc/PID/maps shows it)."""
MOMENT_SCALES = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
"""The scale region of each 8-bit moment region: one FP32 per MOMENT_BLOCK elements."""
REDO_PREFIX = "redo_"
"""The speculative updates' copy of a state region (slidedp/speculative.py)."""
assert SHARD_ALIGN % MOMENT_BLOCK == 0  # no rank's shard or chunk splits a block of scales


def updates_deferred(*, max_norm: float, nonfinite: str, reduction: str = "gpu") -> bool:
    """The updates wait for the step's global norm: to clip, to skip a non-finite step (the
    guard, unless training.nonfinite = "off"), or on the locked route, whose one sum is complete
    only when every rank's backward is."""
    return max_norm > 0 or nonfinite != "off" or REDUCTIONS[reduction].defers_updates


class StepAborted(RuntimeError):
    """A runtime job stopped waiting because the step it served failed on this rank."""


@dataclass(frozen=True)
class HostStatePlan:
    """Which optional regions exist; fixes the byte size before anything is allocated."""

    bf16_shadow: bool
    """Keep a BF16 copy of the master weights (the delivery source)."""
    grad_bf16: bool
    """Keep a BF16 gradient buffer: without the shadow, the gpu route's reduced gradients wait
    there for updates deferred to the step's norm."""
    grad_accum: bool
    """Keep an FP32 gradient buffer (accumulation over micro-batches)."""
    cpu_staging: bool
    """Per-rank full-gradient return buffers (CPU-side reduction)."""
    bf16_master: bool = False
    """The master weights are BF16 (slidedp.runtime = "megatrain"): 2 bytes/param, not 4."""
    grad_lock: bool = False
    """The ranks add their gradients into `grad_accum` under one host lock (reduction="locked")."""
    redo: bool = False
    """Speculative updates (slidedp.speculative_update, when updates are deferred): a copy of
    the optimizer state to redo an update from, and the gradients in `grad_bf16`."""
    moments: MomentsDtype = "float32"
    """The Adam moments' format (slidedp.moments_dtype): 8, 4 (BF16) or 2 (8-bit, plus a scale
    per 128) bytes/param."""

    @classmethod
    def for_run(cls, cfg: SlideDPConfig, *, grad_accum_steps: int, max_norm: float,
                nonfinite: str) -> "HostStatePlan":
        """The regions a run needs. Accumulated gradients are summed in FP32. With one
        micro-batch a gradient is BF16 as reduced, so it waits as BF16 when the updates wait for
        the step's global norm (clipping, or the non-finite guard unless training.nonfinite =
        "off"): in the shadow, whose unit is not read again before its update; without one in
        its own BF16 region; on the cpu route in the staging copies, summed again at the update.
        The runtime style (slidedp/peer_styles.py) sets its routes, shadow and master first."""
        style = RUNTIME_STYLES[cfg.runtime]
        cfg = style.configure(cfg)
        route = REDUCTIONS[cfg.reduction]
        deferred = updates_deferred(max_norm=max_norm, nonfinite=nonfinite, reduction=cfg.reduction)
        redo = deferred and cfg.speculative_update
        regions = route.regions(deferred=deferred, accumulate=grad_accum_steps > 1,
                                shadow=cfg.bf16_shadow, redo=redo)
        return cls(bf16_shadow=cfg.bf16_shadow, grad_bf16="grad_bf16" in regions, redo=redo,
                   grad_accum="grad_accum" in regions, cpu_staging="staging" in regions,
                   bf16_master=style.bf16_master, grad_lock=route.shared_sum,
                   moments=cfg.moments_dtype)

    def state_regions(self) -> tuple[str, ...]:
        """The regions of the optimizer state proper (what a save holds)."""
        scales = tuple(MOMENT_SCALES.values()) if self.moments == "8bit" else ()
        return ("master", "exp_avg", "exp_avg_sq", *scales)

    def describe(self) -> str:
        """The optional regions, as the start-up report names them."""
        optional = ((self.bf16_shadow, "bf16 shadow"), (self.grad_bf16, "bf16 grad buffer"),
                    (self.grad_accum and not self.grad_lock, "fp32 grad buffer"),
                    (self.grad_lock, "one locked fp32 grad sum"),
                    (self.redo, "redo copy of the state"),
                    (self.cpu_staging, "per-rank grad staging"))
        moments = {"float32": "fp32", "bfloat16": "bf16", "8bit": "8-bit"}[self.moments]
        master = f"{'bf16' if self.bf16_master else 'fp32'} master+{moments} moments"
        return " + ".join([master, *(name for present, name in optional if present)])


def _region_sizes(layout: StateLayout, plan: HostStatePlan) -> list[tuple[str, torch.dtype, int]]:
    n, world = layout.total, layout.world
    moments = {"float32": torch.float32, "bfloat16": torch.bfloat16, "8bit": torch.uint8}[plan.moments]
    regions = [("master", torch.bfloat16 if plan.bf16_master else torch.float32, n),
               ("exp_avg", moments, n),
               ("exp_avg_sq", moments, n)]
    if plan.moments == "8bit":
        regions += [(scale, torch.float32, moment_scales(n)) for scale in MOMENT_SCALES.values()]
    if plan.bf16_shadow:
        regions.append(("shadow", torch.bfloat16, n))
    if plan.grad_bf16:
        regions.append(("grad_bf16", torch.bfloat16, n))
    if plan.grad_accum:
        regions.append(("grad_accum", torch.float32, n))
    if plan.cpu_staging:
        regions.append(("staging", torch.bfloat16, n * world))
    if plan.redo:
        regions += [(REDO_PREFIX + name, dtype, numel) for name, dtype, numel in list(regions)
                    if name in plan.state_regions()]
    regions.append(("control", torch.int64, len(_CONTROL_FIELDS) * len(layout.units) * world))
    return regions


def host_state_regions(layout: StateLayout, plan: HostStatePlan) -> dict[str, int]:
    """Bytes of each region of the shared mapping (each 4 KiB aligned)."""
    return {name: -(-numel * dtype.itemsize // 4096) * 4096
            for name, dtype, numel in _region_sizes(layout, plan)}


def host_state_bytes(layout: StateLayout, plan: HostStatePlan,
                     shards: NodeShards | None = None) -> int:
    """Exact size of the shared mapping (each region 4 KiB aligned); with `shards` that hold
    part of every unit (slidedp/node_shards.py), the bytes a node's memory holds: that part of
    every region."""
    total = sum(host_state_regions(layout, plan).values())
    return total if shards is None or shards.whole else total * shards.count // shards.world


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return meminfo[field]


def available_host_bytes() -> int:
    """Memory the kernel reports as available for new allocations (MemAvailable)."""
    return _meminfo_bytes("MemAvailable")


def total_host_bytes() -> int:
    """The host's physical memory (MemTotal)."""
    return _meminfo_bytes("MemTotal")


class HostLock:
    """One lock of the local ranks: an flock on a file that every rank opened (each its own open
    file description, so the ranks exclude each other), unlinked as soon as all have it."""

    def __init__(self, *, rank: int, share: Callable[[str], str], barrier: Callable[[], None]):
        path = ""
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="slidedp-grad-lock-")
            os.close(fd)
        path = share(path)
        self._fd = os.open(path, os.O_RDWR)
        barrier()
        if rank == 0:
            os.unlink(path)

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


def widened(spans: list[tuple[int, int]], start: int, end: int
            ) -> tuple[tuple[int, int], list[tuple[int, int]]] | None:
    """The one registration that covers [start, end) and every range of `spans` (disjoint) it
    overlaps, with those ranges (to unregister first); None if one range covers it already."""
    if any(a <= start and end <= b for a, b in spans):
        return None
    absorbed = [(a, b) for a, b in spans if a < end and start < b]
    return (min([start] + [a for a, _ in absorbed]), max([end] + [b for _, b in absorbed])), absorbed


class SharedHostState:
    """The mapped regions, as flat CPU tensors shared by every local rank."""

    def __init__(self, layout: StateLayout, plan: HostStatePlan, *, rank: int, world: int,
                 share: Callable[[str], str], barrier: Callable[[], None], pin: bool,
                 label: str = STATE_LABEL, shards: NodeShards | None = None):
        """`rank` of `world`: this rank's shard of every unit; `share(path)` broadcasts the
        node's first rank's string to every local rank; `barrier()` syncs them; `label` names
        the memfd (/proc/PID/maps: one per node, slidedp/nodes.py); `shards`: the part of every
        unit this node holds (default all): the mapping keeps the whole layout's offsets, and
        only that part of it is ever touched, so only its pages exist."""
        self.layout, self.plan, self.rank, self.world = layout, plan, rank, world
        self.shards = shards or NodeShards(first=0, count=world, world=world)
        self.local_rank = rank - self.shards.first
        self.nbytes = host_state_bytes(layout, plan)
        self.held_bytes = host_state_bytes(layout, plan, self.shards)
        path = ""
        if self.local_rank == 0:
            fd = os.memfd_create(label, os.MFD_CLOEXEC)
            os.ftruncate(fd, self.nbytes)
            path = f"/proc/{os.getpid()}/fd/{fd}"
        path = share(path)
        if self.local_rank != 0:
            fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        finally:
            barrier()  # rank 0's descriptor must outlive every rank's open()
            os.close(fd)
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._raw = raw
        self.regions: dict[str, torch.Tensor] = {}
        offset = 0
        for name, dtype, numel in _region_sizes(layout, plan):
            nbytes = numel * dtype.itemsize
            self.regions[name] = raw[offset:offset + nbytes].view(dtype)
            offset += -(-nbytes // 4096) * 4096
        n_units = len(layout.units)
        ctrl = self.regions["control"].view(len(_CONTROL_FIELDS), n_units, world)
        self.version, self.ready, self.consumed = ctrl[0], ctrl[1], ctrl[2]
        self.aborted = threading.Event()  # this rank's step failed: runtime threads stop waiting
        self.grad_lock = (HostLock(rank=self.local_rank, share=share, barrier=barrier)
                          if plan.grad_lock else None)
        self._registered: list[int] = []
        self._pin = pin
        # Per region, the registered element ranges, page-aligned and disjoint: CUDA refuses
        # to register a page twice, and neighbouring units share their boundary pages.
        self._pinned: dict[str, list[tuple[int, int]]] = {}
        if pin:
            for name in ("shadow", "grad_bf16", "staging", "master"):
                if name in self.regions and (name != "master" or not plan.bf16_shadow):
                    # The DMA engines read and write the shared bytes directly (registering
                    # allocates: only the node's part of each unit).
                    for start, end in self.held_ranges(self.regions[name].numel()):
                        self._pin_range(name, start, end)

    def held_ranges(self, numel: int) -> list[tuple[int, int]]:
        """The element ranges of a flat region of `numel` elements that this node holds."""
        if self.shards.whole:
            return [(0, numel)]
        return [(u.host_offset + lo, u.host_offset + hi) for u in self.layout.units
                for lo, hi in [self.shards.span(u)]]

    def pin_units(self, indices: list[int], regions: tuple[str, ...]) -> None:
        """Register the units' ranges of `regions` as pinned memory too (the GPU updates copy
        them to and from the GPU), as one range per region from the first unit to the last,
        widened over any registered range it overlaps; nothing without `pin`. One range: a copy
        that straddles two registrations is refused (invalid argument), and neighbouring units
        share their boundary pages, which CUDA registers once."""
        if not self._pin or not indices:
            return
        units = [self.layout.units[i] for i in indices]
        for name in regions:
            self._pin_range(name, min(u.host_offset for u in units),
                            max(u.host_offset + u.padded for u in units))

    def _pin_range(self, name: str, start: int, end: int) -> None:
        """Register elements [start, end) of region `name`, in whole pages, widened over any
        registered range they overlap."""
        base = self.regions[name]
        page = 4096 // base.element_size()  # whole pages: the region starts on one
        start, end = start // page * page, min(base.numel(), -(-end // page) * page)
        spans = self._pinned.setdefault(name, [])
        if (change := widened(spans, start, end)) is None:
            return
        (start, end), absorbed = change
        for a, b in absorbed:  # no copy uses them: the GPU updates are drained
            ptr = base[a:b].data_ptr()
            unregister_host(ptr)
            self._registered.remove(ptr)
            spans.remove((a, b))
        self._registered.append(register_host(base[start:end]))
        spans.append((start, end))

    def __getattr__(self, name: str) -> torch.Tensor:
        regions = self.__dict__.get("regions", {})
        if name in regions:
            return regions[name]
        raise AttributeError(name)

    def unit_view(self, region: str, unit_index: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) of a unit inside a flat region; of a scale region, the scales
        of those elements (start a multiple of MOMENT_BLOCK)."""
        u = self.layout.units[unit_index]
        end = u.padded if end is None else end
        lo, hi = u.host_offset + start, u.host_offset + end
        if region.removeprefix(REDO_PREFIX) in MOMENT_SCALES.values():
            lo, hi = lo // MOMENT_BLOCK, moment_scales(hi)
        return self.regions[region][lo:hi]

    def shard_view(self, region: str, unit: Unit) -> torch.Tensor:
        """This rank's shard of `unit` in a region (`unit_view` of `Unit.shard`)."""
        lo, hi = unit.shard(self.rank, self.world)
        return self.unit_view(region, unit.index, lo, hi)

    def shadow_from_master(self, unit: Unit) -> None:
        """This rank's shard of the unit's BF16 shadow rounded again from its master."""
        self.shard_view("shadow", unit).copy_(self.shard_view("master", unit))

    def staging_view(self, owner: int, unit_index: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rank `owner`'s returned full gradient of a unit (CPU-side reduction)."""
        u = self.layout.units[unit_index]
        end = u.padded if end is None else end
        base = owner * self.layout.total + u.host_offset
        return self.regions["staging"][base + start:base + end]

    def wait_counter(self, counter: torch.Tensor, at_least: int, *, what: str,
                     timeout_s: float = 600.0) -> None:
        """Spin (with short sleeps) until every entry of a shared counter reaches `at_least`:
        the cross-process version gate. Counters only grow, and x86 stores are seen in order.
        Raises StepAborted once `aborted` is set (this rank's step failed)."""
        deadline = time.monotonic() + timeout_s
        sleep = 0.0
        while int(counter.min()) < at_least:
            if self.aborted.is_set():
                raise StepAborted(f"SlideDP: stopped waiting for {what}: this rank's step failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"SlideDP: waited {timeout_s:.0f}s for {what} to reach "
                                   f"{at_least} (have {counter.tolist()}): a rank died?")
            time.sleep(sleep)
            sleep = min(sleep * 2 + 1e-5, 1e-3)

    def close(self) -> None:
        if self.grad_lock is not None:
            self.grad_lock.close()
        for ptr in self._registered:
            unregister_host(ptr)
        self._registered.clear()
        self.regions.clear()
        self.version = self.ready = self.consumed = None
        del self._raw
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the OS unmaps at exit
