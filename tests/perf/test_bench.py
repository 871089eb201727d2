"""The benchmark: emulated-cluster plumbing (fast) and the quick mode end to end (slow).

The slow test runs ``python -m embrace_fairseq.perf.bench --quick`` for real (namespaces when
this machine allows them) and checks that the JSON is complete and self-consistent:
every strategy measured for every model and rank count, bytes that agree with what the
NICs sent, identical losses across strategies (same synchronous SGD), EmbRace sending
less than the dense all-reduce on the large-vocabulary LM. It does not check speed.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embrace_fairseq.perf.bench import netem_cluster as NC
from embrace_fairseq.perf.bench.stats import ratio_of
from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, STRATEGIES, get_strategy

REPO = Path(__file__).resolve().parents[2]
NS_REASON = NC.namespaces_available()
needs_ns = pytest.mark.skipif(NS_REASON is not None, reason=f"no network namespaces here: {NS_REASON}")


def test_tags_fit_interface_names():
    tags = {NC.new_tag() for _ in range(50)}
    assert len(tags) > 45  # random per run
    for t in tags:
        assert t.startswith(NC.PREFIX)
        # longest interface name: <tag>r<rank>a with rank < 250, and the bridge <tag>br
        assert len(f"{t}r249a") <= 15
    assert NC.tbf_burst_bytes(1.0) >= 64 * 1024
    assert NC.tbf_burst_bytes(10.0) == int(10e9 / 8 / 1000)


@needs_ns
def test_cluster_is_created_shaped_and_removed():
    link = NC.LinkSpec(1.0, 0.1)
    with NC.Cluster.create(2, link) as c:
        names = NC.list_namespaces(c.tag)
        assert sorted(names) == sorted([f"{c.tag}r0", f"{c.tag}r1", f"{c.tag}s"])
        qd = subprocess.run(["tc", "-n", c.ranks[0].netns, "qdisc", "show", "dev", c.ranks[0].ifname],
                            capture_output=True, text=True).stdout
        assert "tbf" in qd and "rate 1Gbit" in qd
        c.set_link(NC.LinkSpec(10.0, 0.1))
        qd = subprocess.run(["tc", "-n", c.tag + "s", "qdisc", "show", "dev", f"{c.tag}r1b"],
                            capture_output=True, text=True).stdout
        assert "rate 10Gbit" in qd
        # the two ranks reach each other over the bridge, not over the host
        probe = subprocess.run(c.ranks[1].command_prefix() + [
            sys.executable, "-c",
            f"import socket; s=socket.create_connection(('{c.ranks[0].addr}', 9), timeout=2)"],
            capture_output=True, text=True)
        assert "Connection refused" in probe.stderr  # reached rank 0's stack, nothing listens
    assert NC.list_namespaces(c.tag) == []


def test_placements_without_a_node_are_one_rank_per_node():
    # a worker rebuilds placements from its spec's dicts, which may predate the node field
    p = NC.RankPlacement(**{"rank": 3, "netns": "ebbx", "ifname": "ebbxr3a", "addr": "10.77.0.4"})
    assert p.node == 3
    c = NC.Cluster.create(6, NC.LinkSpec(1.0, 0.1), loopback=True, ranks_per_node=3)
    assert [p.node for p in c.ranks] == [0, 0, 0, 1, 1, 1] and c.nodes == 2
    assert c.describe()["nodes"] == 2 and c.describe()["ranks_per_node"] == 3
    for bad in (0, 4):
        with pytest.raises(ValueError, match="ranks_per_node"):
            NC.Cluster.create(6, NC.LinkSpec(1.0, 0.1), loopback=True, ranks_per_node=bad)


def _tx_bytes(place):
    return int(subprocess.run(place.command_prefix() + ["cat", place.tx_bytes_path()], capture_output=True,
                              text=True, check=True).stdout)


@needs_ns
def test_nodes_share_a_namespace_and_only_the_node_link_is_shaped():
    """2 nodes x 2 ranks: one namespace, veth and address per node; the node's link shaped;
    ranks of a node talk over its loopback (nothing on the veth), across nodes over the veth."""
    with NC.Cluster.create(4, NC.LinkSpec(1.0, 0.1), ranks_per_node=2) as c:
        assert sorted(NC.list_namespaces(c.tag)) == sorted([f"{c.tag}n0", f"{c.tag}n1", f"{c.tag}s"])
        r = c.ranks
        assert [p.node for p in r] == [0, 0, 1, 1]
        assert (r[0].netns, r[0].ifname, r[0].addr) == (r[1].netns, r[1].ifname, r[1].addr) == (
            f"{c.tag}n0", f"{c.tag}n0a", f"{NC.SUBNET}.1")
        assert (r[2].netns, r[2].addr) == (r[3].netns, r[3].addr) == (f"{c.tag}n1", f"{NC.SUBNET}.2")
        assert [p.rank for p in c.node_ranks(1)] == [2, 3]
        d = c.describe()
        assert d["nodes"] == 2 and d["ranks_per_node"] == 2 and [x["node"] for x in d["ranks"]] == [0, 0, 1, 1]
        assert "per node link" in d["shaping"]
        for ns, dev in ((f"{c.tag}n1", f"{c.tag}n1a"), (c.switch_ns, f"{c.tag}n0b")):
            qd = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "tbf" in qd and "rate 1Gbit" in qd, (ns, dev, qd)
        lo = subprocess.run(["tc", "-n", f"{c.tag}n0", "qdisc", "show", "dev", "lo"], capture_output=True,
                            text=True).stdout
        assert "tbf" not in lo and "netem" not in lo
        # a listener at node 0's address; 2 MB from node 0 itself, then from node 1
        server = subprocess.Popen(r[0].command_prefix() + [sys.executable, "-c", (
            "import socket\n"
            f"s = socket.create_server(('{r[0].addr}', 9100))\n"
            "for _ in range(2):\n"
            "    c, _ = s.accept()\n"
            "    while c.recv(1 << 20): pass\n"
            "    c.close()\n")])
        send = (f"import socket, time\n"
                f"for _ in range(100):\n"
                f"    try: s = socket.create_connection(('{r[0].addr}', 9100)); break\n"
                f"    except OSError: time.sleep(0.1)\n"
                f"s.sendall(b'x' * 2_000_000)\n"
                # sendall returns once the kernel holds the bytes, not once they left the shaped
                # link: wait for the listener's close, which follows its reading all of them
                f"s.shutdown(socket.SHUT_WR); s.recv(1); s.close()")
        try:
            before = _tx_bytes(r[1])
            subprocess.run(r[1].command_prefix() + [sys.executable, "-c", send], check=True, timeout=60)
            assert _tx_bytes(r[1]) - before < 10_000  # the same node: not over the node's link
            before = _tx_bytes(r[2])
            subprocess.run(r[2].command_prefix() + [sys.executable, "-c", send], check=True, timeout=60)
            assert _tx_bytes(r[2]) - before >= 2_000_000  # another node: over the shaped link
            server.wait(timeout=60)
        finally:
            server.kill()
    assert NC.list_namespaces(c.tag) == []


@needs_ns
def test_cleanup_command_removes_leftovers():
    tag = NC.new_tag()
    subprocess.run(["ip", "netns", "add", f"{tag}r0"], check=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "embrace_fairseq.perf.bench", "--cleanup"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{tag}r0" in out.stdout
    assert NC.list_namespaces(tag) == []


def _quick(out: Path, *extra: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "embrace_fairseq.perf.bench", "--quick", "--out", str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "quick"
    proc = _quick(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((out / "bench.json").read_text())
    meta = res["meta"]
    assert meta["fallback_loopback"] is (NS_REASON is not None)
    if meta["fallback_loopback"]:
        assert "FALLBACK" in proc.stdout
    for model in ("lm", "translation"):
        p = res["profiles"][model]
        assert p["vocab"] >= (64000 if model == "lm" else 8000)
        assert p["dense_numel"] == sum(l["numel"] for l in p["dense_layers"])
        assert all(v > 0 for v in p["compute_s"].values())
        assert set(p["unique_ids_per_rank"]) == {"2", "4"}
        assert all(len(v) == int(w) for w, v in p["unique_ids_per_rank"].items())
    runs = res["runs"]
    assert {(r["model"], r["world_size"], r["strategy"]) for r in runs} == {
        (m, w, s) for m in ("lm", "translation") for w in (2, 4) for s in STRATEGIES}
    for r in runs:
        assert len(r["step_s"]) == 8 and r["median_step_s"] > 0 and r["tokens_per_s"] > 0
        total = sum(r["bytes_per_rank_per_step"].values())
        floor = r["strategy"] == "compute_floor"  # no collective: no bytes, its own model per rank
        assert (total == 0) if floor else (total > 0)
        if not meta["fallback_loopback"]:
            # the NIC sent what the collectives carried, plus headers and barriers (DeepSpeed
            # ZeRO-1 on 2 ranks was seen sending up to 0.9 % less than its counted
            # collectives: not explained yet, hence the 2 % below)
            assert 0.98 * total <= r["wire_bytes_per_rank_per_step"] <= 1.15 * total + 200e3, r
        if get_strategy(r["strategy"]).shards_table:
            assert {"ids", "rows", "grad_rows", "dense_allreduce"} <= set(r["bytes_per_rank_per_step"])
        if not floor:  # every strategy's overlap, from the same trace
            assert 0.0 <= r["hidden_share"] <= 1.0 and r["settings"] is not None
        key = f"{r['model']}/w{r['world_size']}/{r['link_gbit']:g}gbit_{r['latency_ms']:g}ms"
        if r["strategy"] != SPEEDUP_SUBJECT:
            subject = next(x for x in runs if x["strategy"] == SPEEDUP_SUBJECT and x["model"] == r["model"]
                           and x["world_size"] == r["world_size"])
            # the ratio of the statistic the results file names (of the paired timed steps)
            assert math.isclose(res["ratios"][key][r["strategy"]],
                                ratio_of(r["step_s"], subject["step_s"], meta["ratio_statistic"]), rel_tol=1e-9)
        # same synchronous SGD on the same batches: the losses agree
        if not floor:
            assert res["loss_max_rel_diff_vs_legacy_ddp"][key][r["strategy"]] < 1e-3
    lm4 = {r["strategy"]: r for r in runs if r["model"] == "lm" and r["world_size"] == 4}
    assert lm4["embrace_schedule"]["bytes_total_per_rank_per_step"] < 0.5 * lm4["deepspeed"]["bytes_total_per_rank_per_step"]
    assert "sparse_allgather" in lm4["sparse_allgather"]["bytes_per_rank_per_step"]
    assert set(res["goal"]) == {"lm", "translation"}
    report = (out / "report.md").read_text()
    assert "## Goal" in report and "lm/w4/1gbit" in report
    # every run key has FIFO overlap and the floor with CPU times: each is set against its cores
    assert set(res["attainable"]) == set(res["ratios"]) and len(res["attainable"]) == 4
    assert all(len(r["cpu_s"]) == 8 for r in runs)
    assert "## What the cores allow" in report
    for png in ("throughput_vs_ranks.png", "bytes_by_kind.png", "timeline_excerpt.png"):
        assert (out / png).stat().st_size > 1000
    assert NC.list_namespaces() == [] or all(not n.startswith(NC.PREFIX) for n in NC.list_namespaces())


@pytest.mark.slow
def test_baselines_record_their_scaled_buckets_and_overlap(tmp_path):
    """Two ranks of the translation workload, the stock baselines and EmbRace, one round: the
    run records each strategy's buckets (its experts' setting times the workload's scale),
    the collectives they made, each baseline's hidden share, the warm-up and the interval method."""
    from embrace_fairseq.perf.bench.shapes import EXPERT_BUCKETS

    out = tmp_path / "baselines"
    strategies = ("fairseq_c10d", "deepspeed_zero2", "sparse_allgather", "sparse_allgather_overlap", "embrace_schedule")
    proc = _quick(out, "--loopback", "--models", "translation", "--worlds", "2", "--rounds", "1",
                  "--steps-per-round", "2", "--warmup", "1", "--max-warmup", "3", "--strategies", ",".join(strategies))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((out / "bench.json").read_text())
    assert "t interval" in res["meta"]["interval_method"] and res["meta"]["schedule"]["citable"] is False
    runs = {r["strategy"]: r for r in res["runs"]}
    assert set(runs) == set(strategies)
    shape = res["workload_shapes"]["translation"]
    assert shape["vocab"] == shape["real_vocab"] == 32768 and abs(shape["share_gap_points"]) < 5
    scale = runs["fairseq_c10d"]["settings"]["bucket_scale"]
    assert scale == pytest.approx(4 * shape["parameters"] / (2 * shape["real_parameters"]))
    for name in ("fairseq_c10d", "sparse_allgather_overlap"):
        st = runs[name]["settings"]
        assert st["bucket_cap_mb"] == pytest.approx(scale * EXPERT_BUCKETS["ddp_bucket_bytes"] / 2**20)
        assert st["first_bucket_cap_mb"] == pytest.approx(scale * EXPERT_BUCKETS["ddp_first_bucket_bytes"] / 2**20)
        assert runs[name]["collectives_per_step_by_op"]["all_reduce"] >= 2  # buckets, not one after the backward
    zero = runs["deepspeed_zero2"]["settings"]["zero_optimization"]
    assert zero["use_multi_rank_bucket_allreduce"] is False and zero["overlap_comm"] is True
    assert zero["reduce_bucket_size"] == int(EXPERT_BUCKETS["zero_reduce_bucket_numel"] * 2 * scale / 4)
    assert runs["deepspeed_zero2"]["collectives_per_step_by_op"]["reduce"] >= 1  # to the owner, not all-reduced
    embrace = runs["embrace_schedule"]["settings"]["embrace"]
    assert embrace["piece_bytes"] == int(scale * EXPERT_BUCKETS["embrace_piece_bytes"])
    for name, r in runs.items():
        assert 0.0 <= r["hidden_share"] <= 1.0, name
        assert 1 <= len(r["warmup_step_s"]) <= 3 and len(r["step_s"]) == 2
    report = (out / "report.md").read_text()
    assert "## Buckets scaled with the model" in report and "sparse all-gather overlapped" in report
    # the profile timed the output stretch (the dependency-aware limit's input): a part of the step
    stretch = res["profiles"]["translation"]["stretch"]
    assert 0 < stretch["stretch_s"] < stretch["step_s"] and 0 < stretch["share"] < 1


