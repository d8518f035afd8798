"""The step-time model (slidedp/plan/steptime.py, simulate.py) against steps computed by hand:
pure compute, a host-bound step, a slot-release stall, an offload-bound step; and its lower
bounds and routes; the attention core at a measured attention rate (slidedp/plan/workload.py);
the embedding's update on the GPU."""

from dataclasses import replace

import pytest

from protocols.model_spec import get_flavor
from slidedp.activations import KEEP, RECOMPUTE
from slidedp.gpu_update import GPU_ADAM_BYTES
from slidedp.plan.rates import BlockTiming, Machine, Rates, load_rates, timing_key
from slidedp.plan.simulate import Simulation
from slidedp.plan.step_spec import StepSpec
from slidedp.plan.host_pass import ADAM_BYTES, BF16_MOMENTS_SAVE
from slidedp.plan.steptime import STEP_EDGE_S, simulate_step
from slidedp.plan.workload import MicroBatchWork, Workload, segment_flops

FAST = 1e9  # GB/s: a link that takes no time


def rates(**changes) -> Rates:
    """Rates under which nothing but what a test slows down takes time."""
    base = dict(machine=Machine(name="test", source="spec", hostname="", device="test", devices=1,
                                cores=4, device_memory_gib=80, host_memory_gib=256),
                h2d_gbs=FAST, d2h_gbs=FAST, h2d_together_gbs=FAST, d2h_together_gbs=FAST,
                copy_latency_s=0.0, all_gather_gbs=FAST, reduce_scatter_gbs=FAST,
                collective_latency_s=0.0, dram_gbs=FAST, adam_gparams={4: FAST},
                grad_sum_gelems={4: FAST}, cast_gbs={4: FAST}, gpu_tflops={"torch": 1.0})
    return Rates(**{**base, **changes})


def spec(*, blocks=4, fwd=0.1, bwd=0.2, head=0.05, block_elems=1280, world=1, slots=3,
         offload=0.0, offload_bytes=0, **changes) -> StepSpec:
    base = dict(world=world, slots=slots, delivery="sharded", reduction="gpu", chunk_elems=1 << 20,
                bf16_shadow=True, micro_batches=1, deferred=False, grad_accum=False, threads=4,
                cores=4, unit_elems=(128 * world, *[block_elems] * blocks, 128 * world),
                work=MicroBatchWork(0.0, 0.0, head, (fwd,) * blocks, (bwd,) * blocks),
                offload=(offload,) * blocks, offload_bytes=(offload_bytes,) * blocks, tokens=1000)
    return StepSpec(**{**base, **changes})


def test_pure_compute_is_the_sum_of_the_gpu_work():
    s = spec()
    p = simulate_step(s, rates())
    assert p.step_s == pytest.approx(s.work.total + STEP_EDGE_S, rel=1e-6)
    assert p.regime == "gpu-bound" and p.bound_resource == "gpu compute"
    assert p.demand_s["gpu compute"] == pytest.approx(s.work.total)
    assert sum(p.exposed_s.values()) == pytest.approx(STEP_EDGE_S, abs=1e-6)


def test_launches_longer_than_the_kernels_set_the_step():
    """Each use's launches (Rates.issue_s) run one after another on the compute thread and its
    GPU work follows them. Shorter than the kernels, they hide behind them but the first;
    longer (few sequences), the GPU waits and the step is their sum and the last use's work."""
    L, fwd, bwd, head = 4, 0.1, 0.2, 0.05

    def launched(issue_f, issue_b, issue_head):
        work = MicroBatchWork(0.0, 0.0, head, (fwd,) * L, (bwd,) * L, head_issue=issue_head,
                              block_issue=((issue_f, issue_b),) * L)
        return simulate_step(spec(blocks=L, work=work), rates())

    hidden = launched(0.01, 0.02, 0.01)
    assert hidden.step_s == pytest.approx(0.01 + L * (fwd + bwd) + head + STEP_EDGE_S, rel=1e-6)
    assert hidden.regime == "gpu-bound"
    bound = launched(0.3, 0.5, 0.01)
    assert bound.step_s == pytest.approx(L * (0.3 + 0.5) + 0.01 + bwd + STEP_EDGE_S, rel=1e-6)
    assert bound.regime == "host-bound" and bound.bound_resource == "host launch"
    assert bound.demand_s["host launch"] == pytest.approx(L * 0.8 + 0.01)
    assert "launch" in bound.why and "more sequences per step" in bound.advice


