"""The start-up checks (recipes/preflight.py) and the device-memory estimate they use
(slidedp/plan/memory.py): every class of bad input is one ConfigError line naming the key or
file, raised before anything is allocated."""

import dataclasses
import os

import pytest
import torch

from models.hf_checkpoint import save_hf_checkpoint
from models.rope import RopeScaling
from protocols.model_spec import get_flavor
from recipes.batches import build_batches
from recipes.config import ConfigError, JobConfig, parse_config
from recipes.model import build_model
from recipes.preflight import (allocator_warning, check_device_memory, check_host_memory,
                               check_run, check_seq_len,
                               device_memory, largest_fitting_batch, launch_flags,
                               slidedp_host_bytes)
from slidedp.activations import parse_policy
from slidedp.plan.memory import activation_bytes
from tests.conftest import REPO

TINY = os.path.join(REPO, "tests", "assets", "tiny")
CPU = torch.device("cpu")
GiB = 2**30
H200 = int(140.4 * GiB)  # an H200's memory as torch reports it (docs/results/2026-11-30-h200x2/)
DEBUG = get_flavor("qwen3-debug")


def config_for(tmp_path, *flags: str) -> JobConfig:
    return parse_config([f"--job.dump_folder={tmp_path}/out", *flags])


def refused(config: JobConfig, *, world: int = 1, thorough: bool = True) -> str:
    with pytest.raises(ConfigError) as info:
        check_run(config, world=world, device=CPU, thorough=thorough)
    message = str(info.value)
    assert "\n" not in message
    return message


def files_config(tmp_path, data: str, *flags: str) -> JobConfig:
    return config_for(tmp_path, "--training.dataset=files", f"--training.dataset_path={data}",
                      f"--model.tokenizer_dir={TINY}", *flags)


def test_a_good_config_passes_and_leaves_no_output_folder_it_made(tmp_path):
    """The output folders are checked writable by creating them, and what the check created
    goes again: the run creates them when it locks them (recipes/run_lock.py)."""
    existing = tmp_path / "ck"
    existing.mkdir()
    config = files_config(tmp_path, f"{TINY}/corpus.jsonl", f"--checkpoint.save_dir={existing}",
                          f"--job.dump_folder={tmp_path}/a/b/out")
    checked = check_run(config, world=1, device=CPU, thorough=True)
    assert checked.name == "qwen3-debug" and checked.resume_dir is None
    assert not (tmp_path / "a").exists() and existing.is_dir()


def test_seq_len_above_the_model_positions(tmp_path):
    message = refused(config_for(tmp_path, "--training.seq_len=1000000000"))
    assert "training.seq_len = 1000000000" in message and "32,768 positions" in message
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=32768)
    check_seq_len(131072, dataclasses.replace(DEBUG, rope_scaling=yarn))  # its own limit
    assert not (tmp_path / "out").exists()  # refused before the output folders are made


def test_more_than_one_rank_in_mode_single(tmp_path):
    assert 'parallelism.mode = "single"' in refused(config_for(tmp_path), world=2)
    assert launch_flags(config_for(tmp_path), nproc=2) == ["--parallelism.mode=fsdp2"]
    assert launch_flags(config_for(tmp_path, "--parallelism.mode=slidedp"), nproc=2) == []
    assert launch_flags(config_for(tmp_path), nproc=1) == []


@pytest.fixture
def hf_dir(tmp_path):
    out = tmp_path / "hf"
    save_hf_checkpoint(build_model(DEBUG, seed=0).named_parameters(), DEBUG, out,
                       copy_tokenizer_from=TINY)
    return out


def test_model_directory_without_safetensors(tmp_path, hf_dir):
    (hf_dir / "model.safetensors").unlink()
    message = refused(config_for(tmp_path, f"--model.hf_dir={hf_dir}"))
    assert message.startswith("model.hf_dir:") and "model.safetensors" in message


