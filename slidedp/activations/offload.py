"""Saved activations to pinned host memory during forward, and back ahead of backward.

A block whose policy has `offload = f` splits every storage it saves through autograd's hooks:
the first f of its bytes go to the host (f < 1: rounded down to 512 bytes), the rest is copied
into a smaller GPU tensor, and the original is released. The host copies are issued on an
offload stream of their own at the end of the block's forward; `record_stream` keeps the
allocator from reusing the GPU memory before they are done. The plan names, for each backward
use, the block whose activations start coming back before it (block i while backward is at
block i + 1), so the compute stream waits only for a copy that is late.

The host side is one pool per rank, sized from the measured policy costs and the micro-batch
(`HostPool`), registered with CUDA so the copies run asynchronously. Slices are handed out in
forward order and all given back at the next micro-batch: its copies out queue behind this one's
copies back on the same stream. The pool is counted in the start-up host-memory check and freed
on close and when a step fails (`Offloader.clear`, which also drops every offloaded tensor, on
either side, even if an exception's traceback still holds the graphs).

On the CPU (tests) streams and events are no-ops, but the data path runs the same: copy out,
release, copy back.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from slidedp.streams import Streams, register_host, unregister_host
from slidedp.traffic import Traffic

_ALIGN = 512  # bytes: host slices of a split storage stay aligned for the copy engines


class HostPool:
    """One flat host buffer, handed out in slices until `reset`."""

    def __init__(self, *, pin: bool):
        self.pin = pin
        self._buffer: torch.Tensor | None = None
        self._registered: int | None = None
        self._top = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def allocate(self, nbytes: int) -> None:
        """Replace the buffer with one of `nbytes` (call with nothing handed out)."""
        self.release()
        self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            self._registered = register_host(self._buffer)

    def take(self, nbytes: int) -> torch.Tensor:
        if self._top + nbytes > self.nbytes:
            raise RuntimeError(f"SlideDP: the activation offload pool ({self.nbytes} bytes) is "
                               f"full: the blocks saved more than measured at start")
        out = self._buffer[self._top:self._top + nbytes]
        self._top += nbytes
        return out

    def reset(self) -> None:
        self._top = 0

    def release(self) -> None:
        if self._registered is not None:
            unregister_host(self._registered)
        self._buffer, self._registered, self._top = None, None, 0


@dataclass(eq=False)
class _Stored:
    """One saved storage: bytes [0, split) on the host, [split, nbytes) on the GPU."""

    nbytes: int
    split: int
    host: torch.Tensor | None
    """The host slice (uint8) of bytes [0, split)."""
    rest: torch.Tensor | None
    """Bytes [split, nbytes) on the GPU until they are copied back (None when split = nbytes)."""
    source: torch.Tensor | None
    """The original bytes, until the block's copies to the host are issued."""
    device: torch.Tensor | None = None
    """The restored bytes on the GPU, once the copy back is issued."""
    ready: torch.cuda.Event | None = None
    """Recorded on the offload stream after the copy back (None: no wait needed)."""

    def drop(self) -> None:
        self.host = self.rest = self.source = self.device = self.ready = None


@dataclass(frozen=True, eq=False)
class Offloaded:
    """What the saved-tensor hook keeps for one tensor of an offloaded storage."""

    stored: _Stored
    owner: "Offloader"
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def tensor(self) -> torch.Tensor:
        flat = self.owner.restored(self.stored)
        return torch.as_strided(flat.view(self.dtype), self.size, self.stride, self.offset)