def test_a_head_that_waits_for_the_device_drains_the_queue():
    """A head whose issue waits for the GPU (Liger's loss reads a count with `.item()`) is
    issued once the forwards have run, and backward's first launch follows its run: that
    launch is no longer hidden behind queued work."""
    L, fwd, bwd, head, issue_f, issue_b = 4, 0.1, 0.2, 0.05, 0.01, 0.02

    def step(syncs):
        work = MicroBatchWork(0.0, 0.0, head, (fwd,) * L, (bwd,) * L, head_issue=head,
                              head_syncs=syncs, block_issue=((issue_f, issue_b),) * L)
        return simulate_step(spec(blocks=L, work=work), rates()).step_s

    assert step(False) == pytest.approx(issue_f + L * (fwd + bwd) + head + STEP_EDGE_S, rel=1e-6)
    assert step(True) == pytest.approx(issue_f + L * (fwd + bwd) + head + issue_b + STEP_EDGE_S,
                                       rel=1e-6)


def test_the_probe_s_issue_times_reach_the_step_by_kernels_and_policy():
    """Workload looks the issue times up by kernels and policy; a use not measured counts 0."""
    args = get_flavor("qwen3-debug")
    r = rates(issue_s={"torch/keep/forward": 0.003, "torch/keep/backward": 0.005,
                       "torch/head": 0.002, "liger/keep/forward": 9.0})
    work = Workload(r, args, flavor="qwen3-debug", kernels="torch", seq=64).micro_batch(
        [KEEP, RECOMPUTE], 1)
    assert work.block_issue == ((0.003, 0.005), (0.0, 0.0))
    assert work.head_issue == 0.002 and work.embed_issue == (0.0, 0.0)
    assert not work.head_syncs  # no head timing to compare the issue with


def test_a_head_issued_in_about_its_run_is_taken_to_wait_for_the_device():
    args = get_flavor("qwen3-debug")
    timed = {"head@64": BlockTiming(forward_s=0.005, backward_s=0.0, batch=2)}  # 10 ms a run

    def syncs(issue):
        r = rates(issue_s={"torch/head": issue}, blocks=timed)
        return Workload(r, args, flavor="qwen3-debug", kernels="torch", seq=64).micro_batch(
            [KEEP], 1).head_syncs

    assert syncs(0.0098) and not syncs(0.004)


def test_host_bound_step_waits_for_the_serial_updates():
    """Each block's AdamW (A) takes longer than its backward (b): the update thread runs them
    one after another from the last block's gradient on, so the step is forward + head + b +
    L * A (the embedding's and head's updates are tiny)."""
    L, elems, fwd, bwd, head = 4, 1_000_000, 0.1, 0.2, 0.05
    a = 0.5  # seconds of AdamW per block
    r = rates(adam_gparams={4: elems / a / 1e9})
    p = simulate_step(spec(blocks=L, block_elems=elems, fwd=fwd, bwd=bwd, head=head), r)
    assert p.step_s == pytest.approx(L * fwd + head + bwd + L * a + STEP_EDGE_S, rel=1e-4)
    assert p.regime == "host-bound" and p.bound_resource == "cpu update"
    assert p.demand_s["cpu update"] == pytest.approx(L * a, rel=1e-3)
    assert "cpu update" in p.why and "more sequences per step" in p.advice
    assert p.exposed_s["cpu update"] == pytest.approx(L * a - (L - 1) * bwd, rel=1e-3)


def test_bf16_moments_shorten_the_host_bound_update_by_their_bytes():
    """The host-bound step above with BF16 moments: each AdamW pass moves 20 B/param instead
    of 28, so its time and bytes fall by 8/28."""
    L, elems = 4, 1_000_000
    a = 0.5
    r = rates(adam_gparams={4: elems / a / 1e9})
    fp32 = simulate_step(spec(blocks=L, block_elems=elems), r)
    bf16 = simulate_step(spec(blocks=L, block_elems=elems, moments="bfloat16"), r)
    share = (ADAM_BYTES["bf16"] - BF16_MOMENTS_SAVE) / ADAM_BYTES["bf16"]
    assert share == pytest.approx(20 / 28)
    assert bf16.demand_s["cpu update"] == pytest.approx(share * fp32.demand_s["cpu update"],
                                                        rel=1e-3)
    assert bf16.step_s < fp32.step_s - (1 - share) * L * a * 0.9


