"""The multi-node recipe (``scripts/recipes/multinode.sh``) on an emulated cluster.

Two nodes of two CPU ranks on one machine (:mod:`embrace_fairseq.perf.bench.netem_cluster`
with ``ranks_per_node=2``): each node is a network namespace with one veth to a switch,
shaped to 1 Gbit/s; the ranks of a node talk over its loopback. Each node also gets its
own host name (a UTS namespace), as separate machines have, so nothing can take two nodes
for one host. On every node one launcher runs, as a user types it on each machine:
``ip netns exec <node> scripts/recipes/multinode.sh --node-rank I --master-addr <node 0> ...``.

* torchrun with a static rendezvous and with the c10d rendezvous, fairseq-train: both
  nodes finish, the inter-node link carried the traffic, each node chose its own
  interface, and the per-update losses equal a 4-rank single-node run of the same
  command (relative 1e-4);
* the DeepSpeed launcher without ssh (one per node), embrace-ds-train: the same losses;
* a node lost: every process of node 1 SIGKILLed mid-training; node 0's ranks stop by
  the peer watchdog, naming ranks 2 and 3, and node 0's launcher exits non-zero, all
  within the watchdog timeout plus a few seconds.

All slow (four ranks on a shared 2-core machine: about a minute per run); skipped where
network namespaces cannot be created (not root, no iproute2).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

import pytest

from embrace_fairseq.guards.watchdog import LOST_PEER_EXIT_CODE
from embrace_fairseq.perf.bench import netem_cluster as NC
from fairseq_corpus import PER_RANK_OUTPUT, REPO_ROOT, fairseq_env, free_port, losses_by_update, make_translation_corpus

NS_REASON = NC.namespaces_available()
needs_ns = pytest.mark.skipif(NS_REASON is not None, reason=f"no network namespaces here: {NS_REASON}")

SCRIPT = REPO_ROOT / "scripts" / "recipes" / "multinode.sh"
VENV = Path(sys.executable).parent.parent  # not resolved: the venv's python is a symlink
NODES, PER_NODE = 2, 2
LINK = NC.LinkSpec(1.0, 0.1)  # the slow link between nodes
PORT = "29500"  # every cluster has namespaces of its own: no other job listens there
REL = 1e-4
MAX_UPDATE = 3

TINY = [
    "--task", "translation", "--arch", "embrace_transformer", "--share-all-embeddings",
    "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--dropout", "0", "--attention-dropout", "0", "--optimizer", "adam", "--lr", "0.003", "--seed", "3",
    "--max-tokens", "120", "--num-workers", "0", "--no-epoch-checkpoints", "--disable-validation",
    "--log-format", "json", "--log-interval", "1",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_translation_corpus(tmp_path_factory.mktemp("multinode_mt"), vocab_size=51, n_train=240, n_valid=24,
                                   timeout=600)


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory) -> Path:
    """No optimizer in the JSON: fairseq's --optimizer/--lr fill it, as in the fairseq-train runs."""
    path = tmp_path_factory.mktemp("multinode_ds") / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0},
                                "embrace": {"piece_bytes": 4096, "bucket_bytes": 16384}}))
    return path


def _train_args(corpus: Path, save_dir: Path, max_update: int = MAX_UPDATE) -> List[str]:
    return [str(corpus), *TINY, "--max-update", str(max_update), "--save-dir", str(save_dir)]


def _env(extra: Mapping[str, str] = ()) -> Dict[str, str]:
    # PYTHONFAULTHANDLER: a rank sent SIGABRT prints every thread's stack (see _dump_stacks)
    return fairseq_env({"CPU": "1", "EMBRACE_VENV": str(VENV), "EMBRACE_LOG_PRECISION": "8",
                        "PYTHONFAULTHANDLER": "1", **dict(extra)})


@pytest.fixture(scope="module")
def single_node_losses(corpus, tmp_path_factory) -> Dict[int, float]:
    """The same command on one node of 4 ranks (loopback): the losses every layout must give."""
    save = tmp_path_factory.mktemp("multinode_ref")
    cmd = ["bash", str(SCRIPT), "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", str(NODES * PER_NODE),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *_train_args(corpus, save / "ckpt")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    losses = losses_by_update(out)
    assert sorted(losses) == list(range(1, MAX_UPDATE + 1)), out[-4000:]
    return losses


# --------------------------------------------------------------------------- emulated nodes


def _node_prefix(place: NC.RankPlacement) -> List[str]:
    """Run a command on a node: in its network namespace, under a host name of its own."""
    return place.command_prefix() + ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                                     f"embnode{place.node}"]


