"""Resumable training through ./run_train.sh: a run of STEPS steps saves at the half; a second run
resumed from that save reproduces the uninterrupted run's remaining losses and gradient norms
bit for bit, and ends with identical weights and optimizer state, in every mode. Exact, not
approximate: both runs execute the same operations in the same order on the same data (same
thread counts, same reduction order), so nothing can round differently. The resumed run continues
the first one's metrics.jsonl and TensorBoard run, every step once."""

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from protocols.model_spec import get_flavor
from recipes.checkpoint import META_FILE, TRAIN_STATE, latest_checkpoint, staging_dir
from slidedp.host_state import HostStatePlan, SharedHostState
from slidedp.layout import StateLayout
from slidedp.state_file import load_shards
from recipes.batches import SyntheticBatches
from tests.test_config import parse_error, run_cli
from tests.test_train_cli import launch, run_train

STEPS, HALF = 6, 3
# The debug config's global batch of 8 samples, on one or two ranks.
MODES = {"single": (1, []),
         "fsdp2": (2, ["--parallelism.mode=fsdp2", "--training.local_batch_size=4"]),
         "slidedp": (2, ["--parallelism.mode=slidedp", "--training.local_batch_size=4"])}


def train(out: Path, mode: str, *flags: str) -> list[dict]:
    ngpu, mode_flags = MODES[mode]
    return run_train(out, f"--checkpoint.interval={HALF}", *mode_flags, *flags, ngpu=ngpu,
                     steps=STEPS)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items()
                for k, v in _flatten(value, f"{prefix}{key}.").items()}
    if isinstance(obj, list):
        return _flatten(dict(enumerate(obj)), prefix)
    return {prefix: obj}


def train_state(step_dir: Path, scratch: Path) -> dict[str, Any]:
    """Every saved FP32 tensor and counter of a step's train_state, by name."""
    state = step_dir / TRAIN_STATE
    shards = sorted(state.glob("slidedp-rank*.safetensors"))
    if shards:
        return {f"{p.name}/{k}": t for p in shards for k, t in load_file(p).items()}
    dcp_to_torch_save(state, scratch / "state.pt")
    return _flatten(torch.load(scratch / "state.pt", weights_only=False))


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        same = torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key]
        assert same, key


def assert_resumed_exactly(full: list[dict], resumed: list[dict]) -> None:
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "target_tokens"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key


def tensorboard_losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of the one TensorBoard run under out/tb, as TensorBoard shows them."""
    (run,) = os.listdir(out / "tb")
    accumulator = EventAccumulator(str(out / "tb" / run))
    accumulator.Reload()
    return [(s.step, s.value) for s in accumulator.Scalars("loss")]


def keep_first_half_of_metrics(src: Path, dst: Path) -> None:
    """metrics.jsonl as a crash right after the half's save leaves it."""
    lines = (src / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dst / "metrics.jsonl").write_text("".join(lines[:HALF]))


def cut_last_save_short(out: Path) -> None:
    """What a crash during the last save leaves: HF weights written, the train state not yet
    marked complete and moved into place."""
    last = out / "hf" / f"step-{STEPS}"
    staging = staging_dir(str(out / "hf"), STEPS)
    (last / TRAIN_STATE).rename(staging)
    (staging / META_FILE).unlink()


# The shared SlideDP run keeps BF16 moments (slidedp.moments_dtype), the embedding's streamed to
# the GPU and back each step (widened there, rounded home); FP32 host moments resume in
# test_units_updated_on_the_gpu_save_and_resume_exactly and the peer styles' tests.
SLIDEDP_RUN = ("--slidedp.moments_dtype=bfloat16", "--slidedp.embedding_update=gpu")


@pytest.fixture(scope="module")
def slidedp_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("slidedp")
    return out, train(out, "slidedp", *SLIDEDP_RUN)


def test_single_resumes_latest_after_a_crash(tmp_path):
    out = tmp_path / "run"
    full = train(out, "single")
    expected = train_state(out / "hf" / f"step-{STEPS}", tmp_path)
    cut_last_save_short(out)
    assert latest_checkpoint(str(out / "hf")) == out / "hf" / f"step-{HALF}"
    # The crashed run had logged every step past the save, and was killed writing one more row.
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": ')
    # A resume its loader cannot continue (another seq_len) is refused with one line before
    # anything is touched: the records past the save stay.
    records, events = (out / "metrics.jsonl").read_bytes(), tensorboard_losses(out)
    refused = launch(f"--training.steps={STEPS}", f"--job.dump_folder={out}",
                     f"--checkpoint.save_dir={out}/hf", "--checkpoint.resume_from=latest",
                     "--training.seq_len=64")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint.resume_from: {out}/hf/step-{HALF}: data state mismatch: checkpoint "
        "has seq_len=128, this loader 64")
    assert (out / "metrics.jsonl").read_bytes() == records and tensorboard_losses(out) == events
    resumed = train(out, "single", "--checkpoint.resume_from=latest")
    assert_resumed_exactly(full, resumed)  # each step once: the rows past the save were dropped
    assert tensorboard_losses(out) == [(r["step"], pytest.approx(r["loss"])) for r in full]
    assert_same_state(train_state(out / "hf" / f"step-{STEPS}", tmp_path), expected)


