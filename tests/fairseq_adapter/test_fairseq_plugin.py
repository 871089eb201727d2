"""The fairseq plugin end to end: real fairseq-train under torchrun, real checkpoints,
real fairseq-generate / -interactive / -validate / -eval-lm.

Equivalence: the EmbRace architecture and the stock one, same seed and data, dropout 0,
give the same per-update loss and gradient norm (relative difference <= 1e-4), over 8
updates in the default run (20 in the slow cases). The EmbRace runs reduce their dense
gradients with the 2D schedule (``--embrace-schedule on``, the default), the stock ones
with ``--ddp-backend``'s reduction.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import embrace_fairseq.fairseq_adapter  # noqa: F401  (allow-lists fairseq checkpoint globals for torch.load)

from fairseq_corpus import (make_lm_corpus, make_translation_corpus, run_fairseq_tool, run_fairseq_tool_each,
                            run_fairseq_train)

PRECISE = {"EMBRACE_LOG_PRECISION": "8"}
REL = 1e-4
#: updates of the default run's trainings (a wrong gradient or table shows from the first
#: update on; each update costs a fraction of a second on two shared cores)
UPDATES = 8
#: updates of the slow cases
SLOW_UPDATES = 20

TINY_MT = [
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
TINY_LM = [
    "--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
    "--decoder-attention-heads", "2", "--tokens-per-sample", "32", "--sample-break-mode", "none",
]
COMMON = [
    "--cpu", "--distributed-backend", "gloo", "--dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "0.003", "--seed", "3", "--no-epoch-checkpoints",
    "--num-workers", "0", "--log-format", "json", "--log-interval", "1",
]


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    # 51 words + 4 specials, padded by fairseq to 56 rows: not divisible by 3.
    return make_translation_corpus(tmp_path_factory.mktemp("mt"), vocab_size=51, n_train=240, n_valid=24)


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("lm"), vocab_size=47, n_train=200, n_valid=20)


def _train(data, arch, save_dir, nproc, extra=(), task="translation", max_update=UPDATES):
    tiny = TINY_MT if task == "translation" else TINY_LM
    batch = ["--max-tokens", "120"] if task == "translation" else ["--max-tokens", "64"]
    args = [str(data), "--task", task, "--arch", arch, *tiny, *COMMON, *batch,
            "--max-update", str(max_update), "--save-dir", str(save_dir),
            "--ddp-backend", "legacy_ddp", *extra]
    return run_fairseq_train(args, nproc=nproc, env=PRECISE, timeout=400).check()


def _series(run, key):
    return [float(r[key]) for r in run.updates]


def _assert_same(stock, ours, what, n=UPDATES):
    for key in ("loss", "gnorm"):
        a, b = _series(stock, key), _series(ours, key)
        assert len(a) == len(b) == n, (what, key, len(a), len(b))
        worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
        assert worst <= REL, f"{what}: {key} differs by {worst:.2e} relative\nstock={a}\nours={b}"
    return max(abs(x - y) / abs(x) for x, y in zip(_series(stock, "loss"), _series(ours, "loss")))


SCHEDULED = "EmbRace 2D schedule:"  # what the scheduled wrapper logs when fairseq wraps the model
#: the default run's translation case: 2 ranks, untied tables, clipping, a checkpoint every 4
#: updates. Its two trainings serve two tests (equivalence and trace; checkpoint, resume,
#: validate). The LM on 3 ranks (uneven shards) with tied embeddings and update-freq 2 runs in
#: test_lm_three_ranks_and_eval_lm.
CASE = ("translation", "transformer", 2, ["--clip-norm", "0.05"])
RESUME_AT = UPDATES // 2
CKPT_FLAGS = ["--save-interval-updates", str(RESUME_AT)]

SLOW_CASES = [
    ("translation", "transformer", 3, ["--share-all-embeddings", "--update-freq", "2"]),
    ("language_modeling", "transformer_lm", 2, ["--share-decoder-input-output-embed", "--clip-norm", "0.05", "--update-freq", "2"]),
    ("translation", "transformer", 3, ["--share-decoder-input-output-embed", "--clip-norm", "0.05"]),
    ("language_modeling", "transformer_lm", 2, []),
    ("translation", "transformer", 2, ["--ddp-backend", "c10d", "--share-all-embeddings"]),
]


def _train_pair(case, data, tmp_path, ours_extra=(), max_update=SLOW_UPDATES):
    task, stock_arch, nproc, extra = case
    stock = _train(data, stock_arch, tmp_path / "stock", nproc, extra, task, max_update)
    ours = _train(data, "embrace_" + stock_arch, tmp_path / "ours", nproc, [*extra, *ours_extra], task, max_update)
    return stock, ours


def _assert_pair(case, stock, ours, scheduled=True, n=SLOW_UPDATES):
    _, stock_arch, nproc, extra = case
    assert (SCHEDULED in ours.output) is scheduled and SCHEDULED not in stock.output
    worst = _assert_same(stock, ours, f"{stock_arch} x{nproc} {' '.join(extra)}", n)
    print(f"{stock_arch} on {nproc} ranks {' '.join(extra)}: worst relative loss difference {worst:.2e}")


def _run_case(case, mt_data, lm_data, tmp_path, ours_extra=(), scheduled=True):
    stock, ours = _train_pair(case, mt_data if case[0] == "translation" else lm_data, tmp_path, ours_extra)
    _assert_pair(case, stock, ours, scheduled)
    return ours


@pytest.fixture(scope="module")
def mt_runs(mt_data, tmp_path_factory):
    """The default case trained by stock and by EmbRace (with --embrace-trace and checkpoints
    at updates 4 and 8, both runs alike): ``(stock run, EmbRace run, their folder)``."""
    tmp = tmp_path_factory.mktemp("mt_runs")
    stock, ours = _train_pair((*CASE[:3], [*CASE[3], *CKPT_FLAGS]), mt_data, tmp,
                              ours_extra=["--embrace-trace", str(tmp / "trace")], max_update=UPDATES)
    return stock, ours, tmp


def test_same_training_as_stock(mt_runs):
    """2 ranks, untied tables, clipping: the stock losses and gradient norms; with
    --embrace-trace: one trace per rank and the end-of-training summary."""
    stock, ours, tmp = mt_runs
    _assert_pair(CASE, stock, ours, n=UPDATES)
    assert "EmbRace summary (rank 0):" in ours.output and "hidden behind compute" in ours.output, ours.output[-2000:]
    for rank in range(CASE[2]):
        doc = json.loads((tmp / "trace" / f"trace.rank{rank}.json").read_text())
        names = {e["name"] for e in doc["traceEvents"]}
        assert {"forward", "backward", "dense_grad", "gradients_ready"} <= names, names
        summary = doc["otherData"]
        assert summary["bytes_by_kind"]["dense_grad"] > 0 and summary["dense_collectives"] > 0
        # the 2D schedule at work: dense pieces begin while their backward still runs
        assert summary["dense_started_in_backward"] > 0, summary


#: fairseq's --checkpoint-activations: each layer is recomputed in a backward of its own
#: inside the step's. Post-norm layers and a shared table, so every dense gradient comes in
#: one of those; 3 ranks (56 rows), gradient accumulation.
CHECKPOINTED = ("translation", "transformer", 3,
                ["--share-all-embeddings", "--checkpoint-activations", "--update-freq", "2"])


def test_checkpointed_activations_train_as_stock(mt_data, lm_data, tmp_path):
    stock, ours = _train_pair(CHECKPOINTED, mt_data, tmp_path, max_update=UPDATES)
    _assert_pair(CHECKPOINTED, stock, ours, n=UPDATES)


@pytest.mark.slow
def test_checkpointed_activations_in_the_single_thread_issue_mode(mt_data, lm_data, tmp_path, monkeypatch):
    """The same in the issue mode NCCL takes (pieces from the autograd thread, fences before
    the exchanges), forced on gloo."""
    monkeypatch.setenv("EMBRACE_SINGLE_THREAD_ISSUE", "1")
    stock, ours = _train_pair(CHECKPOINTED, mt_data, tmp_path, max_update=UPDATES)
    assert "followed from the autograd thread" in ours.output, ours.output[-3000:]
    _assert_pair(CHECKPOINTED, stock, ours, n=UPDATES)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: f"{c[1]}-{c[2]}ranks-{'_'.join(c[3])}")
def test_same_training_as_stock_more(case, mt_data, lm_data, tmp_path):
    _run_case(case, mt_data, lm_data, tmp_path)


@pytest.mark.slow
def test_node_aware_exchange_trains_as_stock(mt_data, lm_data, tmp_path):
    """4 ranks as 2 emulated nodes of 2 ranks: the node-aware exchange of a shared table
    (ids deduplicated per node) and the two-level dense all-reduce train as the stock
    model does."""
    case = ("translation", "transformer", 4, ["--share-all-embeddings"])
    ours = _run_case(case, mt_data, lm_data, tmp_path,
                     ours_extra=["--embrace-exchange", "node", "--embrace-ranks-per-node", "2",
                                 "--embrace-two-level-allreduce"])
    assert "EmbRace exchange: node-aware, 2 nodes x 2 ranks" in ours.output, ours.output[-3000:]


@pytest.mark.slow  # ~40 s: the schedule turned off gives fairseq's own wrapper
def test_schedule_off_keeps_fairseq_reduction(mt_data, lm_data, tmp_path):
    _run_case(("translation", "transformer", 2, ["--share-all-embeddings"]), mt_data, lm_data, tmp_path,
              ours_extra=["--embrace-schedule", "off"], scheduled=False)


def _valid_loss(run):
    return float(run.tagged("valid")[-1]["valid_loss"])


CKPT_EXTRA = ["--share-all-embeddings", "--save-interval-updates", "10"]


def _train_with_checkpoints(mt_data, tmp_path):
    full = _train(mt_data, "embrace_transformer", tmp_path / "full", 2, CKPT_EXTRA, max_update=SLOW_UPDATES)
    return full, tmp_path / "full" / "checkpoint_last.pt"


def _validate_args(mt_data, ckpt):
    # 24 valid sentences in batches of 4: 6 batches, an equal share for 1, 2 or 3 ranks
    # (stock fairseq-validate fails on a rank whose share of batches is empty).
    return [str(mt_data), "--path", str(ckpt), "--task", "translation", "--cpu", "--batch-size", "4",
            "--required-batch-size-multiple", "1", "--log-format", "json"]


def _assert_valid_loss(run, reported):
    got = float(run.tagged("valid")[-1]["valid_loss"]) if run.tagged("valid") else None
    assert got is not None and abs(got - reported) <= 1e-4 * abs(reported), (got, reported, run.output[-2000:])


def test_checkpoint_resume_and_validate(mt_data, mt_runs, tmp_path):
    """On the checkpoints of test_same_training_as_stock's EmbRace run (untied tables, 2
    ranks): full tables and their Adam moments in the checkpoint; resuming at update 4
    repeats updates 5..8; stock fairseq-validate on one process reports the validation loss
    training reported. (Tied tables' checkpoints: test_multilingual's default test compares
    them with stock; test_checkpoint_on_three_ranks_and_generation_tools, slow.)"""
    _, full, full_dir = mt_runs
    ckpt = full_dir / "ours" / "checkpoint_last.pt"
    from embrace_fairseq.fairseq_adapter.compat import fairseq_checkpoint_globals
    from embrace_fairseq.guards.safe_load import load as safe_load

    state = safe_load(str(ckpt), fairseq_checkpoint_globals(), map_location="cpu")  # weights_only=True
    vocab = 56  # fairseq pads the dictionary to a multiple of 8
    for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        assert state["model"][key].shape == (vocab, 16), key
    moments = [v for v in state["last_optimizer_state"]["state"].values() if "exp_avg" in v]
    assert sum(m["exp_avg"].shape == (vocab, 16) for m in moments) >= 2

    # Resume from update 4 on the same world size: updates 5..8 as uninterrupted.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copy(full_dir / "ours" / f"checkpoint_1_{RESUME_AT}.pt", resumed_dir / "checkpoint_last.pt")
    resumed = _train(mt_data, "embrace_transformer", resumed_dir, 2, [*CASE[3], *CKPT_FLAGS])
    tail = {int(r["num_updates"]): float(r["loss"]) for r in full.updates if int(r["num_updates"]) > RESUME_AT}
    again = {int(r["num_updates"]): float(r["loss"]) for r in resumed.updates}
    assert sorted(again) == sorted(tail) == list(range(RESUME_AT + 1, UPDATES + 1))
    for k, v in tail.items():
        assert abs(again[k] - v) <= REL * abs(v), (k, again[k], v)

    # The checkpoint of 2 ranks on 1 process: the validation loss training reported.
    _assert_valid_loss(run_fairseq_tool("fairseq-validate", _validate_args(mt_data, ckpt), env=PRECISE).check(),
                       _valid_loss(full))


@pytest.mark.slow  # ~40 s: three more launches of stock tools on the checkpoint
def test_checkpoint_on_three_ranks_and_generation_tools(mt_data, tmp_path):
    """The checkpoint of 2 ranks validated on 3 (uneven shards) as training reported;
    fairseq-generate and fairseq-interactive decode with it."""
    full, ckpt = _train_with_checkpoints(mt_data, tmp_path)
    three = run_fairseq_train(_validate_args(mt_data, ckpt) + ["--distributed-backend", "gloo"], nproc=3,
                              script="fairseq-validate", env=PRECISE, json_log=False).check()
    _assert_valid_loss(three, _valid_loss(full))
    gen = run_fairseq_tool("fairseq-generate", [str(mt_data), "--path", str(ckpt), "--cpu", "--beam", "2",
                                                "--max-tokens", "400", "--gen-subset", "test"]).check()
    assert "Generate test with beam=2" in gen.output and gen.output.count("\nH-") >= 5
    inter = run_fairseq_tool("fairseq-interactive", [str(mt_data), "--path", str(ckpt), "--cpu", "--beam", "2",
                                                     "--source-lang", "src", "--target-lang", "tgt"],
                             input_text="w1 w2 w3\nw4 w5\n").check()
    assert inter.output.count("\nH-") == 2


def _eval_lm(data, ckpts):
    """fairseq-eval-lm's loss (base 2) for each checkpoint (one process for all of them)."""
    runs = run_fairseq_tool_each("fairseq-eval-lm", [
        [str(data), "--path", str(ckpt), "--cpu", "--gen-subset", "valid", "--tokens-per-sample", "32",
         "--sample-break-mode", "none", "--max-tokens", "64", "--context-window", "0"] for ckpt in ckpts])
    lines = [[ln for ln in ev.output.splitlines() if "Loss (base 2):" in ln][-1] for ev in runs]
    return [float(line.split("Loss (base 2):")[1].split(",")[0]) for line in lines]


