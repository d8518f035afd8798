"""The standalone OpenMP STREAM triad (csrc/stream_triad.c via slidedp/plan/triad.py): it builds
once into the cache, runs in both store modes and both schedules on small arrays, swaps in place
(the CPU AdamW's mix of reads and writes), and refuses bad arguments."""

import math

import pytest

from slidedp import native_build
from slidedp.plan.triad import (SCHEDULES, STORE_MODES, openmp_swap, openmp_triad, openmp_triad_binary,
                                openmp_triads)

ELEMENTS = 2**19 + 3  # 4 MiB arrays, with a tail that is not a whole block


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """One cache for the module (not ~/.cache): the program is compiled once for all tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIDEDP_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        for name in ("CC", "OMP_PROC_BIND", "OMP_PLACES"):
            mp.delenv(name, raising=False)
        yield


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", STORE_MODES)
def test_runs_in_every_variant(mode, schedule):
    result = openmp_triad(elements=ELEMENTS, threads=2, repeats=3, mode=mode, schedule=schedule)
    assert ((result.elements, result.threads, result.repeats, result.mode, result.schedule)
            == (ELEMENTS, 2, 3, mode, schedule))
    assert math.isfinite(result.best_gbs) and result.best_gbs > 0
    assert 0 < result.median_gbs <= result.best_gbs
    assert result.best_gbs == pytest.approx(24 * ELEMENTS / result.best_s / 1e9, rel=1e-4)
    assert (result.proc_bind, result.places) == ("close", "cores")


@pytest.mark.parametrize("repeats", [2, 3])  # the program checks a after an odd and an even count
def test_swap_counts_every_byte_read_and_written(repeats):
    result = openmp_triad(elements=ELEMENTS, threads=2, repeats=repeats, mode="plain", kernel="swap")
    assert (result.kernel, result.mode) == ("swap", "plain")
    assert result.best_gbs == pytest.approx(32 * ELEMENTS / result.best_s / 1e9, rel=1e-4)
    best = openmp_swap(elements=ELEMENTS, threads=2, repeats=repeats)
    assert best.kernel == "swap" and best.schedule in SCHEDULES and best.best_gbs > 0


def test_the_stream_bench_sets_the_update_against_the_swap():
    from recipes.bench.cpu_adam import Workload
    from recipes.bench.stream import describe, measure

    row = measure(2, elements=ELEMENTS, repeats=2, openmp=True, work=Workload(40_000))
    assert row["triad_best_gbs"] == max(r["best_gbs"] for r in row["openmp"])
    assert row["swap_best_gbs"] > 0 and row["swap_schedule"] in SCHEDULES
    assert row["adam_over_swap"] == pytest.approx(row["adam_best_gbs"] / row["swap_best_gbs"])
    assert "openmp swap" in describe(row) and "x the swap" in describe(row)


def test_best_first():
    runs = openmp_triads(elements=ELEMENTS, threads=1, repeats=2)
    assert {(r.mode, r.schedule) for r in runs} == {(m, s) for m in STORE_MODES for s in SCHEDULES}
    assert [r.best_gbs for r in runs] == sorted((r.best_gbs for r in runs), reverse=True)


def test_environment_overrides_binding():
    result = openmp_triad(elements=ELEMENTS, threads=1, repeats=1, mode="plain",
                          env={"OMP_PROC_BIND": "false"})
    assert (result.threads, result.proc_bind) == (1, "false")


@pytest.mark.parametrize("kwargs, message", [
    ({"elements": 0}, "ELEMENTS must be a positive integer, got '0'"),
    ({"repeats": -1}, "REPEATS must be a positive integer"),
    ({"mode": "streaming"}, "mode must be 'plain' or 'nt'"),
    ({"schedule": "guided"}, "schedule must be 'static' or 'dynamic'"),
    ({"kernel": "copy"}, "kernel must be 'triad' or 'swap'"),
    ({"kernel": "swap", "mode": "nt"}, "kernel 'swap' writes the lines it reads: mode must be 'plain'"),
])
def test_bad_argument(kwargs, message):
    args = {"elements": ELEMENTS, "threads": 1, "repeats": 1, "mode": "plain", **kwargs}
    with pytest.raises(RuntimeError, match=message):
        openmp_triad(**args)


def test_needs_a_thread():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        openmp_triad(elements=ELEMENTS, threads=0)


def test_build_is_cached(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("SLIDEDP_CACHE_DIR", str(tmp_path))
    first = openmp_triad_binary()
    assert "compiling" in capfd.readouterr().err
    built = first.stat().st_mtime_ns
    assert openmp_triad_binary() == first
    assert "compiling" not in capfd.readouterr().err
    assert first.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [first.name]


def test_no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIDEDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(native_build.NativeBuildError, match="not on PATH"):
        openmp_triad_binary()
