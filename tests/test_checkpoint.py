"""Saves written in the background: exactly the state of their step, the newest K kept.

SlideDP's host state is written while the next steps run: each unit's next update waits until
the unit is written (slidedp/save_gate.py). Here the writer is slowed down so that the next
step's updates must wait; the saved file equals the state after the saved step, and without the
gate it would not. single/fsdp2 snapshot a host copy. The end-to-end resumes from background
saves are in tests/test_resume.py and tests/test_faults.py.
"""

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import slidedp.engine
from protocols.model_spec import get_flavor
from recipes.checkpoint import (META_FILE, TRAIN_STATE, CheckpointSaver, NonFiniteWeights,
                                latest_checkpoint, prune, staging_dir)
from recipes.baselines.eager import build_single_backend
from recipes.config import run_config
from slidedp.layout import StateLayout
from slidedp.save_gate import SaveGate
from slidedp.state_file import state_file
from tests.slidedp_worker import global_batches, make_config

ARGS = get_flavor("qwen3-debug")


def _batch(seed: int):
    x = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    return [(x, x)]


def _slidedp(nonfinite: str):
    from slidedp.engine import SlideDPBackend

    return SlideDPBackend(run_config(make_config({"nonfinite": nonfinite}, accum=1, max_norm=0.0)), ARGS,
                          device=torch.device("cpu"), dp_rank=0, dp_world=1)


def _host_state(backend) -> dict[str, torch.Tensor]:
    dict(backend.named_master_parameters())  # the pending updates are done
    return {f"{region}.u{unit.index}": backend.state.unit_view(region, unit.index).clone()
            for region in backend.state.plan.state_regions() for unit in backend.layout.units}


@pytest.mark.parametrize("nonfinite", ["stop_consecutive", "off"])
def test_slidedp_background_save_is_the_state_of_its_step(tmp_path, monkeypatch, nonfinite):
    """Guard on: the next updates come after the step, in forward order; off: during
    backward, head first. Either way the writer goes in that order, and it is slow here."""
    write_unit = slidedp.engine.save_shards

    def slow(*args, unit_written, **kw):
        def written(unit):
            time.sleep(0.2)  # far longer than a step of the debug model
            unit_written(unit)
        write_unit(*args, unit_written=written, **kw)

    monkeypatch.setattr(slidedp.engine, "save_shards", slow)
    reference = _slidedp(nonfinite)
    try:
        reference.train_step(_batch(1), lr=1e-3, global_target_tokens=32)
        expected = _host_state(reference)
    finally:
        reference.close()
    backend = _slidedp(nonfinite)
    try:
        # Saved as the loop does, right after the step: its updates may still be pending.
        backend.train_step(_batch(1), lr=1e-3, global_target_tokens=32)
        write = backend.snapshot_state(None)
        writer = threading.Thread(target=write, args=(str(tmp_path),))
        writer.start()
        second = backend.train_step(_batch(2), lr=1e-3, global_target_tokens=32)
        third = backend.train_step(_batch(3), lr=1e-3, global_target_tokens=32)
        writer.join()
        live = _host_state(backend)
    finally:
        backend.close()
    saved = load_file(state_file(str(tmp_path), rank=0, world=1))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    assert not torch.equal(live["master.u1"], expected["master.u1"])  # training went on
    waited = second.extra.get("host_save_wait_s", 0) + third.extra.get("host_save_wait_s", 0)
    assert waited > 0.1  # the updates did wait for the writer


