"""A user's mistake ends every command with one line and status 2; a bug keeps its traceback."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch.multiprocessing

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.native_ops import NativeOpsUnavailable
from embrace_fairseq.guards import one_line_errors as O

from fairseq_corpus import fairseq_env, make_lm_corpus, run_ds_train, run_fairseq_tool, venv_script

EXIT = O.USER_ERROR_EXIT


class _Refused(UserError, ValueError):
    pass


def _raise_chain():
    try:
        raise _Refused("--x cannot work with sharded tables.\nUse --y instead.")
    except _Refused as exc:
        raise RuntimeError("wrapped by the framework") from exc


def _error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.startswith("embrace: error")]


def _assert_one_line(run, *says: str) -> str:
    """The command exited with the user-error status and printed exactly one error line
    (``embrace: error: Kind: ...`` holding each of ``says``), no traceback."""
    assert run.returncode == EXIT, (run.returncode, run.stderr[-3000:])
    lines = _error_lines(run.stderr)
    assert len(lines) == 1 and lines[0].startswith(O.PREFIX), run.stderr[-3000:]
    assert all(s in lines[0] for s in says), lines[0]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    return lines[0]


def test_exit_status_is_argparse_usage_status():
    assert EXIT == 2  # documented (docs/INSTALL.md): the same status as a bad command line


def test_hook_prints_one_line_for_a_user_error_and_its_wrappers(capsys, monkeypatch):
    calls, exits = [], []
    monkeypatch.setattr(sys, "excepthook", lambda *a: calls.append(a))
    monkeypatch.setattr(O, "_exit", exits.append)  # the real one ends the process
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    O.install()
    O.install()  # idempotent: one wrapper
    try:
        _raise_chain()
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert err == "embrace: error: (rank 1) _Refused: --x cannot work with sharded tables. Use --y instead.\n"
    assert calls == [] and exits == [EXIT]
    try:
        raise KeyError("a bug")  # not a user error: the previous hook (a traceback) gets it
    except KeyError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert len(calls) == 1 and isinstance(calls[0][1], KeyError) and exits == [EXIT]
    monkeypatch.setenv("EMBRACE_TRACEBACK", "1")
    try:
        _raise_chain()
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert len(calls) == 2 and exits == [EXIT]


def test_no_rank_outside_a_multi_rank_job(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert O.one_line(_Refused("bad")) == "embrace: error: _Refused: bad"


def test_a_rank_that_ended_with_the_status_is_reported_once(capsys):
    """The parent of spawned ranks prints nothing more (the rank printed its line) and
    exits with the same status; a rank that crashed keeps its traceback."""
    ended = torch.multiprocessing.ProcessExitedException("process 1 terminated with exit code 2", 1, 123, EXIT)
    assert O.report(ended) == EXIT and capsys.readouterr().err == ""
    crashed = torch.multiprocessing.ProcessExitedException("process 1 terminated with exit code 1", 1, 123, 1)
    assert O.report(crashed) is None
    raised = torch.multiprocessing.ProcessRaisedException("Traceback ...\nKeyError: 'x'", 0, 123)
    assert O.report(raised) is None


def _refuse(message: str) -> None:
    raise _Refused(message)


def test_guarded_main_pickles_and_exits_with_the_status(capsys):
    guarded = O.guarded(_refuse)
    assert O.guarded(guarded) is guarded  # fairseq's call_main may be wrapped twice
    again = pickle.loads(pickle.dumps(guarded))  # fairseq pickles main into each spawned rank
    with pytest.raises(SystemExit) as info:
        again("no such table")
    assert info.value.code == EXIT
    assert capsys.readouterr().err == "embrace: error: _Refused: no such table\n"
    with pytest.raises(KeyError):
        O.guarded(lambda: {}["bug"])()


def _run(cmd, timeout=120, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=fairseq_env(env),
                          stdin=subprocess.DEVNULL)


def test_native_ops_unavailable_is_one_line():
    """EMBRACE_NATIVE=1 without the extension: a user error (rebuild it or unset the
    variable), one line and status 2 from a command, not a traceback."""
    assert issubclass(NativeOpsUnavailable, UserError) and issubclass(NativeOpsUnavailable, RuntimeError)
    code = (
        "import sys, torch\n"
        "sys.modules['embrace_fairseq._native'] = None  # the extension is not built\n"
        "from embrace_fairseq.core import native_ops\n"
        "from embrace_fairseq.guards.one_line_errors import command\n"
        "command(lambda: native_ops.dedup_bucket(torch.tensor([4, 1, 4]), [0, 5, 10]))()\n"
    )
    run = _run([sys.executable, "-c", code], env={"EMBRACE_NATIVE": "1"})
    _assert_one_line(run, "NativeOpsUnavailable: EMBRACE_NATIVE=1 but the extension is not built", "EMBRACE_NATIVE=auto")


def test_export_stock_missing_checkpoint_is_one_line(tmp_path):
    run = _run([venv_script("embrace-export-stock"), str(tmp_path / "checkpoint_best.pt"), str(tmp_path / "out.pt")])
    _assert_one_line(run, "ExportError: no checkpoint file", "checkpoint_best.pt")
    assert not (tmp_path / "out.pt").exists()


def test_prepare_data_output_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "data").write_text("not a folder")
    run = _run([venv_script("embrace-prepare-data"), "--out", str(tmp_path / "data")])
    _assert_one_line(run, "NotAFolderError: --out", "is a file")


@pytest.mark.parametrize("text, says", [
    ('{"train_micro_batch_size_per_gpu": 8,}', "is not valid JSON: Expecting property name enclosed in double quotes: line 1"),
    # the same path: in the slow suite, to keep the default one to a process start
    pytest.param('[{"train_micro_batch_size_per_gpu": 8}]', "must hold a JSON object", marks=pytest.mark.slow),
    pytest.param(None, "cannot read the DeepSpeed config", marks=pytest.mark.slow),
])
def test_ds_train_bad_config_file_is_one_line(tmp_path, text, says):
    """A malformed, non-object or missing --deepspeed-config: one line naming the file,
    before fairseq is imported (each rank of a launcher prints its own)."""
    config = tmp_path / "ds.json"
    if text is not None:
        config.write_text(text)
    run = _run([venv_script("embrace-ds-train"), str(tmp_path), "--task", "language_modeling", "--cpu",
                "--deepspeed-config", str(config)])
    _assert_one_line(run, "ConfigFileError:", str(config), says)


@pytest.mark.slow  # ~15 s idle: the deepspeed launcher and two ranks start up
def test_ds_train_malformed_config_under_the_launcher_is_one_line_per_rank(tmp_path):
    """Under the deepspeed launcher every rank reads the JSON: each prints its own line,
    with its rank, and the launcher ends with the ranks' status."""
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 8,}')
    run = run_ds_train(tmp_path, ["--task", "language_modeling"], config, nproc=2, timeout=300)
    assert run.returncode == EXIT, run.output[-3000:]
    lines = sorted(_error_lines(run.stdout + "\n" + run.stderr))
    assert [line.split(" ConfigFileError: ")[0] for line in lines] == [
        "embrace: error: (rank 0)", "embrace: error: (rank 1)"], run.output[-3000:]
    assert all("is not valid JSON" in line for line in lines) and "Traceback" not in run.output


