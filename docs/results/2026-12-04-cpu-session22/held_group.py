"""destroy_process_group() does not join a group's gloo threads while Python still references the
group: run `python held_group.py`; it prints the pt_gloo_runloop count after init, after destroy
with a reference held, and after the reference is dropped."""

import gc
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from tests.rank_exit import gloo_threads  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
dist.init_process_group("gloo", rank=0, world_size=1)
held = dist.new_group([0])  # e.g. kept by a Mock's call record or a DTensor cache
print("after init:", gloo_threads())
dist.destroy_process_group()
print("after destroy, group still referenced:", gloo_threads())
del held
gc.collect()
print("after the last reference is dropped:", gloo_threads(0))