class BlockOffload:
    """The pack side of one block's forward (`Offloader.forward_of`)."""

    def __init__(self, owner: "Offloader", fraction: float):
        self.owner, self.fraction = owner, fraction
        self.stored: list[_Stored] = []
        self._by_storage: dict[tuple[int, int], _Stored] = {}

    @torch.no_grad()
    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        n = storage.nbytes()
        if t.device != self.owner.device or n % t.element_size():
            return t  # e.g. a CPU RNG seed of a CUDA kernel
        key = (storage.data_ptr(), t._version)  # views of one storage share its copy
        stored = self._by_storage.get(key)
        if stored is None:
            split = n if self.fraction >= 1 else int(self.fraction * n) // _ALIGN * _ALIGN
            if split == 0:
                return t
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            stored = _Stored(nbytes=n, split=split, host=self.owner.pool.take(split),
                             rest=flat[split:].clone() if split < n else None, source=flat)
            self._by_storage[key] = stored
            self.stored.append(stored)
        return Offloaded(stored, self.owner, t.dtype, t.size(), t.stride(), t.storage_offset())


class Offloader:
    """This rank's activation offload: the stream, the host pool, the blocks in flight."""

    def __init__(self, streams: Streams, traffic: Traffic):
        self.streams, self.traffic, self.device = streams, traffic, streams.device
        self.stream = streams.new_stream()
        self.pool = HostPool(pin=streams.is_cuda)
        self._blocks: dict[int, list[_Stored]] = {}  # offloaded, not yet released
        self._open: BlockOffload | None = None  # the block whose forward is running

    @property
    def blocks_held(self) -> int:
        """Blocks whose offloaded activations are held (on either side)."""
        return len(self._blocks) + (self._open is not None)

    def begin_micro_batch(self) -> None:
        """Every block of the previous micro-batch was released: its slices can be reused."""
        self.pool.reset()

    @contextmanager
    def forward_of(self, unit: int, fraction: float) -> Iterator[BlockOffload | None]:
        """Context for one block's forward; yields the pack side (None when fraction is 0). At
        its end the block's copies to the host are issued."""
        if fraction <= 0:
            yield None
            return
        self._open = block = BlockOffload(self, fraction)
        yield block
        self._open = None
        self._blocks[unit] = block.stored
        produced = self.streams.record()
        with self.streams.use(self.stream):
            self.streams.wait(produced, self.stream)
            for st in block.stored:
                st.host.copy_(st.source[:st.split], non_blocking=True)
                if self.streams.is_cuda:
                    st.source.record_stream(self.stream)  # freed only once the copy is done
                st.source = None
                self.traffic.offload_d2h += st.split

    def prefetch(self, unit: int) -> None:
        """Start bringing `unit`'s offloaded activations back to the GPU."""
        self._copy_back(self._blocks.get(unit, []))

    def _copy_back(self, stored: list[_Stored]) -> None:
        for st in stored:  # allocated on the compute stream, which uses them
            st.device = torch.empty(st.nbytes, dtype=torch.uint8, device=self.device)
        allocated = self.streams.record()
        with self.streams.use(self.stream):
            self.streams.wait(allocated, self.stream)
            for st in stored:
                st.device[:st.split].copy_(st.host, non_blocking=True)
                if st.rest is not None:
                    st.device[st.split:].copy_(st.rest, non_blocking=True)
                    if self.streams.is_cuda:
                        st.rest.record_stream(self.stream)
                    st.rest = None
                self.traffic.offload_h2d += st.split
            ready = self.streams.record(self.stream)
        for st in stored:
            st.ready = ready

    def restored(self, st: _Stored) -> torch.Tensor:
        """The storage's bytes on the GPU, for the backward that unpacks them (copied back now
        if no prefetch was planned)."""
        if st.device is None:
            self._copy_back([st])
        self.streams.wait(st.ready)
        st.ready = None
        return st.device

    def release(self, unit: int) -> None:
        """`unit`'s backward is done: drop what came back."""
        for st in self._blocks.pop(unit, []):
            self.streams.wait(st.ready)  # a copy back nothing unpacked must end before reuse
            st.drop()

    def clear(self) -> None:
        """Free everything now (the step failed, or close): the copies in flight end first."""
        Streams.synchronize(self.streams.record(self.stream))
        for stored in [*self._blocks.values(), self._open.stored if self._open else []]:
            for st in stored:
                st.drop()
        self._blocks.clear()
        self._open = None
        self.pool.release()
