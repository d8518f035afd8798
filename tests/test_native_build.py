"""slidedp/native_build.py: ranks starting together compile a source once (the others wait on the
lock and use the same file), and a failing compiler says why."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from slidedp import native_build

REPO = Path(__file__).resolve().parents[1]


def _slow_compiler(tmp_path: Path) -> Path:
    """cc behind a second's sleep, so that the second process arrives while the first compiles."""
    wrapper = tmp_path / "slow-cc"
    wrapper.write_text('#!/bin/sh\nsleep 1\nexec cc "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


def test_processes_starting_together_compile_once(tmp_path):
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    cache = tmp_path / "cache"
    code = ("import sys; from pathlib import Path; from slidedp.native_build import compile_cached; "
            f"print(compile_cached(Path({str(source)!r}), ('-O1', '-shared', '-fPIC'), 'answer', "
            f"compiler={str(_slow_compiler(tmp_path))!r}, suffix='.so'))")
    env = {**os.environ, "SLIDEDP_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert len({out.strip() for out, _ in outputs}) == 1  # the same file for both
    assert sum("compiling" in err for _, err in outputs) == 1
    assert [p.name for p in cache.glob("*.so")] == [Path(outputs[0][0].strip()).name]


def test_a_failing_compiler_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDEDP_CACHE_DIR", str(tmp_path))
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return }\n")
    with pytest.raises(native_build.NativeBuildError, match="(?s)cc failed:.*error: expected expression"):
        native_build.compile_cached(source, ("-shared", "-fPIC"), "broken", compiler="cc", suffix=".so")
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob(".broken*"))  # no half-built file