def test_speculative_updates_overlap_backward_at_the_cost_of_their_copy():
    """A short forward (0.01 s a block) cannot hide deferred updates of A = 0.1 s a block (the held
    gradient read as 30 B a parameter): they run after the norm, one after
    another. Standing speculative ones run while backward (0.2 s a block) does, each longer by
    its copy aside (24 B a parameter more); redone ones are the deferred ones with the restore.
    The break-even share of clipping steps makes the average the deferred step."""
    from slidedp.plan.predict import Speculation

    L, elems, a = 4, 1_000_000, 0.1
    r = rates(adam_gparams={4: elems / a / 1e9})
    base = dict(blocks=L, block_elems=elems, deferred=True, fwd=0.01)
    deferred = simulate_step(spec(**base), r)
    stands = simulate_step(spec(**base, speculative="stands"), r)
    redone = simulate_step(spec(**base, speculative="redone"), r)
    assert deferred.demand_s["cpu update"] == pytest.approx(L * a * 30 / 28, rel=1e-3)
    assert stands.demand_s["cpu update"] == pytest.approx(L * a * (28 + 24) / 28, rel=1e-3)
    assert redone.demand_s["cpu update"] == pytest.approx(L * a * (30 + 24) / 28, rel=1e-3)
    assert stands.step_s < deferred.step_s < redone.step_s
    share = Speculation(redone=redone, deferred=deferred).break_even(stands)
    assert 0 < share < 1
    assert (1 - share) * stands.step_s + share * redone.step_s == pytest.approx(deferred.step_s)


def test_slot_release_stall_in_backward():
    """Two slots: backward re-delivers every block but the last two, each into the slot of a
    block whose backward must finish first. With a copy d = 2 b, each block after the first two
    takes d in backward: forward d + L f (f = d), head h, backward 2 b (L - 1)."""
    L, elems, bwd, head = 4, 1_000_000, 0.1, 0.05
    d = 2 * bwd
    r = rates(h2d_gbs=2 * elems / d / 1e9)
    p = simulate_step(spec(blocks=L, block_elems=elems, fwd=d, bwd=bwd, head=head, slots=2), r)
    assert p.step_s == pytest.approx(d + L * d + head + 2 * bwd * (L - 1) + STEP_EDGE_S, rel=1e-4)
    # With a slot per block nothing is delivered twice: backward is L b.
    roomy = simulate_step(spec(blocks=L, block_elems=elems, fwd=d, bwd=bwd, head=head, slots=L), r)
    assert roomy.step_s == pytest.approx(d + L * d + head + L * bwd + STEP_EDGE_S, rel=1e-4)
    assert p.exposed_s["h2d"] == pytest.approx(p.step_s - roomy.step_s + d, rel=1e-3)


def test_offload_bound_step():
    """Each block offloads o = 0.3 s of activations after its forward (f = 0.1 s) and brings
    them back (p = 0.3 s) one block ahead of its backward (b = 0.2 s), all on one offload stream:
    the copies set the pace, step = f + L o + L p + b."""
    L, f, o, b = 3, 0.1, 0.3, 0.2
    nbytes = 10**9
    r = rates(h2d_gbs=nbytes / o / 1e9, d2h_gbs=nbytes / o / 1e9)
    p = simulate_step(spec(blocks=L, fwd=f, bwd=b, head=0.05, slots=L, offload=0.5,
                           offload_bytes=nbytes), r)
    assert p.step_s == pytest.approx(f + L * o + L * o + b + STEP_EDGE_S, rel=1e-4)
    assert p.regime == "host-bound"
    assert p.exposed_s["h2d"] + p.exposed_s["d2h"] == pytest.approx(p.step_s - L * (f + b) - 0.05
                                                                     - STEP_EDGE_S, rel=1e-3)