def _start_nodes(cluster: NC.Cluster, launcher_opts: Sequence[str], train_args: Sequence[str], logs: Path,
                 env: Mapping[str, str], node_rank: bool = True) -> List[subprocess.Popen]:
    """One ``multinode.sh`` per node, node 0 first, output to ``logs/node<N>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for place in cluster.node_placements():
        cmd = [*_node_prefix(place), "bash", str(SCRIPT), *launcher_opts, "--nnodes", str(cluster.nodes),
               "--nproc-per-node", str(cluster.ranks_per_node), "--master-addr", cluster.ranks[0].addr,
               "--master-port", PORT, *(["--node-rank", str(place.node)] if node_rank else []), *train_args]
        with open(logs / f"node{place.node}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                                          stdin=subprocess.DEVNULL))
    return procs


def _namespace_pids(netns: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _kill_node(netns: str) -> List[int]:
    """SIGKILL every process of a node (all that run in its namespace), like a machine
    that goes away; returns their pids."""
    pids = _namespace_pids(netns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _dump_stacks(cluster: NC.Cluster, launchers: Sequence[subprocess.Popen]) -> None:
    """A run that hangs: SIGABRT every process of the nodes but the launchers we started,
    so each rank writes its threads' Python stacks into its node's log (faulthandler)."""
    ours = {p.pid for p in launchers}
    for place in cluster.node_placements():
        for pid in _namespace_pids(place.netns):
            if pid not in ours:
                try:
                    os.kill(pid, signal.SIGABRT)
                except ProcessLookupError:
                    pass
    time.sleep(3)


def _stop_all(cluster: NC.Cluster, procs: Sequence[subprocess.Popen]) -> None:
    for place in cluster.node_placements():
        _kill_node(place.netns)  # a namespace is gone only when its last process is
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _tx_bytes(place: NC.RankPlacement) -> int:
    out = subprocess.run([*place.command_prefix(), "cat", place.tx_bytes_path()], capture_output=True, text=True,
                         check=True).stdout
    return int(out)


def _run_cluster(corpus: Path, tmp_path: Path, launcher_opts: Sequence[str], env: Mapping[str, str] = (),
                 node_rank: bool = True, timeout: float = 240) -> Dict[str, object]:
    """Train MAX_UPDATE updates on 2 emulated nodes x 2 ranks; the outputs, exit codes and
    bytes each node sent over its link. A run takes about a minute; one still running
    after ``timeout`` s hangs, and its logs end with every rank's stacks."""
    with NC.Cluster.create(NODES * PER_NODE, LINK, ranks_per_node=PER_NODE) as cluster:
        nodes = cluster.node_placements()
        tx0 = [_tx_bytes(p) for p in nodes]
        procs = _start_nodes(cluster, launcher_opts, _train_args(corpus, tmp_path / "ckpt"), tmp_path / "logs",
                             _env(env), node_rank)
        hung = False
        try:
            deadline = time.monotonic() + timeout
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            _dump_stacks(cluster, procs)
        finally:
            codes = [p.poll() for p in procs]
            tx = [_tx_bytes(p) - t for p, t in zip(nodes, tx0)]
            _stop_all(cluster, procs)
        outs = [(tmp_path / "logs" / f"node{n}.log").read_text() for n in range(NODES)]
        ifnames = [p.ifname for p in nodes]
    assert NC.list_namespaces(cluster.tag) == []
    return {"codes": codes, "outs": outs, "tx": tx, "ifnames": ifnames, "hung": hung, "timeout": timeout}