def test_safetensors_that_do_not_cover_the_model(tmp_path, hf_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    message = refused(config_for(tmp_path, f"--model.hf_dir={hf_dir}"))
    assert message.startswith("model.hf_dir:") and "missing [norm.weight]" in message


def test_truncated_safetensors(tmp_path, hf_dir):
    (hf_dir / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a")
    assert refused(config_for(tmp_path, f"--model.hf_dir={hf_dir}")).startswith("model.hf_dir:")


def test_model_directory_without_a_tokenizer(tmp_path, hf_dir):
    (hf_dir / "tokenizer.json").unlink()
    config = config_for(tmp_path, f"--model.hf_dir={hf_dir}", "--training.dataset=files",
                        f"--training.dataset_path={TINY}/corpus.jsonl")
    message = refused(config)
    assert message.startswith("model.hf_dir:") and "tokenizer.json" in message


@pytest.mark.parametrize("name, content, where", [
    ("empty.jsonl", b"", "empty.jsonl: the file is empty"),
    ("blank.txt", b"\n  \n\n", "blank.txt: holds no documents"),
    ("bad.jsonl", b'{"text": "a"}\n\n{"text": oops}\n', "bad.jsonl:3: malformed JSON"),
    ("latin1.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "latin1.jsonl:2: not UTF-8"),
    ("notext.jsonl", b'{"content": "a"}\n', "notext.jsonl:1: expected an object"),
    ("bad.parquet", b"not parquet", "bad.parquet: not a readable parquet file"),
])
def test_bad_data_files_name_the_file_and_line(tmp_path, name, content, where):
    path = tmp_path / name
    path.write_bytes(content)
    message = refused(files_config(tmp_path, f"{TINY}/corpus.jsonl,{path}"))
    assert message.startswith("training.dataset_path:") and where in message
    # The ranks of a multi-rank launch skip the full read (the launcher did it); they find the
    # same mistake while tokenizing, still as one line naming the file and line.
    config = files_config(tmp_path, f"{TINY}/corpus.jsonl,{path}")
    if content:
        checked = check_run(config, world=1, device=CPU, thorough=False)
        with pytest.raises(ConfigError, match=f"^training.dataset_path: .*{where}"):
            build_batches(config, checked.args, dp_rank=0, dp_world=1)


def test_unwritable_output_folders(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    message = refused(config_for(tmp_path, f"--checkpoint.save_dir={blocker}/ck"))
    assert message.startswith("checkpoint.save_dir: cannot write to")
    config = config_for(tmp_path)
    config.job.dump_folder = str(blocker / "out")
    assert refused(config).startswith("job.dump_folder: cannot write to")


def test_resume_from_another_run_shape(tmp_path):
    step = tmp_path / "step-3" / "train_state"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"format_version": 1, "mode": "fsdp2", "world_size": 2}')
    message = refused(config_for(tmp_path, f"--checkpoint.resume_from={tmp_path}/step-3"))
    assert message.startswith("checkpoint.resume_from:") and "mode = 'fsdp2'" in message
    (step / "meta.json").write_text("{not json")
    assert "unreadable meta.json" in refused(
        config_for(tmp_path, f"--checkpoint.resume_from={tmp_path}/step-3"))


# ---- memory -----------------------------------------------------------------------------------


def gpu_config(mode: str, *, batch: int, seq_len: int = 4096, **slidedp) -> JobConfig:
    config = JobConfig()
    config.parallelism.mode = mode
    config.training.local_batch_size, config.training.seq_len = batch, seq_len
    config.activation_checkpoint.mode = "full"
    config.slidedp = dataclasses.replace(config.slidedp, **slidedp)
    return config


# Peak allocated GiB per GPU measured on 2 x H200 (docs/results/2026-11-30-h200x2/), seq 4096.
MEASURED = [
    ("fsdp2", "qwen3-8B", 16, {}, 85.9),
    ("fsdp2", "qwen3-8B", 32, {}, 120.6),
    ("fsdp2", "qwen3-14B", 8, {}, 125.0),
    ("slidedp", "qwen3-8B", 16, {}, 43.0),
    ("slidedp", "qwen3-8B", 48, {}, 115.3),
    ("slidedp", "qwen3-8B", 16, {"activation": "selective", "keep_blocks": 4}, 110.8),
    ("slidedp", "qwen3-14B", 16, {"activation": "selective"}, 82.4),
]


@pytest.mark.parametrize("mode, flavor, batch, slidedp, measured", MEASURED)
def test_estimate_is_near_the_measured_peak(mode, flavor, batch, slidedp, measured):
    """Close to what was measured, and none of these runs, which fit, is refused on an H200."""
    config = gpu_config(mode, batch=batch, **slidedp)
    est = device_memory(config, get_flavor(flavor), world=2)
    assert 0.9 < est.total / GiB / measured < 1.2
    check_device_memory(config, get_flavor(flavor), world=2, capacity=H200)


def test_a_run_near_the_devices_limit_on_the_default_allocator_is_warned_of_its_fragments():
    """Above 80% of the device, torch's default allocator gets a warning that names the fix
    (a step that fits by its allocations can fail on its fragments); expandable segments,
    or room to spare, get none."""
    h100 = int(79.2 * GiB)
    warning = allocator_warning(int(70.8 * GiB), h100, None)
    assert warning and "70.8 GiB of 79.2 GiB" in warning
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in warning
    assert allocator_warning(int(70.8 * GiB), h100, "max_split_size_mb:512") == warning
    assert allocator_warning(int(70.8 * GiB), h100, "expandable_segments:True") is None
    assert allocator_warning(int(60 * GiB), h100, None) is None


# Peak allocated GiB on one H200 (docs/results/2026-12-01-h200/h200_call3_runs.jsonl), Qwen3-4B,
# seq 4096, on both kernel paths: (mode, kernels, activations, batch, measured).
MEASURED_ONE_H200 = [
    ("fsdp2", "torch", "none", 2, 100.8), ("fsdp2", "torch", "none", 3, 124.3),
    ("fsdp2", "torch", "full", 16, 73.8),
    ("fsdp2", "liger", "none", 2, 79.2), ("fsdp2", "liger", "none", 5, 124.6),
    ("fsdp2", "liger", "full", 16, 68.6),
    ("slidedp", "torch", "keep", 4, 106.0), ("slidedp", "torch", "recompute", 16, 27.6),
    ("slidedp", "torch", "selective", 16, 44.9),
    ("slidedp", "liger", "keep", 4, 64.6), ("slidedp", "liger", "keep", 6, 94.9),
    ("slidedp", "liger", "recompute", 16, 22.6), ("slidedp", "liger", "selective", 16, 39.9),
]


@pytest.mark.parametrize("mode, kernels, activations, batch, measured", MEASURED_ONE_H200)
def test_estimate_is_near_the_measured_peak_on_both_kernel_paths(mode, kernels, activations,
                                                                   batch, measured):
    config = gpu_config(mode, batch=batch, activation=activations if mode == "slidedp" else "recompute")
    config.activation_checkpoint.mode = "full" if activations == "full" else "none"
    config.training.dtype = "bf16"
    est = device_memory(config, get_flavor("qwen3-4B"), world=1, kernels=kernels)
    # Full recompute counts a whole rebuilt block beside the inputs: up to 23% over.
    assert 0.95 < est.total / GiB / measured < 1.25
    check_device_memory(config, get_flavor("qwen3-4B"), world=1, capacity=H200, kernels=kernels)


# Peak allocated GiB on one H200 with optimizer state resident on the GPU, `keep`, clipping 1.0,
# Liger (docs/results/2026-12-06-h200-session30/): (flavor, batch, resident blocks, moments,
# measured); None where all three launches ran out of the device's memory.
MEASURED_RESIDENT = [
    ("qwen3-4B", 4, 36, "float32", 117.1), ("qwen3-4B", 1, 36, "float32", 71.7),
    ("qwen3-8B", 2, 36, "bfloat16", 121.3), ("qwen3-8B", 3, 33, "bfloat16", 129.0),
    ("qwen3-8B", 3, 36, "bfloat16", None),
]


@pytest.mark.parametrize("flavor, batch, blocks, moments, measured", MEASURED_RESIDENT)
def test_estimate_with_resident_optimizer_state_is_near_the_measured_peak(flavor, batch, blocks,
                                                                          moments, measured):
    """The resident master, moments and BF16 copy (14 B/param, 10 with BF16 moments) beside
    the kept activations: a little over what ran, and over the device where nothing fit."""
    config = gpu_config("slidedp", batch=batch, activation="keep", gpu_state_blocks=blocks,
                        embedding_update="resident", update_order="next_use",
                        moments_dtype=moments)
    config.activation_checkpoint.mode = "none"
    config.training.max_norm = 1.0
    est = device_memory(config, get_flavor(flavor), world=1, kernels="liger").total / GiB
    if measured is None:
        assert est > H200 / GiB
    else:
        assert 1.0 < est / measured < 1.1


def test_estimate_follows_the_shapes():
    args = get_flavor("qwen3-8B")
    keep, selective, recompute, offloaded = (
        activation_bytes(args, parse_policy(p), compute_bytes=2)[0].per_token
        for p in ("keep", "selective", "recompute", "selective@offload=1"))
    assert keep > selective > recompute == 2 * args.dim  # recompute keeps the BF16 block input
    assert offloaded == selective - recompute  # its input on the host, SDPA's outputs stay
    one, two, three = (device_memory(gpu_config("slidedp", batch=b), args, world=2)
                       for b in (1, 2, 3))
    # Affine in the batch: the RoPE tables a rebuilt block casts grow with the positions only.
    assert abs((three.activations - two.activations) - (two.activations - one.activations)) <= 1
    assert two.activations < 2 * one.activations and two.resident == one.resident
    fsdp2 = [device_memory(gpu_config("fsdp2", batch=1), args, world=w).resident
             for w in (2, 4)]
    assert fsdp2[1] < fsdp2[0]  # sharded over more ranks


def test_device_memory_refused_with_the_numbers():
    args, capacity = get_flavor("qwen3-8B"), 140 * GiB
    check_device_memory(gpu_config("slidedp", batch=48), args, world=2, capacity=capacity)
    config = gpu_config("slidedp", batch=96)
    with pytest.raises(ConfigError) as info:
        check_device_memory(config, args, world=2, capacity=capacity)
    message = str(info.value)
    fits = largest_fitting_batch(config, args, world=2, capacity=capacity)
    assert 48 <= fits < 96 and f"training.local_batch_size = {fits} fits" in message
    assert "GiB per device" in message and "the device has 140.0 GiB" in message
    bigger = gpu_config("slidedp", batch=fits + 1)
    assert device_memory(bigger, args, world=2).total > capacity
    with pytest.raises(ConfigError, match='alone do not fit: use parallelism.mode = "slidedp"'):
        check_device_memory(gpu_config("single", batch=1), get_flavor("qwen3-14B"), world=1,
                            capacity=capacity)


# The one-H200 machine's /proc/meminfo (docs/results/2026-12-01-h200/h200_call1_log.txt), bytes.
H200_HOST_TOTAL, H200_HOST_AVAILABLE = 131961788 * 1024, 131437468 * 1024


def test_qwen3_8b_with_clipping_fits_the_one_h200_host():
    """Qwen3-8B with the default clipping (max_norm = 1.0) and the shadow on one H200 (128 GiB
    of RAM): 14 B/param, 106.8 GiB, where an FP32 gradient buffer made it 18 (137 GiB). The
    start-up check agrees; with accumulation (+4 B/param) it refuses, naming the numbers."""
    config, args = gpu_config("slidedp", batch=16), get_flavor("qwen3-8B")
    assert config.training.max_norm == 1.0 and config.slidedp.bf16_shadow
    for shadow in (True, False):  # without the shadow the gradients take its 2 B/param
        shared = slidedp_host_bytes(config, args, world=1, bf16_shadow=shadow)
        assert shared / args.num_params() == pytest.approx(14.0, abs=0.01)
        assert shared / GiB == pytest.approx(106.8, abs=0.1)
    check_host_memory(config, args, world=1, on_cpu=False, available=H200_HOST_AVAILABLE,
                      total=H200_HOST_TOTAL)
    config.training.grad_accum_steps = 2
    with pytest.raises(ConfigError, match=r"needs 137\.3 GiB \(18\.0 B/param\).* set "
                                          r"slidedp\.bf16_shadow = false \(16\.0 B/param\)"):
        check_host_memory(config, args, world=1, on_cpu=False, available=H200_HOST_AVAILABLE,
                          total=H200_HOST_TOTAL)


def test_state_sharded_across_nodes_counts_a_node_share():
    """slidedp.nodes_state = "sharded" on 2 nodes: each node's host state is half the whole."""
    config, args = gpu_config("slidedp", batch=16), get_flavor("qwen3-8B")
    whole = slidedp_host_bytes(config, args, world=16, nodes=2)  # replicated: the whole
    config.slidedp.nodes_state = "sharded"
    assert slidedp_host_bytes(config, args, world=16, nodes=2) == pytest.approx(whole / 2,
                                                                                rel=1e-3)


def test_estimate_counts_the_reduced_gradients_held_on_the_device():
    """Without the shadow and with updates during backward (12 B/param of host memory), each
    reduced gradient waits for its update on the GPU: the estimate counts one step's, 2/R
    B/param, where activations are freed; a deferred or shadowed run holds them on the host."""
    args = get_flavor("qwen3-8B")
    for world in (1, 2):
        held = gpu_config("slidedp", batch=1, bf16_shadow=False)
        held.training.max_norm, held.training.nonfinite = 0.0, "off"
        assert device_memory(held, args, world=world).gradients == pytest.approx(
            2 * args.num_params() / world, rel=0.01)
        for shadow, max_norm in ((True, 0.0), (False, 1.0)):
            config = gpu_config("slidedp", batch=1, bf16_shadow=shadow)
            config.training.max_norm, config.training.nonfinite = max_norm, "off"
            assert device_memory(config, args, world=world).gradients == 0
    held.training.grad_accum_steps = 2  # the FP32 sum on the host
    assert device_memory(held, args, world=1).gradients == 0


def test_host_memory_refused_with_the_numbers():
    config, args = gpu_config("slidedp", batch=1), get_flavor("qwen2.5-72B")
    with pytest.raises(ConfigError, match=r"slidedp: the host state needs .* GiB .*MemAvailable"):
        check_host_memory(config, args, world=2, on_cpu=False, available=256 * GiB,
                          total=2048 * GiB)
    config.slidedp.check_host_memory = False  # machines whose memory grows on demand
    check_host_memory(config, args, world=2, on_cpu=False, available=256 * GiB,
                      total=2048 * GiB)
    # fsdp2 builds the FP32 model on the CPU in every rank before sharding it.
    with pytest.raises(ConfigError, match=r"host memory: 8 rank\(s\)"):
        check_host_memory(gpu_config("fsdp2", batch=1), args, world=8, on_cpu=False,
                          available=1024 * GiB, total=1024 * GiB)
    # On the CPU the device is the host: activations count.
    cpu = JobConfig()
    cpu.training.local_batch_size = 10**6
    with pytest.raises(ConfigError, match="lower training.local_batch_size"):
        check_host_memory(cpu, DEBUG, world=1, on_cpu=True, available=24 * GiB, total=24 * GiB)
    cpu.training.local_batch_size = 8
    check_host_memory(cpu, DEBUG, world=1, on_cpu=True, available=24 * GiB, total=24 * GiB)