def test_without_the_gate_a_background_save_would_mix_steps(tmp_path, monkeypatch):
    """The control: updates that do not wait overwrite units the writer has not reached."""
    monkeypatch.setattr(SaveGate, "wait", lambda self, unit, step, aborted: 0.0)
    write_unit, updates_done = slidedp.engine.save_shards, threading.Event()

    def late(*args, unit_written, **kw):
        updates_done.wait(timeout=60)
        write_unit(*args, unit_written=unit_written, **kw)

    monkeypatch.setattr(slidedp.engine, "save_shards", late)
    backend = _slidedp("stop_consecutive")
    try:
        backend.train_step(_batch(1), lr=1e-3, global_target_tokens=32)
        expected = _host_state(backend)
        writer = threading.Thread(target=backend.snapshot_state(None), args=(str(tmp_path),))
        writer.start()
        backend.train_step(_batch(2), lr=1e-3, global_target_tokens=32)
        _host_state(backend)
        updates_done.set()
        writer.join()
    finally:
        backend.close()
    saved = load_file(state_file(str(tmp_path), rank=0, world=1))
    assert not all(torch.equal(saved[k], expected[k]) for k in expected)


def test_single_snapshot_is_the_state_of_its_step(tmp_path):
    backend = build_single_backend(make_config({}, accum=1, max_norm=1.0), ARGS,
                                   device=torch.device("cpu"))
    backend.train_step(_batch(1), lr=1e-3, global_target_tokens=32)
    expected = {k: v.clone() for k, v in backend.model.state_dict().items()}
    write = backend.snapshot_state(None)
    backend.train_step(_batch(2), lr=1e-3, global_target_tokens=32)  # before the write
    write(str(tmp_path / "state"))
    dcp_to_torch_save(tmp_path / "state", tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=False)
    assert saved["steps_done"] == 1
    assert all(torch.equal(saved["model"][k], v) for k, v in expected.items())
    assert not torch.equal(backend.model.state_dict()["norm.weight"], expected["norm.weight"])
    # The Hugging Face export reads the weights back from those files.
    read = dict(backend.saved_master_parameters(str(tmp_path / "state")))
    assert read.keys() == expected.keys()
    assert all(torch.equal(read[k], v) for k, v in expected.items())


def _complete(save_dir, step: int) -> None:
    (save_dir / f"step-{step}" / TRAIN_STATE).mkdir(parents=True)
    (save_dir / f"step-{step}" / TRAIN_STATE / META_FILE).write_text("{}")


