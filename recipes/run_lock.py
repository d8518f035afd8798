"""One run per folder: job.dump_folder (metrics, TensorBoard) and checkpoint.save_dir are locked
by the run that writes them, so a second run (or a restart while the first one's ranks are still
alive) fails at start instead of interleaving its metrics and checkpoints with the first one's.

The lock is an flock on `<folder>/.lock`, which holds the holder's pid for the error message.
The kernel releases it when the holder exits, however it exits (SIGKILL included), so there is
no stale lock to clean up. Rank 0 takes it: every rank of a run ends with its rank 0
(recipes/liveness.py), and rank 0 alone writes the metrics and completes the saves. A folder the
run created and left holding only its lock (a check after the lock refused the run) is removed
when the lock is released, so a refused run leaves nothing behind.
"""

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from recipes.config import ConfigError

LOCK_FILE = ".lock"


class FolderInUse(ConfigError):
    """Another live run holds the folder's lock."""


@dataclass
class FolderLock:
    """A held folder lock: its open lock file, and the folders its taking created (the folder
    and its missing parents, the deepest first)."""

    file: IO
    folder: Path
    created: list[Path]

    def release(self) -> None:
        """Close the lock. If this run created the folder and it holds nothing but the lock
        file, it goes (while the lock is still held, so no other run writes there yet), with the
        parents the lock created that are empty then. Release a run's locks in reverse order."""
        if self.created and [p.name for p in self.folder.iterdir()] == [LOCK_FILE]:
            (self.folder / LOCK_FILE).unlink()
            for folder in self.created:
                if any(folder.iterdir()):
                    break
                folder.rmdir()
        self.file.close()


def lock_folder(folder: str, *, key: str) -> FolderLock:
    """Take `folder`'s lock (creating the folder) and keep it until it is released;
    FolderInUse, one line naming `key`, the folder and the holder's pid, if it is taken."""
    path = Path(folder)
    created = [p for p in (path, *path.parents) if not p.exists()]
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
    return FolderLock(f, path, created)


def lock_run_folders(folders: dict[str, str]) -> list[FolderLock]:
    """Lock every folder of {config key: folder} (empty folders skipped, each folder once)."""
    locks, seen = [], set()
    try:
        for key, folder in folders.items():
            if folder and (real := os.path.realpath(folder)) not in seen:
                seen.add(real)
                locks.append(lock_folder(folder, key=key))
    except FolderInUse:
        for lock in reversed(locks):
            lock.release()
        raise
    return locks