@pytest.mark.parametrize("mode", ["fsdp2", "slidedp"])
def test_two_ranks_resume_exactly(mode, slidedp_run, tmp_path):
    flags = SLIDEDP_RUN if mode == "slidedp" else ()
    if mode == "slidedp":
        first, full = slidedp_run
    else:
        first, full = tmp_path / "first", train(tmp_path / "first", mode)
    second = tmp_path / "second"
    second.mkdir()
    keep_first_half_of_metrics(first, second)
    resumed = train(second, mode, *flags, f"--checkpoint.resume_from={first}/hf/step-{HALF}")
    assert_resumed_exactly(full, resumed)
    # Its TensorBoard run has the name of the run it resumes, and the steps after the save.
    assert os.listdir(second / "tb") == os.listdir(first / "tb")
    assert tensorboard_losses(second) == [(r["step"], pytest.approx(r["loss"]))
                                          for r in full[HALF:]]
    final = f"hf/step-{STEPS}"
    saved = train_state(first / final, tmp_path)
    assert_same_state(train_state(second / final, tmp_path), saved)
    assert_same_state(load_file(second / final / "model.safetensors"),
                      load_file(first / final / "model.safetensors"))
    if mode == "slidedp":  # saved as kept: BF16 moments, FP32 master
        assert {t.dtype for k, t in saved.items() if "/exp_avg" in k} == {torch.bfloat16}
        assert {t.dtype for k, t in saved.items() if "/master.u" in k} == {torch.float32}


def test_background_saves_equal_blocking_ones_and_keep_the_newest(slidedp_run, tmp_path):
    """The fixture's saves were written in the background while later steps ran; this run waits
    for every save, saves at every step and keeps the newest 2."""
    first, full = slidedp_run
    blocking = train(tmp_path, "slidedp", *SLIDEDP_RUN, "--checkpoint.async_mode=disabled",
                     "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2")
    assert_resumed_exactly(full, blocking)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        ".lock", f"step-{STEPS - 1}", f"step-{STEPS}"]
    final = f"hf/step-{STEPS}"
    assert_same_state(train_state(tmp_path / final, tmp_path), train_state(first / final, tmp_path))
    assert all(r["checkpoint_blocked_s"] > 0 for r in blocking)


def resume_half_way(tmp_path: Path, *flags: str) -> tuple[Path, Path]:
    """A SlideDP run with `flags`, and a second one resumed from its half's save: the second
    reproduces the first's steps and final state bit for bit. Their output folders."""
    first, second = tmp_path / "first", tmp_path / "second"
    full = train(first, "slidedp", *flags)
    second.mkdir()
    keep_first_half_of_metrics(first, second)
    resumed = train(second, "slidedp", *flags, f"--checkpoint.resume_from={first}/hf/step-{HALF}")
    assert_resumed_exactly(full, resumed)
    final = f"hf/step-{STEPS}"
    assert_same_state(train_state(second / final, tmp_path), train_state(first / final, tmp_path))
    return first, second


@pytest.mark.parametrize("flags", [
    ("--slidedp.embedding_update=gpu", "--slidedp.gpu_state_blocks=1"),
    ("--slidedp.embedding_update=resident", "--slidedp.gpu_state_blocks=4",
     "--slidedp.moments_dtype=bfloat16")], ids=["streamed-and-one-block", "all-resident-bf16"])
def test_units_updated_on_the_gpu_save_and_resume_exactly(tmp_path, flags):
    """The embedding's state streamed to the GPU each step (slidedp.embedding_update = "gpu")
    and the first block's resident there (slidedp.gpu_state_blocks), or every unit resident with
    BF16 moments (BF16 there too), resume bit for bit: the saves wait for the state to be home
    (GpuUpdate.wait_home: the streamed copies land after the version gate opens, the resident
    state is copied home only for the save), and the resumed run fetches the loaded state
    (GpuUpdate.invalidate)."""
    resume_half_way(tmp_path, *flags)


def test_slidedp_world_size_mismatch_is_one_line(slidedp_run):
    out, _ = slidedp_run
    proc = run_cli("--job.config_file", "train_configs/debug_cpu.toml",
                   "--parallelism.mode=slidedp", f"--checkpoint.resume_from={out}/hf/step-{HALF}")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint.resume_from:") and "world_size = 2" in last, last