@pytest.mark.slow
@needs_ns
def test_interrupted_run_leaves_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    before = set(NC.list_namespaces())
    workers_before = set(_workers())
    proc = subprocess.Popen([sys.executable, "-m", "embrace_fairseq.perf.bench", "--quick", "--models", "lm",
                             "--worlds", "2", "--out", str(tmp_path / "x")], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (set(NC.list_namespaces()) - before):
            time.sleep(0.5)
        assert set(NC.list_namespaces()) - before, "the run created no namespace"
        time.sleep(5)  # ranks started
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert set(NC.list_namespaces()) - before == set()
    time.sleep(2)
    assert set(_workers()) - workers_before == set()


def _workers():
    return subprocess.run(["pgrep", "-f", "embrace_fairseq.perf.bench.worker"], capture_output=True, text=True).stdout.split()


@needs_ns
def test_cleanup_spares_a_live_run_and_removes_a_dead_one():
    """--cleanup (and a test calling it) while a benchmark runs must not pull its links."""
    live = NC.Cluster.create(2, NC.LinkSpec(1.0, 0.1))
    dead = NC.new_tag()
    subprocess.run(["ip", "netns", "add", f"{dead}r0"], check=True)
    (NC.OWNERS / dead).parent.mkdir(parents=True, exist_ok=True)
    (NC.OWNERS / dead).write_text("999999999")  # a pid that does not exist
    try:
        gone = NC.cleanup_leftovers()
        assert f"{dead}r0" in gone and NC.list_namespaces(dead) == []
        assert len(NC.list_namespaces(live.tag)) == 3 and NC.owner_alive(live.tag)
    finally:
        live.close()
    assert NC.list_namespaces(live.tag) == [] and not (NC.OWNERS / live.tag).exists()
