"""CUDA streams and events that become no-ops on the CPU.

On the CPU every copy and kernel runs synchronously in the thread that issues it, so "recorded"
work is already complete; the schedule's host-side handshakes (threading.Event) carry the order.
"""

from contextlib import nullcontext

import torch


class Streams:
    """Stream/event helpers bound to one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"

    def new_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(device=self.device) if self.is_cuda else None

    def use(self, stream: torch.cuda.Stream | None):
        """Context that makes `stream` current (nothing on the CPU)."""
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def record(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """An event marking all work issued so far on `stream` (current stream if None)."""
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def wait(self, event: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (current if None) wait for `event` on the device, without blocking the host."""
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    @staticmethod
    def synchronize(event: torch.cuda.Event | None) -> None:
        """Block the calling host thread until `event` completed."""
        if event is not None:
            event.synchronize()

    def bind_thread(self) -> None:
        """Worker threads start on device 0 by default; point them at ours."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)


def register_host(t: torch.Tensor) -> int:
    """Pin the memory of CPU tensor `t` in place (cudaHostRegister: not copied, so each byte
    exists once and copies from and to it are asynchronous); returns the address to unregister."""
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err}); is the memlock "
                           f"limit (ulimit -l) too low?")
    return t.data_ptr()


def unregister_host(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