@pytest.mark.parametrize("route", ["sharded/gpu", "replicated/gpu", "sharded/cpu", "replicated/cpu"])
def test_every_route_on_three_ranks_is_at_least_its_lower_bound(route):
    delivery, reduction = route.split("/")
    r = rates(h2d_gbs=20, d2h_gbs=20, h2d_together_gbs=15, d2h_together_gbs=15, copy_latency_s=1e-5,
              all_gather_gbs=100, reduce_scatter_gbs=100, collective_latency_s=1e-5, dram_gbs=50,
              adam_gparams={1: 0.5, 4: 1.5}, grad_sum_gelems={1: 1.0, 4: 3.0})
    s = spec(world=3, blocks=6, block_elems=3 * 40_000_000, delivery=delivery, reduction=reduction,
             chunk_elems=8_000_000, threads=1, cores=3)
    p = simulate_step(s, r)
    assert p.step_s >= p.bound_s - 1e-9
    assert p.step_s > s.work.total  # copies and updates are never free here


def test_replicated_delivery_moves_r_times_the_bytes_over_pcie():
    r = rates(h2d_gbs=20, h2d_together_gbs=20)
    kw = dict(world=2, blocks=4, block_elems=2 * 50_000_000)
    sharded = simulate_step(spec(delivery="sharded", **kw), r)
    replicated = simulate_step(spec(delivery="replicated", **kw), r)
    assert replicated.demand_s["h2d per GPU"] == pytest.approx(2 * sharded.demand_s["h2d per GPU"])


def test_shared_capacity_slows_every_task_alike():
    """Weighted max-min fairness: tasks sharing a full capacity run at the same fraction of
    their speed alone; one that ends frees its share."""
    sim = Simulation({"link": 10.0, "cpu": 1.0})
    x = sim.add("l1", work={"link": 10.0}, kind="copy", step=0)  # 1 s alone
    y = sim.add("l2", work={"link": 20.0}, kind="copy", step=0)  # 2 s alone
    z = sim.add("l3", work={"cpu": 1.0}, kind="adam", step=0)  # nothing shared: 1 s
    after = sim.add("l1", work={"link": 10.0}, deps=[z], kind="copy", step=0)
    sim.run()
    assert sim.tasks[z].end == pytest.approx(1.0)
    # x and y at half speed: x ends at 2 s (10 of y's 20 done); then y and `after` share.
    assert sim.tasks[x].end == pytest.approx(2.0)
    assert sim.tasks[after].start == pytest.approx(2.0)
    assert sim.tasks[y].end == pytest.approx(4.0) and sim.tasks[after].end == pytest.approx(4.0)


def test_a_measured_attention_rate_times_the_attention_core_apart():
    """At a length with a measured attention rate the attention core runs at it, its backward
    2.5 times its forward, and a policy that replays it pays one forward more; elsewhere (and
    for the rest of the block) the matmul rate holds."""
    args, seq, batch = get_flavor("qwen3-8B"), 65536, 1
    base = load_rates("h200")
    rate = base.tflops("qwen3-8B", "liger") / 2  # attention at half the matmul rate
    timed = replace(base, attention_tflops={timing_key("qwen3-8B", seq): rate})
    plain, split = (Workload(r, args, flavor="qwen3-8B", kernels="liger", seq=seq)
                    for r in (base, timed))
    attention_s = segment_flops(args, seq)["attention_core"] * batch * seq / (rate * 1e12)
    at_matmul_rate = attention_s / 2
    for policy, replays in ((KEEP, 0), (RECOMPUTE, 1)):
        (f0, b0), (f1, b1) = plain.block(policy, batch), split.block(policy, batch)
        assert f1 - f0 == pytest.approx(attention_s - at_matmul_rate)
        assert b1 - b0 == pytest.approx((2.5 + replays) * attention_s
                                        - (2 + replays) * at_matmul_rate)
    other = Workload(timed, args, flavor="qwen3-8B", kernels="liger", seq=4096)
    assert other.block(RECOMPUTE, batch) == Workload(base, args, flavor="qwen3-8B",
                                                     kernels="liger", seq=4096).block(RECOMPUTE, batch)


EMBED = 10_000_000  # a tied embedding (it carries the head's gradient) much larger than a block


