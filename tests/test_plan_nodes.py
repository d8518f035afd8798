"""The planner over several nodes (slidedp/plan/link.py, steptime's cross-node all-reduce,
`python -m recipes.plan CONFIG --nnodes N --link L`): the shipped links load and bad ones are
refused in one line; each rank's ring all-reduce of its BF16 shard over its NIC costs what the
ring sends at the link's rate; a slow link shows as the step's bound; the printed plan labels
the link's rates as not measured; a host state sharded across the nodes halves each node's host
memory and update, and sends each delivery's and reduction's other half over the link."""

import json

import pytest

from recipes.plan import main
from slidedp.plan.link import LINKS, Link, load_link
from slidedp.plan.steptime import simulate_step
from slidedp.schedule import plan_micro_batch
from tests.conftest import REPO
from tests.test_steptime import rates, spec

CONFIG = f"{REPO}/train_configs/h100x4_qwen3_14b.toml"


def link(**changes) -> Link:
    base = dict(name="test", source="spec", nic_gbits=8.0, nics=1, efficiency=1.0,
                latency_s=0.0)
    return Link(**{**base, **changes})


def test_the_shipped_links_load_and_say_they_are_not_measured():
    shipped = sorted(p.stem for p in LINKS.glob("*.json"))
    assert shipped == ["ib200x8", "ib400x8"]
    for name, gbits in (("ib200x8", 200.0), ("ib400x8", 400.0)):
        got = load_link(name)
        assert (got.nic_gbits, got.nics, got.source) == (gbits, 8, "spec")
        assert "NOT measured" in got.note
    assert load_link(str(LINKS / "ib400x8.json")) == load_link("ib400x8")


def test_a_bad_link_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no link file 'nope' \(shipped: ib200x8, ib400x8\)"):
        load_link("nope")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "source": "spec", "nic_gbits": 0, "nics": 1,
                               "efficiency": 1.0, "latency_s": 0.0}))
    with pytest.raises(ValueError, match="nic_gbits > 0"):
        load_link(str(bad))
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a link file"):
        load_link(str(bad))


def test_a_ring_all_reduce_sends_two_n_minus_one_over_n_of_the_buffer():
    l = link(latency_s=1e-3)
    fixed, sent = l.all_reduce_s(1000.0, 4)
    assert fixed == pytest.approx(6e-3) and sent == pytest.approx(1500.0)
    # Rail-optimised: 8 ranks on 8 NICs one each; 8 ranks on 2 NICs four each.
    assert [link(nics=8).nic_of(r, 8) for r in range(8)] == list(range(8))
    assert [link(nics=2).nic_of(r, 8) for r in range(8)] == [0] * 4 + [1] * 4


def test_the_cross_node_all_reduce_is_charged_at_the_link_rate():
    """One rank per node, no compute, a link of 1 GB/s: the inter-node demand is each unit's BF16
    gradient (2 B/element) times 2 (N-1)/N, over the link's rate; over a link this slow the
    step is bound by it, and is that much longer than one node's."""
    elems, blocks, nodes = 10_000_000, 4, 2
    s = spec(blocks=blocks, block_elems=elems, fwd=0.0, bwd=0.0, head=0.0)
    l = link(nic_gbits=8.0)  # 1 GB/s each way
    one = simulate_step(s, rates())
    two = simulate_step(spec(blocks=blocks, block_elems=elems, fwd=0.0, bwd=0.0, head=0.0,
                             nodes=nodes, link=l), rates())
    units = sum(s.unit_elems)
    expected = 2 * units * 2 * (nodes - 1) / nodes / 1e9
    assert two.demand_s["inter-node link"] == pytest.approx(expected, rel=1e-3)
    assert "inter-node link" not in one.demand_s
    assert two.bound_resource == "inter-node link"
    assert two.step_s - one.step_s == pytest.approx(expected, rel=0.05)
    assert two.exposed_s["inter-node"] > 0.9 * expected


