"""Fault scenarios of the DeepSpeed path: the EmbRace engine (``initialize``) in real gloo
ranks, and the ``embrace-ds-train`` launcher."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import rank_fns_reliability_ds as RD  # noqa: E402
from embrace_fairseq.tools.local_ranks import RanksFailed, free_port, run_ranks  # noqa: E402
from fairseq_corpus import PER_RANK_OUTPUT, fairseq_env, make_translation_corpus, rank_lines  # noqa: E402
from reliability_util import note  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # DeepSpeed start-up on 3 ranks: minutes on a loaded 2-core machine
def test_ds_ranks_with_different_configs_stop_at_startup(record_property):
    """Ranks started with different "embrace" configs (DeepSpeed): error at start-up on every rank."""
    res = run_ranks(RD.mismatched_config, 3, 2, timeout_s=300, pg_timeout_s=120)
    for r, (kind, msg, _) in enumerate(res):
        assert kind == "ConfigMismatchError", (r, kind, msg)
        assert "collective schedule differs (ranks 0,1:" in msg and "ranks 2:" in msg, msg
    note(record_property, "DeepSpeed", "ConfigMismatchError from `initialize` on all 3 ranks: "
                                       "`collective schedule differs (ranks 0,1: ...; ranks 2: ...)`",
         max(t for _, _, t in res))


@pytest.mark.slow
def test_ds_rank_dies_others_exit_naming_it(tmp_path, record_property):
    """A rank SIGKILLed mid-step on the DeepSpeed engine (no launcher): the others stop, naming it."""
    mark = tmp_path / "killed_at"
    os.environ["EMBRACE_PEER_TIMEOUT_S"] = "20"
    try:
        res = run_ranks(RD.rank_dies, 3, 2, 3, str(mark), timeout_s=300, pg_timeout_s=600, return_errors=True)
    finally:
        del os.environ["EMBRACE_PEER_TIMEOUT_S"]
    done = time.time()
    for r in (0, 1):
        assert isinstance(res[r], RanksFailed) and "rank 2 lost: its process" in str(res[r]), (r, res[r])
    assert isinstance(res[2], RanksFailed) and "signal 9" in str(res[2]), res[2]
    detect = done - float(mark.read_text())
    assert detect < 30, detect
    note(record_property, "DeepSpeed", "ranks 0, 1 stopped by the watchdog installed by `initialize`: "
                                       "`rank 2 lost: its process ... is gone`", detect)


@pytest.mark.slow
def test_ds_bad_ids_from_data_stop_every_rank(tmp_path, record_property):
    """Bad input on embrace-ds-train: a dictionary that does not match the binarised data."""
    data = make_translation_corpus(tmp_path / "corpus", vocab_size=51, n_train=120, timeout=900)
    lines = (data / "dict.src.txt").read_text().splitlines(keepends=True)
    (data / "dict.src.txt").write_text("".join(lines[:-12]))
    shutil.copy(data / "dict.src.txt", data / "dict.tgt.txt")
    env = dict(fairseq_env(PER_RANK_OUTPUT), EMBRACE_VENV=str(Path(sys.executable).parent.parent),
               MASTER_PORT=str(free_port()), DS_CONFIG=str(ROOT / "ds_config" / "embrace_cpu.json"),
               EMBRACE_LAUNCHER="torchrun")  # torchrun prefixes each rank's lines (PER_RANK_OUTPUT)
    t0 = time.monotonic()
    run = subprocess.run(
        [str(ROOT / "scripts" / "ds_train_cpu.sh"), "2", str(data), "--task", "translation",
         "--arch", "embrace_transformer", "--share-all-embeddings", "--encoder-layers", "1", "--decoder-layers", "1",
         "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
         "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
         "--max-tokens", "200", "--max-epoch", "1", "--save-dir", str(tmp_path / "ckpt")],
        env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "InvalidIdError" in out and "is out of range for a table of" in out, out[-4000:]
    for r in (0, 1):  # each rank printed the error itself
        assert any("InvalidIdError: embedding id" in ln for ln in rank_lines(out, r)), \
            (r, "\n".join(rank_lines(out, r))[-3000:] or out[-3000:])
    bad = [ln for ln in out.splitlines() if "is out of range for a table of" in ln][0]
    note(record_property, "DeepSpeed", f"embrace-ds-train x2 stops: `{bad.split('InvalidIdError: ')[-1][:110]}`", took)


@pytest.mark.slow
def test_ds_inf_in_one_rank_shard_gradient(record_property):
    """inf in one rank's shard gradient on the DeepSpeed engine: every rank takes the same action."""
    res = run_ranks(RD.inf_in_shard_gradient, 3, 1, 2, timeout_s=400, pg_timeout_s=120)
    for r in res:
        assert r["step"] == 2, res
        kind, msg = r["error"]
        assert kind == "NonFiniteGradientError" and "on rank 1" in msg, (kind, msg)
        assert r["unchanged"] and r["table_finite"]
    note(record_property, "DeepSpeed", "all 3 ranks stop at the same step with `NonFiniteGradientError: non-finite "
                                       "(inf/NaN) gradient: emb.weight on rank 1`; no weight was updated, dense replicas "
                                       "identical (fp16 skip-and-rescale not run on CPU)")


