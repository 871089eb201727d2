"""The vocab-parallel output layer under real ``fairseq-train --user-dir user_dir``.

Equivalence: with ``--embrace-output vocab-parallel`` forced, the EmbRace architecture
logs the same per-update loss, nll_loss, ppl and gnorm as the stock one (same seed and
data, dropout 0) within 1e-4 relative, over 8 updates in the default run (20 in the slow
cases), with fairseq's own criteria.
The vocabulary is odd (``--padding-factor 1``: 55 rows), so shards are uneven on 2 and
3 ranks.
"""
from __future__ import annotations

import json

import pytest

import embrace_fairseq.fairseq_adapter  # noqa: F401  (allow-lists fairseq checkpoint globals for torch.load)

from fairseq_corpus import make_lm_corpus, make_translation_corpus, run_fairseq_tool, run_fairseq_train

PRECISE = {"EMBRACE_LOG_PRECISION": "8"}
REL = 1e-4
UPDATES = 8  # the default run's test (a wrong loss or gradient shows from the first update)
SLOW_UPDATES = 20
VOCAB = 55  # 51 words + 4 specials, no padding to a multiple of 8

from test_fairseq_plugin import TINY_LM, TINY_MT  # noqa: E402  (the plugin tests' tiny models)

COMMON = [
    "--cpu", "--distributed-backend", "gloo", "--dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "0.003", "--seed", "3", "--no-epoch-checkpoints",
    "--num-workers", "0", "--log-format", "json", "--log-interval", "1", "--ddp-backend", "legacy_ddp",
]
LS = ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--report-accuracy"]
FORCED = ["--embrace-output", "vocab-parallel"]


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    return make_translation_corpus(tmp_path_factory.mktemp("mt"), vocab_size=51, n_train=240, n_valid=24,
                                   extra_preprocess_args=["--padding-factor", "1"])


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("lm"), vocab_size=51, n_train=200, n_valid=20,
                          extra_preprocess_args=["--padding-factor", "1"])


@pytest.fixture(scope="module")
def any_lm_data(tmp_path_factory):
    """An LM corpus for a run that stops at start-up: test_fairseq_plugin's (same arguments), so
    a session that ran that module copies it instead of binarising another one."""
    return make_lm_corpus(tmp_path_factory.mktemp("any_lm"), vocab_size=47, n_train=200, n_valid=20)


def _train(data, arch, save_dir, nproc, extra=(), task="translation", max_update=SLOW_UPDATES, check=True):
    tiny = TINY_MT if task == "translation" else TINY_LM
    batch = ["--max-tokens", "120"] if task == "translation" else ["--max-tokens", "64"]
    args = [str(data), "--task", task, "--arch", arch, *tiny, *COMMON, *batch,
            "--max-update", str(max_update), "--save-dir", str(save_dir), *extra]
    run = run_fairseq_train(args, nproc=nproc, env=PRECISE, timeout=400)
    return run.check() if check else run


def _assert_same(stock, ours, what, keys=("loss", "nll_loss", "ppl", "gnorm"), n=SLOW_UPDATES):
    present = [k for k in keys if k in stock.updates[0]]  # cross_entropy logs nll_loss only with --sentence-avg
    assert {"loss", "ppl", "gnorm"} <= set(present), stock.updates[0]
    for key in present:
        a = [float(r[key]) for r in stock.updates]
        b = [float(r[key]) for r in ours.updates]
        assert len(a) == len(b) == n, (what, key, len(a), len(b))
        worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
        assert worst <= REL, f"{what}: {key} differs by {worst:.2e} relative\nstock={a}\nours={b}"
        print(f"{what}: {key} worst relative difference {worst:.2e} (last stock {a[-1]:.6g}, ours {b[-1]:.6g})")


def _took_vocab_parallel(run):
    return "EmbRace output layer: vocab-parallel" in run.output


def _run_case(data, task, stock_arch, nproc, extra, tmp_path, ours_extra=FORCED, max_update=SLOW_UPDATES):
    stock = _train(data, stock_arch, tmp_path / "stock", nproc, extra, task, max_update)
    ours = _train(data, "embrace_" + stock_arch, tmp_path / "ours", nproc, [*extra, *ours_extra], task, max_update)
    keys = ("loss", "nll_loss", "ppl", "gnorm") + (("accuracy",) if "--report-accuracy" in extra else ())
    _assert_same(stock, ours, f"{stock_arch} x{nproc} {' '.join(extra)}", keys, max_update)
    return stock, ours


