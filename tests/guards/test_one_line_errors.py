"""A user's mistake ends a command with one line; a bug keeps its traceback."""
from __future__ import annotations

import sys

import pytest

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.guards import one_line_errors as O

from fairseq_corpus import make_lm_corpus, run_fairseq_tool


class _Refused(UserError, ValueError):
    pass


def _raise_chain():
    try:
        raise _Refused("--x cannot work with sharded tables.\nUse --y instead.")
    except _Refused as exc:
        raise RuntimeError("wrapped by the framework") from exc


def test_hook_prints_one_line_for_a_user_error_and_its_wrappers(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: calls.append(a))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    O.install()
    O.install()  # idempotent: one wrapper
    try:
        _raise_chain()
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert err == "embrace: error rank 1: _Refused: --x cannot work with sharded tables. Use --y instead.\n"
    assert calls == []
    try:
        raise KeyError("a bug")  # not a user error: the previous hook (a traceback) gets it
    except KeyError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert len(calls) == 1 and isinstance(calls[0][1], KeyError)
    monkeypatch.setenv("EMBRACE_TRACEBACK", "1")
    try:
        _raise_chain()
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert len(calls) == 2


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("lm"), vocab_size=23, n_train=20, n_valid=4, n_test=2)


@pytest.mark.slow  # ~10 s idle: a fairseq-train start-up
def test_fairseq_train_refusal_is_one_line(lm_data, tmp_path):
    """fairseq-train --user-dir with a flag the sharded table refuses: one line on stderr
    naming the flag and the fix, status 1, no traceback."""
    run = run_fairseq_tool("fairseq-train", [
        str(lm_data), "--task", "language_modeling", "--arch", "embrace_transformer_lm", "--adaptive-input",
        "--adaptive-input-cutoff", "10", "--cpu", "--max-tokens", "64", "--tokens-per-sample", "16",
        "--decoder-layers", "1", "--decoder-embed-dim", "8", "--decoder-ffn-embed-dim", "8",
        "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "0.001",
        "--save-dir", str(tmp_path / "ck"), "--max-update", "1"], timeout=120)
    assert run.returncode == 1, run.output[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("embrace: error")]
    assert len(lines) == 1, run.stderr[-2000:]
    assert "UnsupportedWithSharding" in lines[0] and "--adaptive-input" in lines[0] and "stock architecture" in lines[0]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow  # ~10 s idle: an embrace-ds-train start-up
def test_ds_train_bad_embrace_key_is_one_line(lm_data, tmp_path):
    """embrace-ds-train with an unknown key in the "embrace" section: one line naming the
    key, status 1, no traceback, and no tensorboardX notice."""
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 8, "embrace": {"piece_byte": 1024}}')
    run = run_fairseq_tool("embrace-ds-train", [
        str(lm_data), "--task", "language_modeling", "--arch", "embrace_transformer_lm", "--cpu",
        "--deepspeed-config", str(config), "--max-tokens", "64", "--tokens-per-sample", "16",
        "--optimizer", "adam", "--lr", "0.001", "--save-dir", str(tmp_path / "ck"), "--max-update", "1"],
        timeout=120)
    assert run.returncode == 1, run.output[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("embrace: error")]
    assert len(lines) == 1 and "EmbraceConfigError" in lines[0] and "piece_byte" in lines[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "tensorboardX" not in run.output, run.output[-3000:]
