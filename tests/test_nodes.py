"""SlideDP over several nodes (slidedp/nodes.py), tested as two nodes on this machine: the
launch's rendezvous flags, and real gloo ranks grouped into nodes as torchrun groups them."""

import dataclasses
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from protocols.model_spec import get_flavor
from recipes.baselines.eager import build_fsdp2_backend
from recipes.config import ConfigError, run_config
from recipes.launch import rendezvous_args
from slidedp.engine import SlideDPBackend
from slidedp.config import SlideDPConfig
from slidedp.layout import NODE_ALIGN, StateLayout
from slidedp.node_shards import node_shards
from slidedp.nodes import NodeMismatch, Nodes, ReplicaDiverged
from tests.conftest import REPO, free_port, kill_process_tree, run_ranks, subprocess_env
from tests.slidedp_worker import global_batches, make_config
from tests.test_slidedp import assert_matches_reference, single_reference


def test_rendezvous_args_name_the_node_or_the_endpoint():
    assert rendezvous_args({}) == ["--standalone"]
    assert rendezvous_args({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "n0",
                            "MASTER_PORT": "29500"}) == [
        "--nnodes=2", "--node-rank=1", "--master-addr=n0", "--master-port=29500"]
    assert rendezvous_args({"NNODES": "2", "RDZV_ENDPOINT": "n0:29400"}) == [
        "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=n0:29400", "--rdzv-id=slidedp"]
    with pytest.raises(ConfigError, match="NODE_RANK, MASTER_ADDR"):
        rendezvous_args({"NNODES": "2", "MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match="NODE_RANK must be 0 to 1"):
        rendezvous_args({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})


WORLD, NODES, STEPS, ACCUM, MAX_NORM = 4, 2, 3, 2, 0.5
FLAVOR = "qwen3-debug"


def _train(backend, rank: int, *, accum: int, corrupt_after: int | None = None,
           save: tuple[int, str] | None = None, first: int = 1, steps: int = STEPS) -> dict:
    """Steps `first` to `steps` of the worker's global batches, rank `rank`'s slice; with
    `corrupt_after`, node 1's local rank 0 nudges its own replica's master after that step;
    `save` = (step, folder): the host state saved after that step."""
    losses, norms, error = [], [], None
    data = global_batches(steps=steps, accum=accum, batch=2 * WORLD, seq=16,
                          vocab=get_flavor(FLAVOR).vocab_size, seed=7)
    for step, micro in enumerate(data, 1):
        if step < first:
            continue
        ntok = sum(int((y != -100).sum()) for _, y in micro)
        mine = [(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]) for x, y in micro]
        try:
            r = backend.train_step(mine, lr=1e-3, global_target_tokens=ntok)
        except ReplicaDiverged as e:
            error = str(e)
            break
        losses.append(r.loss_sum / ntok)
        norms.append(r.grad_norm)
        if step == corrupt_after and rank == 2:
            backend._drain()
            backend.state.master[0] += 1e-3
        if save is not None and step == save[0]:
            backend.snapshot_state(None)(save[1])
    # Before anything reads the whole mapping: the pages of its memfd that exist.
    held = _memfd_bytes(backend.state) if hasattr(backend, "state") else None
    weights = {n: t.clone() for n, t in backend.named_master_parameters()}
    state = ({name: backend.state.regions[name].clone() for name in ("exp_avg", "exp_avg_sq")}
             if hasattr(backend, "state") else {})
    backend.close()
    return {"losses": losses, "grad_norms": norms, "weights": weights, "state": state,
            "error": error, "held": held,
            "bytes": (backend.state.nbytes, backend.state.held_bytes) if held else None}


def _memfd_bytes(state) -> int:
    """Bytes allocated to the node's memfd (the mapping's file, as /proc/self/map_files has it)."""
    start = state.master.data_ptr()  # the first region starts the mapping
    for line in open("/proc/self/maps"):
        span = line.split()[0]
        if int(span.split("-")[0], 16) == start:
            fd = os.open(f"/proc/self/map_files/{span}", os.O_RDONLY)
            try:
                return os.fstat(fd).st_blocks * 512
            finally:
                os.close(fd)
    raise AssertionError("the host state's mapping is not in /proc/self/maps")


def _sharded_across_nodes(rank: int, world: int, save_dir: str) -> dict:
    """slidedp.nodes_state = "sharded": STEPS steps, saved after the one before last; then a
    new backend resumes from that save and takes the last step again."""
    cfg = run_config(make_config({"nodes_state": "sharded"}, accum=ACCUM, max_norm=MAX_NORM))
    build = lambda: SlideDPBackend(cfg, get_flavor(FLAVOR), device=torch.device("cpu"),
                                   dp_rank=rank, dp_world=world)
    out = _train(build(), rank, accum=ACCUM, save=(STEPS - 1, save_dir))
    resumed = build()
    resumed.load_state(save_dir)
    out["resumed"] = _train(resumed, rank, accum=ACCUM, first=STEPS)
    return out


def _restarted_replicas(rank: int, world: int, save_dir: str) -> dict:
    """Replicated across nodes: STEPS steps, node 0 saving after the one before last; then both
    nodes restart (new backends) from that save and take the last step again."""
    os.makedirs(save_dir, exist_ok=True)
    cfg = run_config(make_config({"delivery": "sharded"}, accum=ACCUM, max_norm=MAX_NORM))
    build = lambda: SlideDPBackend(cfg, get_flavor(FLAVOR), device=torch.device("cpu"),
                                   dp_rank=rank, dp_world=world)
    out = _train(build(), rank, accum=ACCUM, save=(STEPS - 1, save_dir))
    dist.barrier()  # node 0's files are complete before any node reads them
    resumed = build()
    resumed.load_state(save_dir)
    out["resumed"] = _train(resumed, rank, accum=ACCUM, first=STEPS)
    out["files"] = sorted(os.listdir(save_dir))
    return out


def _nodes_rank(rank: int, world: int, save_dir: str) -> dict:
    """On 2 nodes x 2 ranks: fsdp2 over all 4, SlideDP's variants, the checksum's detection
    and the refusal of a node whose configuration differs."""
    cfg = make_config({}, accum=ACCUM, max_norm=MAX_NORM)
    out = {"fsdp2": _train(build_fsdp2_backend(cfg, get_flavor(FLAVOR), device=torch.device("cpu")),
                           rank, accum=ACCUM)}
    variants = {"sharded": ({"delivery": "sharded", "replica_check_every": 1}, ACCUM),
                "replicated": ({"delivery": "replicated", "chunk_mib": 0.003}, 1)}
    for name, (variant, accum) in variants.items():
        cfg = make_config(variant, accum=accum, max_norm=MAX_NORM)
        out[name] = _train(SlideDPBackend(run_config(cfg), get_flavor(FLAVOR), device=torch.device("cpu"),
                                          dp_rank=rank, dp_world=world), rank, accum=accum)
    out["restarted"] = _restarted_replicas(rank, world, f"{save_dir}/replicated")
    cfg = make_config({"replica_check_every": 1}, accum=1, max_norm=MAX_NORM)
    out["long"] = _train(SlideDPBackend(run_config(cfg), get_flavor(FLAVOR), device=torch.device("cpu"),
                                        dp_rank=rank, dp_world=world), rank, accum=1, steps=20)
    out["across"] = _sharded_across_nodes(rank, world, save_dir)
    cfg = make_config({"nodes_state": "sharded"}, accum=1, max_norm=MAX_NORM)
    out["across-one"] = _train(SlideDPBackend(run_config(cfg), get_flavor(FLAVOR),
                                              device=torch.device("cpu"), dp_rank=rank,
                                              dp_world=world), rank, accum=1)
    cfg = make_config({"replica_check_every": 2}, accum=1, max_norm=MAX_NORM)
    out["diverged"] = _train(SlideDPBackend(run_config(cfg), get_flavor(FLAVOR), device=torch.device("cpu"),
                                            dp_rank=rank, dp_world=world),
                             rank, accum=1, corrupt_after=1)
    cfg = make_config({"chunk_mib": 1.0 if rank >= 2 else 32.0}, accum=1, max_norm=MAX_NORM)
    try:
        SlideDPBackend(run_config(cfg), get_flavor(FLAVOR), device=torch.device("cpu"), dp_rank=rank,
                       dp_world=world)
        out["mismatch"] = None
    except NodeMismatch as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def nodes_runs(tmp_path_factory) -> list[dict]:
    """One launch of 4 real gloo ranks as 2 nodes of 2, every run of this module's tests."""
    save_dir = tmp_path_factory.mktemp("sharded-state")
    return run_ranks(_nodes_rank, world=WORLD, nodes=NODES, args=(str(save_dir),))


@pytest.mark.parametrize("variant", ["sharded", "replicated"])
def test_two_nodes_match_fsdp2_and_single(nodes_runs, variant):
    """Clipping on (the norm starts above 0.5), with and without accumulation: the losses and
    norms equal fsdp2's on 4 ranks (the norm counted once, not once per node), and the weights
    single's."""
    accum = ACCUM if variant == "sharded" else 1
    run, fsdp2 = nodes_runs[0][variant], nodes_runs[0]["fsdp2"]
    if accum == ACCUM:
        assert run["losses"] == pytest.approx(fsdp2["losses"], rel=1e-2)
        assert run["grad_norms"] == pytest.approx(fsdp2["grad_norms"], rel=2e-2)
        assert min(run["grad_norms"]) > MAX_NORM  # every step clipped
    ref_losses, ref_weights = single_reference(world=WORLD, flavor=FLAVOR, steps=STEPS,
                                               accum=accum, max_norm=MAX_NORM)
    assert_matches_reference([{**run, "variant": variant}], ref_losses, ref_weights)


@pytest.mark.parametrize("variant", ["sharded", "replicated"])
def test_replicas_stay_bit_identical(nodes_runs, variant):
    """Node 1's master weights and Adam moments (its local rank 0 maps them all) are node 0's,
    bit for bit, and every rank reports the same losses and norms."""
    node0, node1 = nodes_runs[0][variant], nodes_runs[2][variant]
    assert node0["weights"].keys() == node1["weights"].keys()
    for name, w in node0["weights"].items():
        assert torch.equal(w, node1["weights"][name]), name
    for name, m in node0["state"].items():
        assert torch.equal(m, node1["state"][name]), name
    assert all(r[variant]["losses"] == node0["losses"] and
               r[variant]["grad_norms"] == node0["grad_norms"] for r in nodes_runs)


def test_state_sharded_across_nodes_matches_fsdp2_and_single(nodes_runs):
    """slidedp.nodes_state = "sharded", clipping and accumulation: the losses and norms equal
    fsdp2's on 4 ranks, the weights single's, on every rank alike."""
    run, fsdp2 = nodes_runs[0]["across"], nodes_runs[0]["fsdp2"]
    assert run["losses"] == pytest.approx(fsdp2["losses"], rel=1e-2)
    assert run["grad_norms"] == pytest.approx(fsdp2["grad_norms"], rel=2e-2)
    assert min(run["grad_norms"]) > MAX_NORM  # every step clipped
    assert all(r["across"]["losses"] == run["losses"] for r in nodes_runs)
    ref_losses, ref_weights = single_reference(world=WORLD, flavor=FLAVOR, steps=STEPS,
                                               accum=ACCUM, max_norm=MAX_NORM)
    assert_matches_reference([{**run, "variant": "across"}], ref_losses, ref_weights)


def test_state_sharded_across_nodes_without_accumulation_matches_single(nodes_runs):
    run = nodes_runs[0]["across-one"]
    assert all(r["across-one"]["losses"] == run["losses"] for r in nodes_runs)
    ref_losses, ref_weights = single_reference(world=WORLD, flavor=FLAVOR, steps=STEPS,
                                               accum=1, max_norm=MAX_NORM)
    assert_matches_reference([{**run, "variant": "across-one"}], ref_losses, ref_weights)


def test_state_sharded_across_nodes_holds_a_node_share(nodes_runs):
    """Each node's memfd holds the host state's 1/N (its pages that exist, and the state's
    own account), not the whole."""
    for r in nodes_runs:
        total, held = r["across"]["bytes"]
        assert held == pytest.approx(total / NODES, rel=1e-2)
        assert r["across"]["held"] == pytest.approx(total / NODES, rel=1e-2)


def test_state_sharded_across_nodes_resumes(nodes_runs):
    """A new backend that loads the save after step STEPS - 1 takes step STEPS as the first
    one did, bit for bit."""
    for r in nodes_runs:
        run, resumed = r["across"], r["across"]["resumed"]
        assert resumed["losses"] == run["losses"][-1:]
        assert resumed["grad_norms"] == run["grad_norms"][-1:]
        for name, w in run["weights"].items():
            assert torch.equal(w, resumed["weights"][name]), name


def test_replicas_stay_bit_identical_over_twenty_steps(nodes_runs):
    """The checksum compared the replicas after each of 20 steps and found none differ; at the
    end node 1's master and moments are node 0's, bit for bit."""
    node0, node1 = nodes_runs[0]["long"], nodes_runs[2]["long"]
    assert node0["error"] is None and len(node0["losses"]) == 20
    for name, w in node0["weights"].items():
        assert torch.equal(w, node1["weights"][name]), name
    for name, m in node0["state"].items():
        assert torch.equal(m, node1["state"][name]), name


def test_replicas_resume_after_both_nodes_restart(nodes_runs):
    """Node 0 alone writes the replicated state (its local ranks' files); both nodes load them
    and take the last step again bit for bit, the replicas still identical."""
    for r in nodes_runs:
        run, resumed = r["restarted"], r["restarted"]["resumed"]
        assert run["files"] == [f"slidedp-rank{i}-of-{WORLD // NODES}.safetensors"
                                for i in range(WORLD // NODES)]
        assert resumed["losses"] == run["losses"][-1:]
        assert resumed["grad_norms"] == run["grad_norms"][-1:]
        for name, w in run["weights"].items():
            assert torch.equal(w, resumed["weights"][name]), name
    node0, node1 = (nodes_runs[n]["restarted"]["resumed"] for n in (0, 2))
    for name, w in node0["weights"].items():
        assert torch.equal(w, node1["weights"][name]), name


def test_replica_checksum_detects_a_diverged_node(nodes_runs):
    """Node 1's replica nudged after step 1: the check after step 2 ends every rank alike, naming
    node 1; the sharded variant checked every step and found nothing."""
    for r in nodes_runs:
        assert r["diverged"]["error"] is not None and "node(s) 1 differs" in r["diverged"]["error"]
        assert "after step 2" in r["diverged"]["error"]
        assert len(r["diverged"]["losses"]) == 1
        assert r["sharded"]["error"] is None


def test_a_node_with_another_config_is_refused(nodes_runs):
    messages = {r["mismatch"] for r in nodes_runs}
    assert len(messages) == 1  # every rank alike
    (message,) = messages
    assert message is not None and "node 1 runs slidedp.chunk_mib = 1.0 and node 0 runs 32.0" in message


def test_two_launches_train_and_a_killed_node_ends_the_other(tmp_path):
    """run_train.sh twice on this machine (NODE_RANK 0 and 1, one rank each): they train
    together; node 1 killed (its launcher and rank), node 0 ends within bounded time with one
    error line naming the node."""
    port = str(free_port())
    launches = []
    for node in (0, 1):
        env = subprocess_env(NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port, NGPU="1", PYTHON=sys.executable)
        launches.append(subprocess.Popen(
            ["./run_train.sh", "--parallelism.mode=slidedp", "--training.steps=100000",
             f"--job.dump_folder={tmp_path}/out", f"--checkpoint.save_dir={tmp_path}/hf"],
            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    metrics = tmp_path / "out" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text()):
            assert time.monotonic() < deadline and launches[0].poll() is None, "no steps"
            time.sleep(0.2)
        kill_process_tree(launches[1].pid)
        killed = time.monotonic()
        out, _ = launches[0].communicate(timeout=60)
        ended_s = time.monotonic() - killed
        assert ended_s < 30, ended_s
    finally:
        for p in launches:
            kill_process_tree(p.pid)
            p.wait()
    assert launches[0].returncode != 0
    errors = [line for line in out.splitlines() if re.search(r"\berror: ", line)]
    assert len(errors) == 1, out[-3000:]
    assert re.search(r"error: rank 1 \(pid \d+\) of node 1 is gone", errors[0]), errors


def _nodes(node: int, *, nnodes: int = 2, local_world: int = 2) -> Nodes:
    ranks = tuple(tuple(range(n * local_world, (n + 1) * local_world)) for n in range(nnodes))
    return Nodes(node=node, nnodes=nnodes, local_rank=0, local_world=local_world, ranks=ranks)


def test_node_shards_span_whole_pages_and_refuse_what_cannot_run():
    """Node n of 2 holds owners 2n, 2n + 1 of 4: half of every unit, in whole pages; sharded
    mode refuses replicated delivery, the cpu route and GPU-resident state up front."""
    cfg = SlideDPConfig(nodes_state="sharded")
    shards = [node_shards(_nodes(n), cfg) for n in range(NODES)]
    assert [(s.first, s.count, s.world) for s in shards] == [(0, 2, 4), (2, 2, 4)]
    assert node_shards(_nodes(1), SlideDPConfig()).whole  # replicated: the node's own layout
    layout = StateLayout(get_flavor(FLAVOR), world=WORLD, nodes=NODES)
    for unit in layout.units:
        spans = [s.span(unit) for s in shards]
        assert spans == [(0, unit.padded // 2), (unit.padded // 2, unit.padded)]
        assert (unit.host_offset + spans[1][0]) % NODE_ALIGN == 0
    for change, message in (({"delivery": "replicated"}, 'delivery = "sharded"'),
                            ({"reduction": "cpu"}, 'reduction = "gpu"'),
                            ({"embedding_update": "gpu"}, "embedding_update = 'host'")):
        with pytest.raises(ValueError, match=message):
            node_shards(_nodes(0), dataclasses.replace(cfg, **change))
