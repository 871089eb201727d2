"""Fault scenarios of the core (real gloo ranks): bad start-up, empty batches, a slow
rank, non-finite shard gradients, a killed or hung rank, and a soak run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import rank_fns_reliability as R
from embrace_fairseq.tools.local_ranks import free_port, run_ranks
from embrace_fairseq.guards.watchdog import LOST_PEER_EXIT_CODE
from reliability_util import children_env, leftover_processes, note

HERE = Path(__file__).resolve().parent
WORLD = 3
STEPS = 8
SLOW_S = 0.3  # rank 1 sleeps this long inside every step, before its collectives


def _sizes_with_empties(step, rank):
    # rank 2 has an empty batch on every other step, rank 0 on step 0
    if (rank == 2 and step % 2 == 1) or (rank == 0 and step == 0):
        return 0
    return 3 + rank


def _training_runs(rank, world):
    out = {}
    out["reference"] = R.train_steps(rank, world, steps=STEPS, sizes=_sizes_with_empties, sharded=False)
    out["sharded"] = R.train_steps(rank, world, steps=STEPS, sizes=_sizes_with_empties)
    out["slow"] = R.train_steps(rank, world, steps=STEPS, sizes=_sizes_with_empties, slow_rank=1, slow_s=SLOW_S)
    out["inf"] = R.train_steps(rank, world, steps=STEPS, sizes=_sizes_with_empties, inf_at=(3, 1))
    out["inf_reference"] = R.train_steps(rank, world, steps=STEPS, sizes=_sizes_with_empties, sharded=False, inf_at=(3, 1))
    out["startup"] = R.startup_checks(rank, world, bad_rank=2)
    return out


_CACHE = {}


def _runs():
    if "train" not in _CACHE:
        _CACHE["train"] = run_ranks(_training_runs, WORLD, timeout_s=240)
    return _CACHE["train"]


def _close(a, b, tol=1e-5):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)) <= tol


def test_empty_batch_on_one_rank_trains_like_replicated(record_property):
    """Empty batch on one rank (legal): same losses and table as replicated training."""
    res = _runs()
    for r in range(WORLD):
        ref, got = res[r]["reference"], res[r]["sharded"]
        assert _close(got["losses"], ref["losses"]), (r, got["losses"], ref["losses"])
        assert _close(got["table"], ref["table"]), r
        assert got["digest"] == res[0]["sharded"]["digest"]  # dense replicas agree
    worst = max(float(np.abs(res[r]["sharded"]["table"] - res[r]["reference"]["table"]).max()) for r in range(WORLD))
    note(record_property, "core", f"trains; losses and table equal replicated (max table diff {worst:.1e}), "
                                  "dense replicas identical on 3 ranks")


def test_slow_rank_same_result(record_property):
    """A rank slow inside every step (late for its exchanges): training goes on, results unchanged."""
    res = _runs()
    for r in range(WORLD):
        assert res[r]["slow"]["losses"] == res[r]["sharded"]["losses"]
        assert (res[r]["slow"]["table"] == res[r]["sharded"]["table"]).all()
        assert res[r]["slow"]["digest"] == res[r]["sharded"]["digest"]
    # the others really waited for it inside each step, from the first step on: the slow
    # rank's sleeps fall before its collectives, not between steps
    for r in (0, 2):
        times = res[r]["slow"]["step_times"]
        assert len(times) == STEPS and min(times) >= 0.5 * SLOW_S, (r, times)
    note(record_property, "core", f"rank 1 sleeps {SLOW_S} s inside every step (before its forward and gradient "
                                  "exchanges); the others wait in those collectives; no hang, no watchdog stop; losses, "
                                  "tables and dense weights bit-identical")


def test_inf_in_one_rank_shard_gradient_same_action_everywhere(record_property):
    """inf in one rank's shard gradient: every rank skips that step, replicas stay identical."""
    res = _runs()
    actions = [res[r]["inf"]["actions"] for r in range(WORLD)]
    assert all(a == actions[0] for a in actions), actions
    assert actions[0][3] == "skip" and actions[0].count("skip") == 1, actions[0]
    # the sharded run skips exactly where the replicated reference (inf in the same rank's
    # gradient, averaged by all-reduce) skips, and ends with the same weights
    for r in range(WORLD):
        assert res[r]["inf"]["actions"] == res[r]["inf_reference"]["actions"]
        assert _close(res[r]["inf"]["table"], res[r]["inf_reference"]["table"])
        assert np.isfinite(res[r]["inf"]["table"]).all()
        assert res[r]["inf"]["digest"] == res[0]["inf"]["digest"]
    note(record_property, "core", "all 3 ranks skip step 3 (global norm not finite); weights finite, "
                                  "equal to the replicated reference, dense replicas identical")


def _startup():
    return [r["startup"] for r in _runs()]


@pytest.mark.parametrize("field", ["vocab", "dim"])
def test_ranks_with_different_tables_stop_at_startup(field, record_property):
    """Ranks started with different vocabularies / embedding sizes: error at start-up on every rank."""
    res = _startup()
    assert all(res[r]["same"][0] == "ok" for r in range(WORLD))
    needle = {"vocab": "rows differs (ranks 0,1: 23; ranks 2: 31)", "dim": "dim differs (ranks 0,1: 8; ranks 2: 16)"}[field]
    for r in range(WORLD):
        kind, msg, _ = res[r][field]
        assert kind == "ShardPlanMismatchError", (r, kind, msg)
        assert needle in msg, msg
    detect = max(res[r][field][2] for r in range(WORLD))
    note(record_property, "core", f"ShardPlanMismatchError on all 3 ranks naming the ranks and values: "
                                  f"`{needle}`", detect)