def _assert_trained_like_one_node(run: Dict[str, object], reference: Dict[int, float], what: str) -> None:
    outs: List[str] = run["outs"]  # type: ignore[assignment]
    tail = "\n".join(f"--- node {n}\n{o[-8000:]}" for n, o in enumerate(outs))
    assert not run["hung"], (f"{what}: still running after {run['timeout']} s, a hang; each rank's stacks "
                             f"(faulthandler) end its node's log\n{tail}")
    assert run["codes"] == [0, 0], f"{what}: launchers exited {run['codes']}\n{tail}"
    for n, (out, ifname) in enumerate(zip(outs, run["ifnames"])):  # type: ignore[arg-type]
        # each node found the interface that carries its address to the other node
        assert f"GLOO_SOCKET_IFNAME={ifname} " in out, (what, n, out[:2000])
    # the ranks of the two nodes trained together: over the shaped link, both ways
    assert all(b > 100_000 for b in run["tx"]), (what, run["tx"])  # type: ignore[union-attr]
    losses = losses_by_update("\n".join(outs))  # rank 0 logs them, on whichever node it is
    assert sorted(losses) == sorted(reference), f"{what}: updates {sorted(losses)}\n{tail}"
    worst = max(abs(losses[u] - reference[u]) / abs(reference[u]) for u in reference)
    assert worst <= REL, f"{what}: losses differ by {worst:.2e} relative\none node: {reference}\ntwo nodes: {losses}"
    print(f"{what}: 2 nodes x {PER_NODE} ranks, losses {losses}, worst relative difference {worst:.1e}, "
          f"bytes over the node links {run['tx']}")


# --------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_script_checks_its_arguments_and_prints_the_command(tmp_path):
    """No run: a missing node rank or master address stops with the reason; --dry-run prints
    the launch command of each launcher with the interface chosen."""
    env = _env()
    bash = lambda *a: subprocess.run(["bash", str(SCRIPT), *a], env=env, capture_output=True, text=True,  # noqa: E731
                                     timeout=60, stdin=subprocess.DEVNULL)
    p = bash("--master-addr", "127.0.0.1", "data")
    assert p.returncode == 2 and "set --node-rank" in p.stderr, p.stderr
    p = bash("--node-rank", "0", "data")
    assert p.returncode == 2 and "set --master-addr" in p.stderr, p.stderr
    p = bash("--node-rank", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "data")
    assert p.returncode == 2 and "is not below --nnodes" in p.stderr, p.stderr
    common = ["--dry-run", "--master-addr", "127.0.0.1", "--nproc-per-node", "3"]
    p = bash(*common, "--node-rank", "1", "data", "--task", "translation")
    assert p.returncode == 0, p.stderr
    assert re.search(r"torchrun --nnodes 2 --nproc-per-node 3 --node-rank 1 --master-addr 127.0.0.1 "
                     r"--master-port 29500 --no-python \S+/fairseq-train data --task translation --user-dir \S+ "
                     r"--cpu --distributed-backend gloo --ddp-backend legacy_ddp", p.stdout), p.stdout
    assert "GLOO_SOCKET_IFNAME=lo " in p.stdout  # 127.0.0.1 is held by lo here
    p = bash(*common, "--launcher", "rdzv", "--rdzv-id", "job7", "data")
    assert re.search(r"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 --rdzv-id job7 --rdzv-conf is_host=1 "
                     r"--local-addr 127.0.0.1", p.stdout), p.stdout
    p = bash(*common, "--node-rank", "0", "--trainer", "deepspeed", "data")
    assert re.search(r"--no-python \S+python -m embrace_fairseq.deepspeed_adapter.train data --user-dir \S+ --cpu "
                     r"--deepspeed-config \S+embrace_cpu.json", p.stdout), p.stdout
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=3\nb slots=3\n")
    p = bash(*common, "--launcher", "deepspeed", "--node-rank", "1", "--hostfile", str(hostfile), "data")
    assert re.search(rf"deepspeed.launcher.runner --hostfile {hostfile} --no_ssh --node_rank 1 --master_addr "
                     r"127.0.0.1 --master_port 29500 --module embrace_fairseq.deepspeed_adapter.train data .*"
                     r"--deepspeed-config \S+embrace_cpu.json", p.stdout), p.stdout


