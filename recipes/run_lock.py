"""One run per folder: job.dump_folder (metrics, TensorBoard) and checkpoint.save_dir are locked
by the run that writes them, so a second run (or a restart while the first one's ranks are still
alive) fails at start instead of interleaving its metrics and checkpoints with the first one's.

The lock is an flock on `<folder>/.lock`, which holds the holder's pid for the error message.
The kernel releases it when the holder exits, however it exits (SIGKILL included), so there is
no stale lock to clean up. Rank 0 takes it: every rank of a run ends with its rank 0
(recipes/liveness.py), and rank 0 alone writes the metrics and completes the saves.
"""

import fcntl
import os
from pathlib import Path
from typing import IO

from recipes.config import ConfigError

LOCK_FILE = ".lock"


class FolderInUse(ConfigError):
    """Another live run holds the folder's lock."""


def lock_folder(folder: str, *, key: str) -> IO:
    """Take `folder`'s lock (creating the folder) and keep it while the returned file is open;
    FolderInUse, one line naming `key`, the folder and the holder's pid, if it is taken."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        f = open(path / LOCK_FILE, "a+")
    except OSError as e:
        raise ConfigError(f"{key}: cannot write to {folder}: {e.strerror}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise FolderInUse(f"{key}: {folder} is in use by another run (pid {holder}; lock file "
                          f"{path / LOCK_FILE}); wait for it to end, or use another folder"
                          ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def lock_run_folders(folders: dict[str, str]) -> list[IO]:
    """Lock every folder of {config key: folder} (empty folders skipped, each folder once)."""
    locks, seen = [], set()
    try:
        for key, folder in folders.items():
            if folder and (real := os.path.realpath(folder)) not in seen:
                seen.add(real)
                locks.append(lock_folder(folder, key=key))
    except FolderInUse:
        for f in locks:
            f.close()
        raise
    return locks
