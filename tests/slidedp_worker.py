"""Runs SlideDP on R real ranks (gloo, CPU) for several route/schedule variants in one process
group, writing per-step losses and final master weights for tests/test_slidedp.py to compare
against the `single` backend. A variant may carry its own flavor/steps/accum/max_norm, so that
several tests' runs share one launch. Launched with torchrun; not a test module itself."""

import argparse
import json
import os
import time
from unittest import mock

import torch
import torch.distributed as dist

from protocols.model_spec import get_flavor
from protocols.reconfigure import Knobs
from recipes.config import JobConfig, run_config
from slidedp.engine import SlideDPBackend
from slidedp.gpu_update import device_clip
from tests.rank_exit import assert_no_gloo_thread_left


def global_batches(*, steps: int, accum: int, batch: int, seq: int, vocab: int, seed: int):
    """Per step, per micro-batch: the global (input_ids, labels) with some masked labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
            y = x[:, 1:].clone()
            y[torch.rand(y.shape, generator=g) < 0.2] = -100
            micro.append((x[:, :-1].contiguous(), y))
        out.append(micro)
    return out


def make_config(variant: dict, *, accum: int, max_norm: float, kernels: str = "auto",
                batch: int = 2, seq: int = 16) -> JobConfig:
    """`variant`: [slidedp] fields, and optionally training.nonfinite as "nonfinite"; `batch` x
    `seq` is a rank's micro-batch (what SlideDP's activation offload pool is sized for)."""
    cfg = JobConfig()
    cfg.model.kernels = kernels
    cfg.training.grad_accum_steps, cfg.training.max_norm = accum, max_norm
    cfg.training.local_batch_size, cfg.training.seq_len = batch, seq
    cfg.training.loss_chunk_tokens = 40
    cfg.optimizer.lr = 1e-3
    for key, value in variant.items():
        setattr(cfg.training if key == "nonfinite" else cfg.slidedp, key, value)
    return cfg


def slow_down_updates(backend, delay: float, log: list | None = None) -> None:
    """Make every host update call of `backend` take `delay` seconds longer; with `log`, append
    (unit index, start, end) of each call (perf_counter seconds)."""
    update = backend.optimizer.update
    starts = {u.host_offset: u.index for u in backend.layout.units}

    def slow(start: int, end: int, grad, **kw) -> None:
        begin = time.perf_counter()
        time.sleep(delay)
        update(start, end, grad, **kw)
        if log is not None:
            unit = max(i for offset, i in starts.items() if offset <= start)
            log.append((unit, begin, time.perf_counter()))

    backend.optimizer.update = slow


def mapped_host_state_bytes() -> int:
    """The bytes of SlideDP's shared host state that this process maps, as the kernel lists
    them (/proc/self/maps), so a test can check the byte formula against what was allocated."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:slidedp-host-state" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True, help="JSON list of {slidedp field: value}")
    p.add_argument("--flavor", default="qwen3-debug")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--max-norm", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=2, help="samples per rank per micro-batch")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--kernels", default="auto", choices=("auto", "liger", "torch"))
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for i, variant in enumerate(json.loads(a.variants)):
        # Not slidedp fields: [[delivery, reduction], ...] for the routes (reconfigure) before each step; a
        # delay in seconds added to every host update call (a slow CPU: the updates outlast
        # backward, so what is left is reordered and overlaps the next step's forward); this
        # variant's run settings where they differ from the flags'.
        route_steps = variant.pop("routes_per_step", None)
        delay = variant.pop("update_delay_s", 0.0)
        accum = variant.pop("accum", a.accum)
        max_norm = variant.pop("max_norm", a.max_norm)
        args = get_flavor(variant.pop("flavor", a.flavor))
        data = global_batches(steps=variant.pop("steps", a.steps), accum=accum,
                              batch=a.batch * world, seq=a.seq, vocab=args.vocab_size, seed=7)
        cfg = make_config(variant, accum=accum, max_norm=max_norm, kernels=a.kernels,
                          batch=a.batch, seq=a.seq)
        backend = SlideDPBackend(run_config(cfg), args, device=device, dp_rank=rank, dp_world=world)
        mapped = mapped_host_state_bytes()
        updates: list = []
        if delay:
            slow_down_updates(backend, delay, updates)
        # What the start-up measurement predicts the activation offload moves per step.
        predicted = accum * sum(backend.activation_costs[p].host.at(a.batch, a.seq)
                                  for p in backend.policies) / 2**20
        losses, norms, counters = [], [], []
        # Counts the steps whose norm and clipping were taken on the device.
        # A count only: a Mock would keep every call's arguments, the reduce group among them,
        # and a group still referenced keeps its gloo threads past destroy_process_group().
        clips = [0]

        def counted_clip(*args, **kwargs):
            clips[0] += 1
            return device_clip(*args, **kwargs)

        mock.patch("slidedp.gradient_flow.device_clip", counted_clip).start()
        for step, micro in enumerate(data):
            if route_steps:
                delivery, reduction = route_steps[step]
                backend.reconfigure(Knobs(delivery=delivery, reduction=reduction))
            ntok = sum(int((y != -100).sum()) for _, y in micro)
            mine = [(x[rank * a.batch:(rank + 1) * a.batch], y[rank * a.batch:(rank + 1) * a.batch])
                    for x, y in micro]
            r = backend.train_step(mine, lr=1e-3, global_target_tokens=ntok)
            losses.append(r.loss_sum / ntok)
            norms.append(r.grad_norm)
            counters.append({k: v for k, v in r.extra.items() if k.startswith(("traffic_", "host_"))})
        mock.patch.stopall()
        weights = {n: t.clone() for n, t in backend.named_master_parameters()}
        backend.close()
        calls = [len(updates)] * world  # every rank's host update calls (with a delay)
        if delay:
            dist.all_gather_object(calls, len(updates))
        if rank == 0:
            torch.save(weights, os.path.join(a.out, f"weights_{i}.pt"))
            results.append({"variant": variant, "losses": losses, "grad_norms": norms,
                            "counters": counters, "predicted_offload_mb": predicted,
                            "host_mapped_bytes": mapped,
                            "updated_units": [unit for unit, _, _ in updates],
                            "update_calls_per_rank": calls,
                            "device_clips": clips[0]})
    if rank == 0:
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    assert_no_gloo_thread_left()


if __name__ == "__main__":
    main()
