"""The abort's mechanism: a gloo thread that needs the GIL after interpreter finalization began.
Eight all-reduces are in flight, each with a Python callback on its future, when the script
ends; a gloo thread that completes one takes the GIL while the interpreter finalizes, CPython
ends it with pthread_exit, and unwinding through c10d's noexcept frame calls std::terminate:
"terminate called without an active exception", SIGABRT. Timing decides, so the script runs
itself TRIES times and counts the aborts: `python abort_at_exit.py` (the work left in flight),
`python abort_at_exit.py --destroy` (each work waited for and the group destroyed first)."""

import os
import subprocess
import sys
import time

TRIES = 12

if "--child" not in sys.argv:
    extra = ["--destroy"] if "--destroy" in sys.argv else []
    rcs = [subprocess.run([sys.executable, __file__, "--child", *extra],
                          capture_output=True).returncode for _ in range(TRIES)]
    print(f"{rcs.count(-6)} of {TRIES} tries aborted (SIGABRT); exit statuses {sorted(set(rcs))}")
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29556")
dist.init_process_group("gloo", rank=0, world_size=1)


class BriefAtExit:
    def __del__(self, sleep=time.sleep):  # bound now: module globals are gone at exit
        sleep(0.01)


keeper = BriefAtExit()
works = [dist.all_reduce(torch.ones(1 << 24), async_op=True) for _ in range(8)]
for work in works:
    work.get_future().then(lambda fut: fut.value())  # Python, run on the gloo thread
if "--destroy" in sys.argv:
    for work in works:
        work.wait()
    dist.destroy_process_group()