def test_slidedp_state_refuses_another_world_size(slidedp_run):
    """The backend's own check, for callers that skip the trainer's meta.json check."""
    out, _ = slidedp_run
    layout = StateLayout(get_flavor("qwen3-debug"), world=1)
    plan = HostStatePlan(bf16_shadow=True, grad_bf16=False, grad_accum=False, cpu_staging=False)
    state = SharedHostState(layout, plan, rank=0, world=1, share=lambda s: s,
                            barrier=lambda: None, pin=False)
    try:
        with pytest.raises(ValueError, match=r"world size \[2\], this run has 1 ranks"):
            load_shards(state, str(out / "hf" / f"step-{HALF}" / TRAIN_STATE))
    finally:
        state.close()


def test_meta_records_the_run(slidedp_run):
    out, _ = slidedp_run
    meta = json.loads((out / "hf" / f"step-{HALF}" / TRAIN_STATE / META_FILE).read_text())
    assert meta["step"] == HALF and meta["world_size"] == 2 and meta["mode"] == "slidedp"
    assert meta["flavor"] == "qwen3-debug" and meta["num_params"] == 205_504
    assert meta["data"]["sample"] == HALF * 8  # 8 samples per global step, all ranks


def test_resume_from_errors(tmp_path):
    assert "checkpoint.resume_from: directory not found" in parse_error(
        [f"--checkpoint.resume_from={tmp_path}/nope"])
    assert f"has no {TRAIN_STATE}/{META_FILE}" in parse_error(
        [f"--checkpoint.resume_from={tmp_path}"])
    assert "needs checkpoint.save_dir" in parse_error(["--checkpoint.resume_from=latest"])
    (tmp_path / "step-8" / f"{TRAIN_STATE}.tmp").mkdir(parents=True)  # a save cut short
    assert "no complete checkpoint" in parse_error(
        ["--checkpoint.resume_from=latest", f"--checkpoint.save_dir={tmp_path}"])


def test_synthetic_batches_resume_at_their_position():
    shape = dict(vocab_size=512, seq_len=16, local_batch_size=2, dp_rank=1, dp_world=2, seed=3)
    source = SyntheticBatches(**shape)
    batches = iter(source)
    drawn = [next(batches) for _ in range(5)]
    resumed = SyntheticBatches(**shape)
    resumed.load_state_dict({"micro_batches": 3})
    for (x, y), (rx, ry) in zip(drawn[3:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert source.state_dict() == {"micro_batches": 5}


def test_a_new_run_in_a_used_folder_is_refused_unless_it_overwrites(tmp_path):
    """A second run (not a resume) into an earlier run's folders is refused with one line and
    touches nothing; with job.overwrite it replaces the earlier run: its records and every save,
    so that `latest` is the new run's."""
    out = tmp_path / "run"
    folders = [f"--job.dump_folder={out}", f"--checkpoint.save_dir={out}/hf",
               "--checkpoint.interval=2"]
    first = launch("--training.steps=4", "--lr_scheduler.warmup_steps=4", *folders)
    assert first.returncode == 0, first.stderr[-3000:]
    assert ("lr_scheduler.warmup_steps = 4 is not below training.steps = 4: the learning rate "
            "never reaches optimizer.lr") in first.stderr
    records = (out / "metrics.jsonl").read_bytes()
    # Resumes that cannot continue it: a finished run, another global batch.
    finished = launch("--training.steps=4", "--checkpoint.resume_from=latest", *folders)
    assert finished.returncode == 2 and finished.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint.resume_from: {out}/hf/step-4 is at step 4, training.steps is 4: "
        "nothing is left to train (raise training.steps to train on)")
    other_batch = launch("--training.steps=4", f"--checkpoint.resume_from={out}/hf/step-2",
                         "--training.local_batch_size=4", *folders)
    assert other_batch.returncode == 2
    assert (f"{out}/hf/step-2 was saved with global_batch = 8, this run has 4 (samples per "
            "step") in other_batch.stderr.strip().splitlines()[-1]
    again = launch("--training.steps=2", "--training.seed=5", *folders)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"error: an earlier run is in these folders ({out}/metrics.jsonl; 2 save(s) in "
        f"{out}/hf (step-2, step-4)): resume it with --checkpoint.resume_from=latest, use "
        "another --job.dump_folder (and checkpoint.save_dir), or replace it with --job.overwrite")
    assert (out / "metrics.jsonl").read_bytes() == records
    assert latest_checkpoint(str(out / "hf")) == out / "hf" / "step-4"
    replaced = launch("--training.steps=2", "--training.seed=5", "--job.overwrite", *folders)
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert f"deleted {out}/hf/step-4 (job.overwrite" in replaced.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()] == [1, 2]
    assert sorted(p.name for p in (out / "hf").glob("step-*")) == ["step-2"]
    assert json.loads((out / "hf" / "step-2" / TRAIN_STATE / META_FILE).read_text())["seed"] == 5