def test_untied_label_smoothing_two_ranks(mt_data, tmp_path):
    """Untied output projection (sharded too), label smoothing, --ignore-prefix-size,
    --report-accuracy, --update-freq; the checkpoint holds the full projection."""
    extra = [*LS, "--ignore-prefix-size", "1", "--update-freq", "2", "--clip-norm", "0.05"]
    trace = tmp_path / "trace"
    stock, ours = _run_case(mt_data, "translation", "transformer", 2, extra, tmp_path,
                            ours_extra=[*FORCED, "--embrace-trace", str(trace)], max_update=UPDATES)
    assert _took_vocab_parallel(ours), ours.output[-3000:]
    # the criterion started every loss's token-count gather before the model's forward
    # (on the overlapped lane), none was gathered by the loss itself
    from embrace_fairseq.core.trace import TABLE_TID

    for rank in range(2):
        events = json.loads((trace / f"trace.rank{rank}.json").read_text())["traceEvents"]
        counts = [e["tid"] for e in events if e.get("name") == "softmax_stats" and e["args"].get("bytes") == 8]
        assert len(counts) >= 2 * UPDATES and set(counts) == {TABLE_TID}, counts  # one a micro-batch
    print([ln for ln in ours.output.splitlines() if "EmbRace output layer" in ln])
    from embrace_fairseq.fairseq_adapter.compat import fairseq_checkpoint_globals
    from embrace_fairseq.guards.safe_load import load as safe_load

    state = safe_load(str(tmp_path / "ours" / "checkpoint_last.pt"), fairseq_checkpoint_globals(), map_location="cpu")
    assert state["model"]["decoder.output_projection.weight"].shape == (VOCAB, 16)
    ref = safe_load(str(tmp_path / "stock" / "checkpoint_last.pt"), fairseq_checkpoint_globals(), map_location="cpu")
    assert set(state["model"]) == set(ref["model"])


def test_unsupported_criterion_stops_when_forced(any_lm_data, tmp_path):
    args = [str(any_lm_data), "--task", "language_modeling", "--arch", "embrace_transformer_lm", *TINY_LM,
            *COMMON, "--max-tokens", "64", "--max-update", "1", "--save-dir", str(tmp_path),
            "--criterion", "adaptive_loss", *FORCED]
    run = run_fairseq_train(args, nproc=2, timeout=300)
    assert run.returncode != 0 and "--embrace-output vocab-parallel needs the cross_entropy" in run.output, \
        run.output[-3000:]


SLOW_CASES = [
    # (task, stock arch, nproc, extra flags)
    ("translation", "transformer", 3, ["--share-all-embeddings", "--sentence-avg"]),
    # (with --ignore-prefix-size 1 added, this case departs from stock at update 7 by 1e-4 in gnorm
    # on both output paths: rounding-level parameter differences put one ReLU pre-activation of
    # the decoder's fc1 at -1.5e-8 in stock and +2.2e-8 here, which switches that unit's gradient;
    # the loss stays equal within 4e-6. See the README's limitations.)
    ("translation", "transformer", 3, [*LS, "--share-decoder-input-output-embed"]),
    ("translation", "transformer", 2, [*LS, "--share-all-embeddings", "--update-freq", "2"]),
    ("translation", "transformer", 3, []),
    ("language_modeling", "transformer_lm", 3, ["--share-decoder-input-output-embed", "--update-freq", "2"]),
    ("language_modeling", "transformer_lm", 2, []),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: f"{c[1]}-{c[2]}ranks-{'_'.join(c[3])}")
def test_same_training_as_stock_more(case, mt_data, lm_data, tmp_path):
    task, stock_arch, nproc, extra = case
    data = mt_data if task == "translation" else lm_data
    _, ours = _run_case(data, task, stock_arch, nproc, extra, tmp_path)
    assert _took_vocab_parallel(ours), ours.output[-3000:]


@pytest.mark.slow
def test_auto_and_tools(mt_data, tmp_path):
    """auto picks per step (tiny batches, V=55 > N*T only when few tokens); the
    checkpoint of a sharded untied projection loads in stock fairseq-generate."""
    extra = [*LS]
    stock = _train(mt_data, "transformer", tmp_path / "stock", 2, extra)
    ours = _train(mt_data, "embrace_transformer", tmp_path / "ours", 2, [*extra, "--embrace-output", "auto"])
    _assert_same(stock, ours, "auto")
    assert "EmbRace output layer: " in ours.output
    ckpt = tmp_path / "ours" / "checkpoint_last.pt"
    gen = run_fairseq_tool("fairseq-generate", [str(mt_data), "--path", str(ckpt), "--cpu", "--beam", "2",
                                                "--max-tokens", "400", "--gen-subset", "test"]).check()
    assert gen.output.count("\nH-") >= 5