def test_diverged_dense_replicas_are_detected(record_property):
    """The replica check itself: dense weights moved on one rank are reported on every rank."""
    res = _startup()
    for r in range(WORLD):
        kind, msg, _ = res[r]["replicas"]
        assert kind == "ReplicaDivergenceError" and "ranks 2 hold" in msg, (kind, msg)
    note(record_property, "core", "ReplicaDivergenceError on all ranks, naming rank 2")


# --------------------------------------------------------------------------- a rank dies


def _launch(world, victim, how, timeout_s, tmp_path, steps=400, at=3):
    port = free_port()
    mark = tmp_path / "victim_time"
    env = children_env(EMBRACE_PEER_TIMEOUT_S=timeout_s, OMP_NUM_THREADS=1)
    procs = []
    for r in range(world):
        log = open(tmp_path / f"rank{r}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE.parent / "harness" / "fault_rank_main.py"), str(r), str(world), f"tcp://127.0.0.1:{port}",
             str(steps), "--victim", str(victim), "--at", str(at), "--how", how, "--mark", str(mark)],
            stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs, mark


def _run_rank_dies(world, victim, how, timeout_s, tmp_path):
    procs, mark = _launch(world, victim, how, timeout_s, tmp_path)
    ended = {}
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and len(ended) < world - 1:
            for r, p in enumerate(procs):
                if r != victim and r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
        killed_at = float(mark.read_text()) if mark.exists() else None
        survivors_rc = {r: procs[r].poll() for r in range(world) if r != victim}
        victim_rc = procs[victim].poll()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the stopped (hung) victim is not the watchdog's to end
            p.wait()
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(world)}
    return ended, killed_at, survivors_rc, victim_rc, logs, [p.pid for p in procs]


@pytest.mark.parametrize("victim,how,expect", [
    (2, "kill", "rank 2 lost: its process"),
    pytest.param(1, "stop", "rank 1 lost: no heartbeat for", marks=pytest.mark.slow),
])
def test_rank_dies_others_exit_naming_it(victim, how, expect, tmp_path, record_property):
    """A rank SIGKILLed mid-step (or hung: SIGSTOP), no launcher: the others exit non-zero in bounded time."""
    # the heartbeat timeout is generous (a loaded machine must not look hung); a killed
    # process on this host is seen within one check period whatever the timeout
    timeout_s = 20 if how == "kill" else 8
    world = 3
    ended, killed_at, rcs, victim_rc, logs, pids = _run_rank_dies(world, victim, how, timeout_s, tmp_path)
    assert killed_at is not None, logs
    if how == "kill":
        assert victim_rc == -signal.SIGKILL, (victim_rc, logs[victim])
    for r, rc in rcs.items():
        assert rc == LOST_PEER_EXIT_CODE, (r, rc, logs[r][-2000:])
        assert expect in logs[r], logs[r][-2000:]
    detect = max(ended.values()) - killed_at
    bound = (1.0 if how == "kill" else timeout_s) + 8.0  # the check period + process exit, loaded machine
    assert detect < bound, (detect, bound)
    assert not leftover_processes(pids)
    what = "SIGKILL" if how == "kill" else "SIGSTOP (hung)"
    note(record_property, "core", f"{what} on rank {victim} of 3 (EMBRACE_PEER_TIMEOUT_S={timeout_s}): both others "
                                  f"exit {LOST_PEER_EXIT_CODE} with `{expect} ...`; no process left", detect)


@pytest.mark.slow
def test_store_host_dies(tmp_path, record_property):
    """Rank 0, host of the tcp:// rendezvous store, SIGKILLed: the others exit within the timeout."""
    timeout_s = 8
    ended, killed_at, rcs, victim_rc, logs, pids = _run_rank_dies(3, 0, "kill", timeout_s, tmp_path)
    for r, rc in rcs.items():
        assert rc == LOST_PEER_EXIT_CODE, (r, rc, logs[r][-2000:])
        assert "rank 0" in logs[r].split("[embrace watchdog]")[-1], logs[r][-2000:]
    detect = max(ended.values()) - killed_at
    assert detect < timeout_s + 10, detect
    assert not leftover_processes(pids)
    note(record_property, "core", f"rank 0 (store host) SIGKILLed: ranks 1, 2 exit {LOST_PEER_EXIT_CODE} naming rank 0", detect)


# --------------------------------------------------------------------------- soak


@pytest.mark.slow
def test_soak_4_ranks_2000_steps(record_property):
    """Soak: 2000 steps on 4 ranks, random batch sizes with empty ones: no hang, RSS growth < 5 %."""
    res = run_ranks(R.soak, 4, steps=2000, warmup=300, timeout_s=1800, pg_timeout_s=300)
    growth = max(r["rss_end"] / r["rss_warm"] - 1.0 for r in res)
    empties = sum(r["empty"] for r in res)
    assert empties > 100
    assert growth < 0.05, [(r["rss_warm"], r["rss_end"]) for r in res]
    secs = max(r["seconds"] for r in res)
    note(record_property, "core", f"2000 steps in {secs:.0f} s, {empties} empty batches, "
                                  f"max RSS growth after warm-up {100 * growth:+.2f} %")
