"""The abort of issue 27 item 5, made on purpose: a gloo thread of a process group that is still
referenced at interpreter exit completes a collective while the interpreter finalizes, and the
Python work that completion runs (here a future's callback) needs the GIL there.

    python -m torch.distributed.run --standalone --nproc_per_node=2 gloo_exit_abort.py

Rank 0 prints "terminate called without an active exception" and dies of SIGABRT (3 of 3 runs
on the 2-core VM, torch 2.13.0 CPU). Rank 1 joins the collective 2 s late, so that rank 0's
completes during its exit."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
group = dist.new_group(backend="gloo")
rank = dist.get_rank()
if rank == 1:
    time.sleep(2)
work = dist.all_reduce(torch.ones(1 << 20), group=group, async_op=True)
done = work.get_future().then(lambda f: f.value())
HELD = [group, work, done]  # kept past destroy_process_group: the group's threads live on
if rank == 0:
    dist.destroy_process_group(dist.group.WORLD)  # and exit with the collective in flight
else:
    done.wait()
    dist.destroy_process_group()
