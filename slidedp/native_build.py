"""Compiling the repo's native sources (csrc/) once per machine, into a cache shared by processes.

`compile_cached` keys the output by the source, the compiler's version, the flags, the machine
and, with `-march=native`, the target the compiler resolves it to (a home directory can be shared
by hosts with different CPUs). The cache is `${SLIDEDP_CACHE_DIR:-~/.cache/slidedp}`.
"""

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


class NativeBuildError(RuntimeError):
    """The compiler is missing or failed."""


def cache_dir() -> Path:
    """Where the builds go: `$SLIDEDP_CACHE_DIR`, else ~/.cache/slidedp."""
    return Path(os.environ.get("SLIDEDP_CACHE_DIR") or Path.home() / ".cache" / "slidedp")


def _key(compiler: str, source: Path, flags: Sequence[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [source.read_bytes(), version.encode(), " ".join(flags).encode(), platform.machine().encode()]
    if "-march=native" in flags:
        # The driver's verbose preprocess names the resolved -march and features.
        target = subprocess.run([compiler, "-march=native", "-E", "-v", "-x", "c", os.devnull],
                                capture_output=True, text=True)
        parts.append(target.stderr.encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def compile_cached(source: Path, flags: Sequence[str], stem: str, *, compiler: str,
                   suffix: str = "") -> Path:
    """`compiler FLAGS SOURCE -o CACHE/STEM_KEY{suffix}` unless that build is cached; its path."""
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"no compiler: {compiler!r} is not on PATH")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    key = _key(compiler, source, flags)
    target = cache / f"{stem}_{key}{suffix}"
    if target.exists():
        return target
    # One process compiles while the others (ranks starting together) wait for it; the build goes
    # to a temp file renamed into place, so nobody ever runs or loads a half-written one.
    with open(cache / f"{stem}_{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        print(f"slidedp: compiling {source} -> {target}", file=sys.stderr, flush=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{target.stem}.", suffix=suffix)
        os.close(fd)
        try:
            result = subprocess.run([compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeBuildError(f"{compiler} failed:\n{result.stderr[-4000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