@pytest.mark.slow
@needs_ns
def test_torchrun_static_two_nodes_equal_one_node(corpus, single_node_losses, tmp_path):
    """torchrun --nnodes 2 --node-rank I --master-addr <node 0> on each node: fairseq-train
    finishes on both nodes with the losses of one node of 4 ranks; rank 0 wrote the
    checkpoint, with full tables, into the save directory both nodes were given."""
    import torch

    run = _run_cluster(corpus, tmp_path, ["--launcher", "torchrun"])
    _assert_trained_like_one_node(run, single_node_losses, "torchrun static")
    ckpt = torch.load(tmp_path / "ckpt" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert ckpt["model"]["encoder.embed_tokens.weight"].shape[0] == 56  # the full table, not a shard
    assert ckpt["optimizer_history"][-1]["num_updates"] == MAX_UPDATE


@pytest.mark.slow
@needs_ns
def test_torchrun_rendezvous_two_nodes_equal_one_node(corpus, single_node_losses, tmp_path):
    """torchrun --rdzv-backend c10d --rdzv-endpoint <node 0>:P --rdzv-id JOB, no node rank:
    the same losses as one node."""
    run = _run_cluster(corpus, tmp_path, ["--launcher", "rdzv", "--rdzv-id", "multinode-test"], node_rank=False)
    _assert_trained_like_one_node(run, single_node_losses, "torchrun rendezvous")


@pytest.mark.slow
@needs_ns
def test_deepspeed_launcher_two_nodes_equal_one_node(corpus, single_node_losses, ds_config, tmp_path):
    """deepspeed --hostfile H --no_ssh --node_rank I on each node, embrace-ds-train: the
    losses of fairseq-train on one node (same optimizer, from fairseq's flags)."""
    pytest.importorskip("deepspeed")
    # TMPDIR: where the script writes the hostfile it makes
    run = _run_cluster(corpus, tmp_path, ["--launcher", "deepspeed"],
                       env={"DS_CONFIG": str(ds_config), "TMPDIR": str(tmp_path)})
    assert (tmp_path / "embrace_hostfile.embrace.2.2").read_text() == "node0 slots=2\nnode1 slots=2\n"
    _assert_trained_like_one_node(run, single_node_losses, "deepspeed --no_ssh")


@pytest.mark.slow
@needs_ns
def test_lost_node_stops_the_other_within_the_watchdog_timeout(corpus, tmp_path):
    """Every process of node 1 (launcher and ranks 2, 3) SIGKILLed mid-training: node 0's
    ranks stop with the watchdog's message naming ranks 2 and 3 (exit 43), node 0's
    launcher exits non-zero, no process of node 0 is left, all within the timeout plus
    a few seconds (the nodes have different host names: the heartbeat decides, as
    across real machines)."""
    timeout_s = 10
    env = _env({"EMBRACE_PEER_TIMEOUT_S": str(timeout_s), **PER_RANK_OUTPUT})
    args = [*_train_args(corpus, tmp_path / "ckpt", max_update=100_000), "--no-save"]
    logs = tmp_path / "logs"
    with NC.Cluster.create(NODES * PER_NODE, LINK, ranks_per_node=PER_NODE) as cluster:
        node0, node1 = cluster.node_placements()
        procs = _start_nodes(cluster, ["--launcher", "torchrun"], args, logs, env)
        try:
            deadline = time.monotonic() + 300
            while '"num_updates": "5"' not in (logs / "node0.log").read_text():
                assert time.monotonic() < deadline and procs[0].poll() is None, (logs / "node0.log").read_text()[-5000:]
                time.sleep(0.2)
            node0_pids = _namespace_pids(node0.netns)
            killed = _kill_node(node1.netns)
            killed_at = time.monotonic()
            assert len(killed) >= 1 + PER_NODE, killed  # the launcher and its ranks
            try:
                procs[0].wait(timeout=timeout_s + 60)
            except subprocess.TimeoutExpired:
                pass
            detect = time.monotonic() - killed_at
            code = procs[0].poll()
            time.sleep(1)
            left = [p for p in node0_pids if p in _namespace_pids(node0.netns)]
        finally:
            _stop_all(cluster, procs)
    out = (logs / "node0.log").read_text()
    assert code not in (None, 0), f"node 0's launcher: {code}\n{out[-5000:]}"
    verdicts = [ln for ln in out.splitlines() if "[embrace watchdog]" in ln]
    assert verdicts, out[-5000:]
    for line in verdicts:  # every rank of node 0 that reported names both lost ranks
        assert "ranks 2, 3 lost: rank 2: " in line and "; rank 3: " in line, line
        assert f"exit {LOST_PEER_EXIT_CODE}" in line
    assert f"exitcode  : {LOST_PEER_EXIT_CODE}" in out, out[-3000:]  # torchrun saw its ranks end so
    assert not left, left
    assert detect < timeout_s + 15, detect
    print(f"node 1 killed ({len(killed)} processes); node 0 stopped after {detect:.1f} s "
          f"(EMBRACE_PEER_TIMEOUT_S={timeout_s}): {verdicts[0]}")
