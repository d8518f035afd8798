"""SlideDP on real gloo ranks equals the `single` backend on the same global batch.

Every datapath (replicated|sharded delivery x gpu|cpu reduction), with gradient accumulation,
global-norm clipping, chunk sizes that do not divide a block, keep/recompute activations and the
FP32-cast delivery path, for 2 and 3 ranks; plus the pieces (plan, layout, host state) alone.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from models.flavors import get_flavor
from recipes.baselines.eager import build_single_backend
from slidedp.layout import SHARD_ALIGN, StateLayout
from slidedp.schedule import plan_micro_batch
from tests.conftest import REPO, kill_process_tree, run_torchrun, subprocess_env
from tests.slidedp_worker import global_batches, make_config

# A chunk of 0.003 MiB is 1536 elements: it divides neither a block nor a shard.
ODD_CHUNK = 0.003


def run_workers(tmp_path, *, world: int, variants: list[dict], flavor: str, steps: int,
                accum: int, max_norm: float, device: str = "cpu",
                kernels: str = "auto") -> list[dict]:
    run_torchrun([os.path.join(REPO, "tests", "slidedp_worker.py"),
                  "--variants", json.dumps(variants), "--flavor", flavor, "--steps", str(steps),
                  "--accum", str(accum), "--max-norm", str(max_norm), "--out", str(tmp_path),
                  "--device", device, "--kernels", kernels], nproc=world)
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    for i, r in enumerate(results):
        r["weights"] = torch.load(tmp_path / f"weights_{i}.pt")
    return results


def single_reference(*, world: int, flavor: str, steps: int, accum: int, max_norm: float,
                     device: str = "cpu", kernels: str = "auto"):
    cfg = make_config({}, accum=accum, max_norm=max_norm, kernels=kernels)
    backend = build_single_backend(cfg, get_flavor(flavor), device=torch.device(device))
    losses = []
    for micro in global_batches(steps=steps, accum=accum, batch=2 * world, seq=16,
                                vocab=get_flavor(flavor).vocab_size, seed=7):
        ntok = sum(int((y != -100).sum()) for _, y in micro)
        losses.append(backend.train_step(micro, lr=1e-3, global_target_tokens=ntok).loss_sum / ntok)
    return losses, {n: t.detach().cpu().clone() for n, t in backend.named_master_parameters()}


def assert_matches_reference(results, ref_losses, ref_weights):
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-2), r["variant"]
        assert set(r["weights"]) == set(ref_weights)
        # Adam moves a weight by up to ~lr per step whatever the gradient's size, so BF16
        # rounding of near-zero gradients (e.g. the key bias, whose exact gradient is 0) may flip
        # a few steps: allow 2 lr per step anywhere, and require the typical element to agree
        # far more closely.
        diff = torch.cat([(r["weights"][n] - w).abs().flatten() for n, w in ref_weights.items()])
        assert diff.max() <= 2 * 1e-3 * len(ref_losses), (r["variant"], diff.max())
        assert diff.mean() <= 1e-4, (r["variant"], diff.mean())


def test_two_ranks_every_datapath_with_accumulation_and_clipping(tmp_path):
    variants = [
        {"delivery": "sharded", "reduction": "gpu", "chunk_mib": ODD_CHUNK},
        {"delivery": "replicated", "reduction": "cpu", "chunk_mib": ODD_CHUNK},
        {"delivery": "replicated", "reduction": "gpu", "activation": "keep"},
        {"delivery": "sharded", "reduction": "gpu", "activation": "selective", "window_slots": 2},
        {"delivery": "sharded", "reduction": "cpu", "keep_blocks": 2, "bf16_shadow": False,
         "window_slots": 2, "chunk_mib": ODD_CHUNK},
    ]
    kw = dict(flavor="qwen3-debug", steps=3, accum=2, max_norm=0.5)
    results = run_workers(tmp_path, world=2, variants=variants, **kw)
    ref_losses, ref_weights = single_reference(world=2, **kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    # Traffic per rank (paper's table): sharded delivery halves H2D at R=2; CPU-side reduction
    # returns the full gradient (2x the GPU-reduced shard) and sums R copies on the host.
    t = [r["counters"][0] for r in results]
    assert t[0]["traffic_h2d_mb"] * 2 == pytest.approx(t[1]["traffic_h2d_mb"])
    assert t[0]["traffic_d2h_mb"] * 2 == pytest.approx(t[1]["traffic_d2h_mb"])
    assert t[1]["traffic_host_reduce_mb"] == pytest.approx(t[1]["traffic_d2h_mb"])
    assert t[0]["traffic_all_gather_mb"] > 0 and t[1]["traffic_all_gather_mb"] == 0
    # Fewer slots (2) cost re-deliveries in backward: more H2D than the 3-slot sharded run.
    assert t[3]["traffic_h2d_mb"] > t[0]["traffic_h2d_mb"]


def test_two_ranks_clipping_without_accumulation(tmp_path):
    # One micro-batch with clipping: the route takes the norm (on the GPU, or inside the host
    # sum) and the gradients wait on the host for the clipped update of the next step.
    variants = [{"delivery": "sharded", "reduction": "gpu"},
                {"delivery": "replicated", "reduction": "cpu", "chunk_mib": ODD_CHUNK}]
    kw = dict(flavor="qwen3-debug", steps=3, accum=1, max_norm=0.05)
    results = run_workers(tmp_path, world=2, variants=variants, **kw)
    ref_losses, ref_weights = single_reference(world=2, **kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    assert all(n > kw["max_norm"] for r in results for n in r["grad_norms"])  # it did clip
    for r in results:
        later = r["counters"][-1]  # the step after a clipped one runs that step's updates
        assert later["host_grad_job_s"] > 0 and later["host_accumulate_s"] > 0
        assert later["host_clipped_update_s"] > 0 and "host_update_s" not in later


def test_routes_switch_between_steps_in_every_direction(tmp_path):
    """set_routes through all 12 transitions of the four datapaths (an Eulerian circuit), with
    accumulation: the cpu route's buffer release must not wait for returns the gpu route never
    made (it hung on cpu -> gpu -> cpu)."""
    a, b = ["sharded", "cpu"], ["sharded", "gpu"]
    c, d = ["replicated", "cpu"], ["replicated", "gpu"]
    circuit = [a, b, a, c, a, d, b, c, b, d, c, d, a]
    variants = [{"delivery": "sharded", "reduction": "cpu", "routes_per_step": circuit}]
    kw = dict(flavor="qwen3-debug", steps=len(circuit), accum=2, max_norm=0.0)
    results = run_workers(tmp_path, world=2, variants=variants, **kw)
    ref_losses, ref_weights = single_reference(world=2, **kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    cpu_steps = [i for i, route in enumerate(circuit) if route[1] == "cpu"]
    counters = results[0]["counters"]
    assert all((counters[i]["traffic_host_reduce_mb"] > 0) == (i in cpu_steps)
               for i in range(len(circuit)))


def test_three_ranks_untied_qwen25(tmp_path):
    # Without clipping: updates during backward (the non-finite guard off), and after it (on).
    variants = [{"delivery": "sharded", "reduction": "gpu", "chunk_mib": ODD_CHUNK,
                 "nonfinite": "off"},
                {"delivery": "replicated", "reduction": "cpu", "activation": "keep"}]
    kw = dict(flavor="qwen2.5-debug", steps=3, accum=1, max_norm=0.0)
    results = run_workers(tmp_path, world=3, variants=variants, **kw)
    ref_losses, ref_weights = single_reference(world=3, **kw)
    assert_matches_reference(results, ref_losses, ref_weights)
    sharded, replicated = (r["counters"][0] for r in results)
    assert "host_update_s" in sharded and "host_update_s" not in replicated
    assert "host_clipped_update_s" in results[1]["counters"][1]  # step 1's, after step 1
    assert sharded["traffic_h2d_mb"] * 3 == pytest.approx(replicated["traffic_h2d_mb"])
    assert sharded["traffic_d2h_mb"] * 3 == pytest.approx(replicated["traffic_d2h_mb"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on the GPU machine)")
def test_two_gpus_every_datapath(tmp_path):
    """The CUDA path: streams, events, registered pinned memory, NCCL all-gather/reduce-scatter."""
    variants = [{"delivery": d, "reduction": r, "chunk_mib": ODD_CHUNK}
                for d in ("sharded", "replicated") for r in ("gpu", "cpu")]
    variants.append({"delivery": "sharded", "reduction": "gpu", "activation": "keep",
                     "bf16_shadow": False, "window_slots": 2})
    variants.append({"delivery": "sharded", "reduction": "gpu", "activation": "selective",
                     "keep_blocks": 1, "window_slots": 2})
    kw = dict(flavor="qwen3-debug", steps=3, accum=2, max_norm=0.5)
    results = run_workers(tmp_path, world=2, variants=variants, device="cuda", **kw)
    ref_losses, ref_weights = single_reference(world=2, device="cuda", **kw)
    assert_matches_reference(results, ref_losses, ref_weights)


@pytest.mark.parametrize("n_slots", [2, 3, 5])
def test_plan_keeps_every_use_on_the_right_buffer(n_slots):
    n_blocks, resident = 6, {}
    for micro in range(2):
        uses, after = plan_micro_batch(n_blocks, n_slots, resident=resident,
                                       embed_head_resident=micro > 0)
        held: dict[int, int] = {s: u for s, u in resident.items()}
        for use in uses:
            if use.unit in (0, n_blocks + 1):
                continue
            if use.deliver:
                held[use.buffer] = use.unit
            assert held.get(use.buffer) == use.unit
        assert after == held
        resident = after
        expected = [("fwd", b) for b in range(1, n_blocks + 1)] + [("bwd", b) for b in range(n_blocks, 0, -1)]
        assert [(u.phase, u.unit) for u in uses if 0 < u.unit <= n_blocks] == expected
    # Backward reuses what forward left in the window: only L - n_slots re-deliveries.
    first, _ = plan_micro_batch(n_blocks, n_slots, resident={}, embed_head_resident=False)
    assert sum(u.deliver for u in first if u.phase == "bwd") == n_blocks - n_slots


@pytest.mark.parametrize("world", [1, 2, 3])
def test_layout_shards_partition_every_unit(world):
    layout = StateLayout(get_flavor("qwen2.5-debug"), world=world)
    offset = 0
    for unit in layout.units:
        assert unit.host_offset == offset and unit.padded % (world * SHARD_ALIGN) == 0
        shards = [unit.shard(r, world) for r in range(world)]
        assert shards[0][0] == 0 and shards[-1][1] == unit.padded
        assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
        offset += unit.padded
    assert layout.total == offset
    assert sum(p.numel for u in layout.units for p in u.params) == get_flavor("qwen2.5-debug").num_params()


def test_clipped_update_between_steps_is_counted_in_the_next():
    """Step t's clipped update runs after step t returns; if it ends before step t+1 starts, its
    host time is still reported by step t+1."""
    from slidedp.engine import SlideDPBackend

    args = get_flavor("qwen3-debug")
    backend = SlideDPBackend(make_config({}, accum=1, max_norm=1e-3), args,
                             device=torch.device("cpu"), dp_rank=0, dp_world=1)
    try:
        x = torch.randint(0, args.vocab_size, (2, 16))
        first = backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel())
        # Reading the weights waits for pending updates: step 1's clipped update is finished
        # before step 2 starts.
        dict(backend.named_master_parameters())
        second = backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel())
    finally:
        backend.close()
    assert "host_clipped_update_s" not in first.extra
    assert second.extra["host_clipped_update_s"] > 0
    assert second.extra["host_grad_job_s"] > 0


def test_activation_policies_switch_between_steps():
    """set_activation between steps (the bench and AutoPolicy's validation use it): a run that
    changes policy every step still equals `single`."""
    from slidedp.engine import SlideDPBackend

    kw = dict(flavor="qwen3-debug", steps=3, accum=1, max_norm=0.0)
    args = get_flavor(kw["flavor"])
    backend = SlideDPBackend(make_config({}, accum=1, max_norm=0.0), args,
                             device=torch.device("cpu"), dp_rank=0, dp_world=1)
    losses = []
    try:
        data = global_batches(steps=3, accum=1, batch=2, seq=16, vocab=args.vocab_size, seed=7)
        for micro, (policy, keep) in zip(data, [("keep", 0), ("selective", 2), ("recompute", 1)]):
            backend.set_activation(default=policy, keep_blocks=keep)
            ntok = sum(int((y != -100).sum()) for _, y in micro)
            losses.append(backend.train_step(micro, lr=1e-3, global_target_tokens=ntok).loss_sum / ntok)
        weights = {n: t.clone() for n, t in backend.named_master_parameters()}
    finally:
        backend.close()
    assert backend.policies == ["keep", "recompute", "recompute", "recompute"]
    ref_losses, ref_weights = single_reference(world=1, **kw)
    assert_matches_reference([{"variant": "switching", "losses": losses, "weights": weights}],
                             ref_losses, ref_weights)


def test_too_little_host_memory_is_refused_before_allocating():
    from slidedp.engine import SlideDPBackend

    before = _shmem_bytes()
    with pytest.raises(MemoryError, match="GiB of host memory"):
        SlideDPBackend(make_config({}, accum=1, max_norm=0.0), get_flavor("qwen2.5-72B"),
                       device=torch.device("cpu"), dp_rank=0, dp_world=1)
    assert _shmem_bytes() - before < 2**26


def _shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))


KILLED_RANK = """
import os, signal, sys, torch
from models.args import QwenArgs
from slidedp.host_state import HostStatePlan, SharedHostState
from slidedp.layout import StateLayout
args = QwenArgs(family="qwen3", dim=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64,
                hidden_dim=1536, vocab_size=32768, qk_norm=True, qkv_bias=False, tie_embeddings=False)
plan = HostStatePlan(bf16_shadow=True, grad_accum=False, cpu_staging=False)
state = SharedHostState(StateLayout(args, world=1), plan, rank=0, world=1, share=lambda s: s,
                        barrier=lambda: None, pin=False)
state.master.fill_(1.0)
state.exp_avg.fill_(1.0)
print(state.master.numel() * 8, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_shared_state_is_released_when_a_rank_is_killed():
    before = _shmem_bytes()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RANK], cwd=REPO, text=True,
                            env=subprocess_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    touched = int(proc.stdout.readline())
    assert touched > 2**27
    assert _shmem_bytes() - before > touched // 2  # the pages live in shared memory ...
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == -9
    assert _shmem_bytes() - before < touched // 4  # ... and go with the killed process


@pytest.mark.parametrize("flavor", ["qwen3-debug", "qwen2.5-debug"])
def test_host_state_starts_from_a_hugging_face_checkpoint(tmp_path, flavor):
    """model.hf_dir streams the checkpoint into the shared FP32 master (and BF16 shadow)."""
    from models.hf_checkpoint import save_hf_checkpoint
    from models.qwen import QwenModel
    from slidedp.engine import SlideDPBackend

    args = get_flavor(flavor)
    torch.manual_seed(123)
    model = QwenModel(args)
    model.init_weights()
    save_hf_checkpoint(model.named_parameters(), args, tmp_path / "hf", dtype=torch.float32,
                       max_shard_bytes=2**17)
    cfg = make_config({}, accum=1, max_norm=0.0)
    cfg.model.hf_dir = str(tmp_path / "hf")
    backend = SlideDPBackend(cfg, args, device=torch.device("cpu"), dp_rank=0, dp_world=1)
    try:
        loaded = dict(backend.named_master_parameters())
        assert set(loaded) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(loaded[name], p.detach(), rtol=0, atol=0)
        torch.testing.assert_close(backend.state.shadow[:backend.layout.total],
                                   backend.state.master.to(torch.bfloat16), rtol=0, atol=0)
    finally:
        backend.close()


FAILING_STEP = """
import sys, torch, torch.distributed as dist
from models.flavors import get_flavor
from slidedp.engine import SlideDPBackend
from tests.slidedp_worker import make_config
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
args = get_flavor("qwen3-debug")
backend = SlideDPBackend(make_config({"delivery": sys.argv[1]}, accum=1, max_norm=float(sys.argv[2])),
                         args, device=torch.device("cpu"), dp_rank=rank, dp_world=world)
x = torch.randint(0, args.vocab_size, (2, 16))
backend.train_step([(x, x)], lr=1e-3, global_target_tokens=x.numel() * world)
bad = torch.full((2, 16), args.vocab_size)  # not a token: the embedding lookup raises
if sys.argv[3] == "closed":
    try:
        backend.train_step([(bad, x)], lr=1e-3, global_target_tokens=x.numel() * world)
    finally:
        backend.close()
else:  # uncaught, and no close(): the interpreter's exit must not wait on the runtime's threads
    backend.train_step([(bad, x)], lr=1e-3, global_target_tokens=x.numel() * world)
"""


@pytest.mark.parametrize("delivery,max_norm,ending", [("sharded", 0.0, "uncaught"),
                                                       ("replicated", 1.0, "closed")])
def test_a_failing_step_ends_every_rank_promptly(tmp_path, delivery, max_norm, ending):
    """An error inside a step (here a bad token id; on a GPU typically out-of-memory) reaches
    the caller and the process exits, releasing the shared state, instead of waiting forever
    on the runtime's delivery and update threads."""
    script = tmp_path / "failing_step.py"
    script.write_text(FAILING_STEP)
    before = _shmem_bytes()
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node=2", str(script), delivery, str(max_norm), ending],
                                cwd=REPO, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        raise AssertionError("a rank hung after its step failed:\n" + log.read_text()[-3000:])
    out = log.read_text()
    assert proc.returncode != 0
    assert "IndexError" in out, out[-3000:]
    assert _shmem_bytes() - before < 2**26