def embedding_cases(**changes):
    """A small model whose embedding's host AdamW (0.5 s, BF16 gradient) is the step's tail, with
    the embedding's update on the host and on the GPU; a slot per block (nothing re-delivered in
    backward) and one chunk per unit."""
    r = rates(adam_gparams={4: EMBED / 0.5 / 1e9}, h2d_gbs=20, d2h_gbs=20, h2d_together_gbs=20,
              d2h_together_gbs=20, hbm_gbs=4000)
    s = spec(blocks=4, slots=4, block_elems=100_000, unit_elems=(EMBED, *[100_000] * 4, 128),
             chunk_elems=1 << 24, **changes)
    return r, s, simulate_step(s, r), simulate_step(replace(s, embedding_on_gpu=True), r)


def test_the_embeddings_update_on_the_gpu_removes_the_host_tail():
    """The host's 0.5 s of AdamW after the embedding's gradient becomes the GPU's
    (GPU_ADAM_BYTES per parameter at 4 TB/s); its gradient's 2 B/param home become the BF16 shadow's, so the step is shorter by
    the difference. The CPU loses the embedding's AdamW; the links carry its state: 12 B/param
    to the GPU, 2 + 12 home instead of the gradient's 2."""
    r, s, host, gpu = embedding_cases()
    adam_s, gpu_adam_s = 0.5, EMBED * GPU_ADAM_BYTES["float32"] / 4000e9
    assert host.step_s - gpu.step_s == pytest.approx(adam_s - gpu_adam_s, rel=1e-4)
    assert host.regime == "host-bound" and gpu.regime == "gpu-bound"
    assert host.demand_s["cpu update"] - gpu.demand_s["cpu update"] == pytest.approx(adam_s)
    assert gpu.demand_s["gpu compute"] - host.demand_s["gpu compute"] == pytest.approx(gpu_adam_s)
    moved = 12 * EMBED / 20e9
    for link in ("h2d per GPU", "d2h per GPU"):
        assert gpu.demand_s[link] - host.demand_s[link] == pytest.approx(moved)
        assert gpu.busy_s[link] - host.busy_s[link] == pytest.approx(moved, rel=1e-3)


def test_the_embeddings_deferred_update_on_the_gpu_comes_first_after_the_norm():
    """With clipping every update waits for the step's norm; the next forward waits for the
    embedding's, the first (forward order). Host: its gradient home (2 B/param) and summed into
    the FP32 buffer as backward ends, its AdamW with that FP32 gradient after the norm; GPU: after
    the norm its AdamW there and the shadow home (2 B/param), which the blocks' host updates
    follow. The step is shorter by the host's sum and AdamW less the GPU's."""
    r, s, host, gpu = embedding_cases(deferred=True, grad_accum=True)
    adam_s = 0.5 * ADAM_BYTES["fp32"] / ADAM_BYTES["bf16"]
    sum_s = EMBED / r.grad_sum(s.threads)
    gpu_adam_s = EMBED * GPU_ADAM_BYTES["float32"] / 4000e9
    assert host.step_s - gpu.step_s == pytest.approx(adam_s + sum_s - gpu_adam_s, rel=1e-4)
    assert host.regime == "host-bound" and gpu.regime == "gpu-bound"
    assert host.demand_s["cpu update"] - gpu.demand_s["cpu update"] == pytest.approx(adam_s + sum_s)
    assert gpu.demand_s["h2d per GPU"] - host.demand_s["h2d per GPU"] == pytest.approx(
        12 * EMBED / 20e9)
    assert gpu.demand_s["d2h per GPU"] - host.demand_s["d2h per GPU"] == pytest.approx(
        14 * EMBED / 20e9 - 2 * EMBED / 20e9)


