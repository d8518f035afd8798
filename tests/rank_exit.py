"""What every launched test rank checks before it exits: no gloo thread outlives its process
groups. A gloo worker thread still alive while the interpreter finalizes dies there if it needs
the GIL (CPython ends such a thread with pthread_exit, whose unwinding through a C++ noexcept
frame calls std::terminate): the rank aborts with "terminate called without an active
exception". destroy_process_group() joins a group's threads only once nothing else references
the group, so a reference kept anywhere keeps its threads into interpreter exit."""

import os
import time


def gloo_threads(expected: int = 0) -> int:
    """The number of this process's gloo worker threads (torch names them pt_gloo_runloop),
    waiting up to a second for it to reach `expected` (a joined thread may linger in /proc)."""
    for _ in range(100):
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass  # it has just exited
        if names.count("pt_gloo_runloop") == expected:
            break
        time.sleep(0.01)
    return names.count("pt_gloo_runloop")


def assert_no_gloo_thread_left() -> None:
    """After the last destroy_process_group(): every group's threads are joined."""
    left = gloo_threads(0)
    assert left == 0, (f"{left} gloo threads outlive destroy_process_group(): something still "
                       "references a process group, and its threads would run into interpreter exit")