def test_lm_three_ranks_and_eval_lm(lm_data, tmp_path):
    """3 ranks (uneven shards), tied embeddings, clipping, update-freq 2; then fairseq-eval-lm on one
    process scores the EmbRace checkpoint exactly as it scores the stock one.

    (fairseq's in-training validation of an LM and fairseq-eval-lm count tokens
    differently, for the stock model too, so the two checkpoints are compared instead.)
    """
    extra = ["--share-decoder-input-output-embed", "--clip-norm", "0.05", "--update-freq", "2"]
    stock = _train(lm_data, "transformer_lm", tmp_path / "stock", 3, extra, "language_modeling")
    ours = _train(lm_data, "embrace_transformer_lm", tmp_path / "ours", 3, extra, "language_modeling")
    assert SCHEDULED in ours.output
    _assert_same(stock, ours, "transformer_lm x3 tied")
    assert abs(_valid_loss(stock) - _valid_loss(ours)) <= REL * _valid_loss(stock)
    a, b = _eval_lm(lm_data, [tmp_path / run / "checkpoint_last.pt" for run in ("stock", "ours")])
    assert abs(a - b) <= 1e-3, (a, b)  # eval-lm prints 4 decimals


STARTUP_ERRORS = [
    (["--arch", "embrace_transformer_lm", "--adaptive-input", "--adaptive-input-cutoff", "20",
      "--adaptive-softmax-cutoff", "20"], "--adaptive-input"),
    (["--arch", "embrace_transformer_lm", "--amp"], "--amp needs a CUDA device"),
]


@pytest.fixture(scope="module")
def startup_error_runs(lm_data, tmp_path_factory):
    """fairseq-train with each of STARTUP_ERRORS' flags, one process for all (each stops at start-up)."""
    tmp = tmp_path_factory.mktemp("startup_errors")
    return run_fairseq_tool_each("fairseq-train", [
        [str(lm_data), "--task", "language_modeling", *TINY_LM, "--cpu", "--optimizer", "adam", "--lr", "0.001",
         "--max-tokens", "64", "--max-update", "1", "--save-dir", str(tmp / str(i)), *flags]
        for i, (flags, _) in enumerate(STARTUP_ERRORS)], check=False)


@pytest.mark.parametrize("case", range(len(STARTUP_ERRORS)), ids=[m.strip("-") for _, m in STARTUP_ERRORS])
def test_startup_errors(case, startup_error_runs):
    run, message = startup_error_runs[case], STARTUP_ERRORS[case][1]
    assert run.returncode != 0 and message in run.output, run.output[-3000:]
    assert not run.updates