# --------------------------------------------------------------------------- launcher checkpoints

from test_deepspeed_launcher import PRECISION, TINY_LM  # noqa: E402  (the launcher tests' tiny LM and flags)
from fairseq_corpus import losses_by_update, make_lm_corpus  # noqa: E402


def _ds_cmd(data, save_dir, extra):
    return [str(ROOT / "scripts" / "ds_train_cpu.sh"), "2", str(data), *TINY_LM, "--save-dir", str(save_dir), *extra]


def _ds_env(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "zero_optimization": {"stage": 0},
           "embrace": {"piece_bytes": 4096, "bucket_bytes": 16384}}
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(cfg))
    return dict(fairseq_env(), EMBRACE_VENV=str(Path(sys.executable).parent.parent), DS_CONFIG=str(path),
                MASTER_PORT=str(free_port()), **PRECISION)


def _losses(text):
    return losses_by_update(text)


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("ds_lm"), n_train=200, timeout=900)


@pytest.mark.slow
def test_ds_killed_and_resumed_equals_uninterrupted(lm_data, tmp_path, record_property):
    """Exact resume on embrace-ds-train: killed (SIGKILL, all processes) after update 6, resumed: same losses."""
    from reliability_util import kill_tree
    from reliability_util import wait_for

    # checkpoints every 4 updates, none at epoch ends (5 updates per epoch): resuming from an
    # epoch-end checkpoint does not repeat the uninterrupted run under fairseq-train itself
    # (its next epoch's losses differ from update 6 on, stock and DeepSpeed trainer alike)
    extra = ["--max-update", "12", "--save-interval-updates", "4", "--save-interval", "1000"]
    full = subprocess.run(_ds_cmd(lm_data, tmp_path / "full", extra), env=_ds_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert full.returncode == 0, (full.stdout + full.stderr)[-3000:]
    want = _losses(full.stdout + full.stderr)
    assert sorted(want) == list(range(1, 13))
    log = tmp_path / "killed.log"
    proc = subprocess.Popen(_ds_cmd(lm_data, tmp_path / "b", extra), env=_ds_env(tmp_path),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: max(_losses(log.read_text()) or [0]) >= 6, timeout=400), log.read_text()[-3000:]
        kill_tree(proc.pid)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    killed_at = max(_losses(log.read_text()))
    assert killed_at < 12
    again = subprocess.run(_ds_cmd(lm_data, tmp_path / "b", extra), env=_ds_env(tmp_path), capture_output=True,
                           text=True, timeout=600)
    text = again.stdout + again.stderr
    assert again.returncode == 0 and "Loaded checkpoint" in text, text[-3000:]
    got = _losses(text)
    start = min(got)
    # resumed after the last checkpoint written before the kill (every 4 updates)
    assert start <= killed_at + 1 and sorted(got) == list(range(start, 13)), (start, killed_at, sorted(got))
    for u in got:
        assert got[u] == pytest.approx(want[u], rel=1e-6, abs=0), (u, got, want)
    note(record_property, "DeepSpeed", f"killed at update {killed_at}, resumed from update {start - 1}: losses of "
                                       f"updates {start}..12 equal the uninterrupted run (rel. 1e-6; dropout 0.1, RNG restored)")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "flipped_bit"])
def test_ds_corrupted_checkpoint_is_refused(lm_data, tmp_path, record_property, damage):
    """A truncated or bit-flipped checkpoint_last.pt on embrace-ds-train resume: a clear error on every rank."""
    save = tmp_path / "ckpt"
    run = subprocess.run(_ds_cmd(lm_data, save, ["--max-update", "2"]), env=_ds_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    last = save / "checkpoint_last.pt"
    data = bytearray(last.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # one bit in the middle of the file, inside tensor data: torch alone would load it
        data[len(data) // 2] ^= 0x01
    last.write_bytes(bytes(data))
    t0 = time.monotonic()
    again = subprocess.run(_ds_cmd(lm_data, save, ["--max-update", "4"]), env=_ds_env(tmp_path), capture_output=True,
                           text=True, timeout=600)
    took = time.monotonic() - t0
    text = again.stdout + again.stderr
    assert again.returncode != 0
    assert "CorruptCheckpointError" in text and "checkpoint_last.pt" in text, text[-3000:]
    assert not _losses(text)
    note(record_property, "DeepSpeed", f"{damage.replace('_', ' ')} checkpoint: resume refused with "
                                       "`CorruptCheckpointError` naming the file (SHA-256 sidecar); no update runs", took)