def test_prune_keeps_the_newest_k_complete_saves(tmp_path):
    for step in (2, 4, 6, 8):
        _complete(tmp_path, step)
    (tmp_path / "step-9").mkdir()  # Hugging Face weights, no train state: cut short
    for leftover in ("step-10.train_state.tmp", "step-10.tmp", "step-4.deleting"):
        (tmp_path / leftover).mkdir()
    (tmp_path / "notes").mkdir()  # not ours
    deleted = prune(str(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-6", "step-8"]
    assert len(deleted) == 6
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step-8"
    assert prune(str(tmp_path), keep=0) == []  # 0 keeps every complete save
    prune(str(tmp_path), keep=1)
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step-8"  # never the newest


def test_a_failed_save_is_reported_and_leaves_latest(tmp_path):
    backend = build_single_backend(make_config({}, accum=1, max_norm=1.0), ARGS,
                                   device=torch.device("cpu"))
    exported = []

    def export(tensors, out):
        if exported:
            raise OSError(28, "No space left on device")
        exported.append(out)
        from recipes.run_saves import hf_exporter
        hf_exporter(make_config({}, accum=1, max_norm=1.0), ARGS)(tensors, out)

    saver = CheckpointSaver(backend, save_dir=str(tmp_path), keep_latest_k=3, background=True,
                            rank=0, export_hf=export)
    backend.train_step(_batch(1), lr=1e-3, global_target_tokens=32)
    saver.save(1, {"data": {}})
    backend.train_step(_batch(2), lr=1e-3, global_target_tokens=32)
    saver.save(2, {"data": {}})
    with pytest.raises(RuntimeError, match="No space left on device"):
        saver.wait()
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step-1"
    assert json.loads((tmp_path / "step-1" / TRAIN_STATE / META_FILE).read_text())["step"] == 1
    assert staging_dir(str(tmp_path), 2).is_dir()  # cut short, removed by the next save's prune


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    """A save whose weights diverged (here one weight poisoned after a finite step) writes
    neither Hugging Face weights nor a train state, so `latest` stays the last finite save, and
    the run is stopped with the tensor named."""
    from recipes.run_saves import hf_exporter

    config = make_config({}, accum=1, max_norm=1.0)
    backend = build_single_backend(config, ARGS, device=torch.device("cpu"))
    saver = CheckpointSaver(backend, save_dir=str(tmp_path), keep_latest_k=3, background=False,
                            rank=0, export_hf=hf_exporter(config, ARGS))
    backend.train_step(_batch(1), lr=1e-3, global_target_tokens=32)
    saver.save(1, {"data": {}})
    saver.wait()
    backend.train_step(_batch(2), lr=1e-3, global_target_tokens=32)
    with torch.no_grad():
        next(p for _, p in backend.named_master_parameters()).view(-1)[:3] = float("nan")
    with pytest.raises(NonFiniteWeights, match=r"step 2 not saved: .* has 3 of \d+ elements not "
                                               "finite"):
        saver.save(2, {"data": {}})  # a blocking save reports at once
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step-1"
    assert not (tmp_path / "step-2").exists() and not staging_dir(str(tmp_path), 2).exists()


def test_slidedp_8bit_moments_resume_exactly_and_convert(tmp_path):
    """8-bit moments (codes and their block scales) saved and loaded as stored: the same state
    bit for bit; loaded by a run with FP32 moments, they come back dequantized, and FP32 ones
    saved and loaded by an 8-bit run come back quantized as the CPU Adam stores them."""
    from slidedp import cpu_adam
    from slidedp.engine import SlideDPBackend

    def backend(moments: str):
        return SlideDPBackend(run_config(make_config({"moments_dtype": moments}, accum=1, max_norm=1.0)), ARGS,
                              device=torch.device("cpu"), dp_rank=0, dp_world=1)

    def trained_and_saved(moments: str) -> dict[str, torch.Tensor]:
        b = backend(moments)
        try:
            for micro in global_batches(steps=2, accum=1, batch=2, seq=16, vocab=ARGS.vocab_size, seed=5):
                n = sum(int((y != -100).sum()) for _, y in micro)
                b.train_step(micro, lr=1e-3, global_target_tokens=n)
            (tmp_path / moments).mkdir()
            b.snapshot_state(None)(str(tmp_path / moments))
            return _host_state(b)
        finally:
            b.close()

    def loaded(moments: str, saved: str) -> dict[str, torch.Tensor]:
        b = backend(moments)
        try:
            assert b.load_state(str(tmp_path / saved)) == 2
            return _host_state(b)
        finally:
            b.close()

    units = range(len(StateLayout(ARGS, world=1).units))
    moments = (("exp_avg", True), ("exp_avg_sq", False))
    want = trained_and_saved("8bit")
    for got, as_stored in ((loaded("8bit", "8bit"), True), (loaded("float32", "8bit"), False)):
        for unit in units:
            assert torch.equal(got[f"master.u{unit}"], want[f"master.u{unit}"])
            for region, signed in moments:
                name, scale = f"{region}.u{unit}", f"{region}_scale.u{unit}"
                if as_stored:
                    assert torch.equal(got[name], want[name]) and torch.equal(got[scale], want[scale])
                else:
                    assert torch.equal(got[name], cpu_adam.dequantize_moment(want[name], want[scale],
                                                                             signed=signed))
    plain, got = trained_and_saved("float32"), loaded("8bit", "float32")
    for unit in units:
        for region, signed in moments:
            codes = torch.empty_like(got[f"{region}.u{unit}"])
            scale = torch.empty_like(got[f"{region}_scale.u{unit}"])
            cpu_adam.quantize_moment(plain[f"{region}.u{unit}"], signed=signed, codes=codes, scale=scale)
            assert torch.equal(got[f"{region}.u{unit}"], codes)
            assert torch.equal(got[f"{region}_scale.u{unit}"], scale)