def test_gpu_updates_fill_a_launch_bound_step_unless_the_loop_waits_for_the_device():
    """Every unit resident, clipped: the updates run on their own stream after backward, and
    the next step's launches do not wait for them (the gate opens once an update is issued; the
    unit's next use waits for its kernel on the GPU). Where the launches bound the step, the
    updates run while the GPU waits for them: the step is the launches and the last backward.
    A loop that waits for the whole device after each step (StepSpec.device_sync, the bench's
    `sync = "step"`) adds them; where the GPU bounds the step, they take their share of it
    either way."""
    L, fwd, bwd, head, update = 4, 0.1, 0.2, 0.05, 0.05
    elems = int(update * 4000e9 / GPU_ADAM_BYTES["float32"])
    launches = ((0.3, 0.5),) * L
    work = MicroBatchWork(0.0, 0.0, head, (fwd,) * L, (bwd,) * L, head_issue=0.01,
                          block_issue=launches)
    s = spec(blocks=L, block_elems=elems, work=work, deferred=True, grad_accum=True,
             resident_units=frozenset(range(L + 2)))
    r = rates(hbm_gbs=4000)
    overlapped, synced = simulate_step(s, r), simulate_step(replace(s, device_sync=True), r)
    assert overlapped.step_s == pytest.approx(L * 0.8 + 0.01 + bwd + STEP_EDGE_S, rel=1e-6)
    assert synced.step_s == pytest.approx(overlapped.step_s + L * update, abs=STEP_EDGE_S)
    gpu_bound = replace(s, work=replace(work, block_issue=()))
    assert simulate_step(gpu_bound, r).step_s == pytest.approx(
        simulate_step(replace(gpu_bound, device_sync=True), r).step_s, rel=1e-6)


def test_updates_on_the_gpu_need_the_gpu_route_and_one_micro_batch():
    for change in (dict(reduction="cpu"), dict(micro_batches=2)):
        for where in (dict(embedding_on_gpu=True), dict(resident_units=frozenset({0, 1}))):
            with pytest.raises(ValueError, match="updates on the GPU need"):
                simulate_step(spec(**where, **change), rates())


def test_resident_state_takes_the_updates_and_the_deliveries_off_the_host():
    """Every unit but the head resident on the GPU, with clipping: the host updates nothing but
    the head, and no gradient goes home; on one rank the resident units are computed from where
    they are (no copy), so the links carry only the head's; the step comes down to the GPU's
    work, plus the updates' (GPU_ADAM_BYTES per parameter of the GPU's memory)."""
    r, s, host, _ = embedding_cases(deferred=True, grad_accum=True)
    resident = simulate_step(replace(s, resident_units=frozenset(range(5))), r)
    assert resident.step_s < host.step_s and resident.regime == "gpu-bound"
    head = s.unit_elems[-1]
    assert resident.demand_s["cpu update"] == pytest.approx(
        head / r.adam(s.threads) * ADAM_BYTES["fp32"] / ADAM_BYTES["bf16"]
        + head / r.grad_sum(s.threads), rel=1e-6)
    assert resident.demand_s["h2d per GPU"] == pytest.approx(2 * head / 20e9)
    assert resident.demand_s["d2h per GPU"] == pytest.approx(2 * head / 20e9)
    gpu_extra = sum(e * GPU_ADAM_BYTES["float32"] for e in s.unit_elems[:5]) / 4000e9
    assert resident.demand_s["gpu compute"] - host.demand_s["gpu compute"] == pytest.approx(
        gpu_extra, rel=1e-6)
    # BF16 moments stay BF16 on the GPU: 20 B/param of its memory per update, not 28.
    bf16 = simulate_step(replace(s, resident_units=frozenset(range(5)), moments="bfloat16"), r)
    assert bf16.demand_s["gpu compute"] - host.demand_s["gpu compute"] == pytest.approx(
        gpu_extra * GPU_ADAM_BYTES["bfloat16"] / GPU_ADAM_BYTES["float32"], rel=1e-6)


def test_every_unit_resident_queues_the_updates_behind_backward():
    """With the head resident too, the norm is taken on the GPU (engine: _norm_on_device): the
    updates follow backward there instead of the host's step end, and the host moves nothing.
    The model counts no host time for issuing a GPU update, so on this GPU-bound step the edge
    it saves is mostly hidden."""
    r, s, _, _ = embedding_cases(deferred=True, grad_accum=True)
    but_head = simulate_step(replace(s, resident_units=frozenset(range(5))), r)
    every = simulate_step(replace(s, resident_units=frozenset(range(6))), r)
    assert every.demand_s["cpu update"] == 0
    assert every.demand_s["h2d per GPU"] == every.demand_s["d2h per GPU"] == 0
    assert every.step_s <= but_head.step_s * (1 + 1e-9)