@pytest.mark.slow  # ~10 s idle: hydra composes fairseq's config
def test_hydra_train_missing_config_is_one_line(tmp_path):
    run = _run([venv_script("embrace-hydra-train"), "--config-dir", str(tmp_path / "nowhere"),
                "--config-name", "base"])
    _assert_one_line(run, "HydraConfigError:", "nowhere")


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("lm"), vocab_size=23, n_train=20, n_valid=4, n_test=2)


#: fairseq-train flags of a tiny language model that the sharded table refuses (--adaptive-input)
_REFUSED_LM = ["--task", "language_modeling", "--arch", "embrace_transformer_lm", "--adaptive-input",
               "--adaptive-input-cutoff", "10", "--cpu", "--max-tokens", "64", "--tokens-per-sample", "16",
               "--decoder-layers", "1", "--decoder-embed-dim", "8", "--decoder-ffn-embed-dim", "8",
               "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "0.001", "--max-update", "1"]


@pytest.mark.slow  # ~10 s idle: a fairseq-train start-up
def test_fairseq_train_refusal_is_one_line(lm_data, tmp_path):
    """fairseq-train --user-dir with a flag the sharded table refuses: one line on stderr
    naming the flag and the fix, status 2, no traceback."""
    run = run_fairseq_tool("fairseq-train", [str(lm_data), *_REFUSED_LM, "--save-dir", str(tmp_path / "ck")],
                           timeout=120)
    _assert_one_line(run, "UnsupportedWithSharding", "--adaptive-input", "stock architecture")


@pytest.mark.slow  # ~30 s idle: fairseq-train and the two ranks it spawns start up
def test_fairseq_train_spawned_ranks_refusal_is_one_line_per_rank(lm_data, tmp_path):
    """fairseq-train --cpu --distributed-world-size 2 without torchrun spawns its ranks
    (torch.multiprocessing): the error raised in a rank is that rank's one line, the
    parent adds nothing (no traceback of the rank's exit) and exits with status 2."""
    run = run_fairseq_tool("fairseq-train", [
        str(lm_data), *_REFUSED_LM, "--distributed-world-size", "2", "--distributed-backend", "gloo",
        "--save-dir", str(tmp_path / "ck")], timeout=300)
    assert run.returncode == EXIT, run.output[-3000:]
    lines = _error_lines(run.stderr)
    # each rank raises the same refusal; the parent stops the other rank once one has
    # ended, so one or both lines come
    assert 1 <= len(lines) <= 2, run.stderr[-3000:]
    ranks = {line.split(")")[0] for line in lines}
    assert ranks <= {"embrace: error: (rank 0", "embrace: error: (rank 1"} and len(ranks) == len(lines), lines
    assert all("UnsupportedWithSharding" in line and "--adaptive-input" in line for line in lines), lines
    assert "Traceback" not in run.stderr and "ProcessExitedException" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow  # ~10 s idle: an embrace-ds-train start-up
def test_ds_train_bad_embrace_key_is_one_line(lm_data, tmp_path):
    """embrace-ds-train with an unknown key in the "embrace" section: one line naming the
    key, status 2, no traceback, and no tensorboardX notice."""
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 8, "embrace": {"piece_byte": 1024}}')
    run = run_fairseq_tool("embrace-ds-train", [
        str(lm_data), "--task", "language_modeling", "--arch", "embrace_transformer_lm", "--cpu",
        "--deepspeed-config", str(config), "--max-tokens", "64", "--tokens-per-sample", "16",
        "--optimizer", "adam", "--lr", "0.001", "--save-dir", str(tmp_path / "ck"), "--max-update", "1"],
        timeout=120)
    _assert_one_line(run, "EmbraceConfigError", "piece_byte")
    assert "tensorboardX" not in run.output, run.output[-3000:]