def test_a_state_sharded_across_nodes_is_updated_in_halves_and_gathered_over_the_link():
    """Host-bound blocks (AdamW 0.5 s each on one node's rank), one rank per node, 2 nodes: with
    the host state sharded across them each rank updates half of every unit, and each unit's
    all-gather and reduce-scatter send the other node's half (2 B/element) over the link in
    place of the replicated state's all-reduce of each shard; the step is the shorter."""
    L, elems, a, nodes = 4, 1_000_000, 0.5, 2
    r = rates(adam_gparams={4: elems / a / 1e9})
    l = link(nic_gbits=8.0)  # 1 GB/s each way
    kw = dict(blocks=L, block_elems=elems, fwd=0.0, bwd=0.0, head=0.0, nodes=nodes, link=l)
    replicated = simulate_step(spec(**kw), r)
    sharded = simulate_step(spec(**kw, sharded_nodes=True), r)
    assert replicated.demand_s["cpu update"] == pytest.approx(L * a, rel=1e-3)
    assert sharded.demand_s["cpu update"] == pytest.approx(L * a / nodes, rel=1e-3)
    # Each delivered use's all-gather and each unit's reduce-scatter: (N-1)/N of the BF16 unit.
    s = spec(**kw, sharded_nodes=True)
    uses, _ = plan_micro_batch(L, s.slots, resident={}, embed_head_resident=False,
                               offload=s.offload)
    moved = 2 * (sum(s.unit_elems[u.unit] for u in uses if u.deliver) + sum(s.unit_elems))
    assert sharded.demand_s["inter-node link"] == pytest.approx(
        moved * (nodes - 1) / nodes / 1e9, rel=1e-3)
    assert sharded.step_s < replicated.step_s


def test_a_state_sharded_across_nodes_needs_host_updates_and_sharded_delivery():
    with pytest.raises(ValueError, match="sharded across the nodes"):
        simulate_step(spec(nodes=2, link=link(), sharded_nodes=True, delivery="replicated"),
                      rates())


def test_the_plan_of_a_state_sharded_across_nodes_holds_half_per_node(capsys, tmp_path):
    flags = [CONFIG, "--rates=h200x8", "--ngpu=8", "--parallelism.mode=slidedp",
             f"--job.dump_folder={tmp_path}", "--nnodes=2", "--link=ib400x8"]
    host = {}
    for state in ("replicated", "sharded"):
        assert main([*flags, f"--slidedp.nodes_state={state}"]) == 0
        out = capsys.readouterr().out
        line = next(l for l in out.splitlines() if l.startswith("host memory:"))
        host[state] = float(line.split()[2])
        assert ("host state sharded across them" in out) == (state == "sharded")
    assert host["sharded"] == pytest.approx(host["replicated"] / 2, rel=0.01)


def test_several_nodes_without_a_link_cannot_be_simulated():
    from slidedp.plan.rates import MissingRate
    with pytest.raises(MissingRate, match="inter-node link"):
        simulate_step(spec(nodes=2), rates())


def test_the_plan_over_two_nodes_is_labelled_predicted(capsys, tmp_path):
    flags = [CONFIG, "--rates=h200x8", "--ngpu=8", "--parallelism.mode=slidedp",
             f"--job.dump_folder={tmp_path}"]
    assert main(flags) == 0
    one = capsys.readouterr().out
    assert main([*flags, "--nnodes=2", "--link=ib400x8"]) == 0
    two = capsys.readouterr().out
    assert "x 2 nodes (replicated host state, memory below per node)" in two
    assert "link rates from published line rates, not measured; a predicted step" in two
    assert "inter-node link" in two and "inter-node link" not in one
    # Twice the tokens per step, every node alike.
    tokens = [int(line.split("(")[1].split(" tokens")[0].replace(",", ""))
              for line in (one, two) for line in line.splitlines()
              if line.startswith("predicted step:")]
    assert tokens[1] == 2 * tokens[0]


@pytest.mark.parametrize("extra, message", [
    (["--nnodes=2"], "--nnodes 2 needs the nodes' link: --link NAME"),
    (["--nnodes=2", "--link=nope"], "--link: no link file 'nope'"),
    (["--nnodes=2", "--link=ib400x8", "--parallelism.mode=fsdp2"],
     "the planner models SlideDP over several nodes, not mode 'fsdp2'"),
    (["--nnodes=2", "--link=ib400x8", "--slidedp.reduction=cpu"],
     '--nnodes 2: SlideDP on 2 nodes reduces with slidedp.reduction = "gpu", not \'cpu\''),
])
def test_a_plan_over_nodes_refuses_in_one_line(extra, message, capsys, tmp_path):
    flags = [CONFIG, "--rates=h200x8", "--ngpu=8", "--parallelism.mode=slidedp",
             f"--job.dump_folder={tmp_path}"]
    assert main([*flags, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
