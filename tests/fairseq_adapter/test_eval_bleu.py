"""``--eval-bleu`` validation of EmbRace models in real gloo ranks: every table gathered
once per validation, decoding with no collective, the stock architecture's hypotheses
and BLEU statistics exactly, on whole valid sets whose batches decode to different
lengths on different ranks."""
import pytest

import rank_fns_eval_bleu as R
from embrace_fairseq.tools.local_ranks import run_ranks
from fairseq_corpus import make_translation_corpus


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    # 51 words + 4 specials, padded by fairseq to 56 rows: uneven over 3 ranks
    return str(make_translation_corpus(tmp_path_factory.mktemp("bleu"), vocab_size=51, n_train=120, n_valid=40,
                                       min_len=2, max_len=14))


def _check(results, world):
    for r in results:
        stock, ours = r["stock"], r["ours"]
        assert ours["hyps"] == stock["hyps"] and len(ours["hyps"]) > 0
        for key, want in stock["totals"].items():
            got = ours["totals"][key]
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (key, got, want)
        # the first validation batch gathers each table once; nothing else communicates
        gathers = ours["collectives"]
        assert 0 < gathers[0] <= 2 * r["tables"] and not any(gathers[1:]), gathers
        assert not any(stock["collectives"])
        assert r["dropped_on_train"] and max(r["replica_vs_fresh_gather"]) == 0.0
    # at the same validation batch, ranks decoded different numbers of steps
    steps = [r["ours"]["decoder_calls"] for r in results]
    assert any(len(set(per_batch)) > 1 for per_batch in zip(*steps)), steps
    assert sum(r["ours"]["totals"]["_bleu_counts_0"] for r in results) > 0


def test_eval_bleu_two_ranks_tied(mt_data):
    """2 ranks, --share-all-embeddings: one table read by both lookups and the output
    layer. Freshly initialised weights (decoding runs to each batch's length limit)."""
    _check(run_ranks(R.eval_bleu_validation, 2, mt_data, ["--share-all-embeddings"], 0, timeout_s=240), 2)


@pytest.mark.slow
@pytest.mark.parametrize("world,flags,ours", [
    (3, [], []), (3, ["--share-decoder-input-output-embed"], []),
    (2, ["--share-all-embeddings"], ["--embrace-output", "gather", "--embrace-shard-layout", "contiguous"])])
def test_eval_bleu_trained_more_ranks(mt_data, world, flags, ours):
    """Briefly trained weights (hypotheses end at EOS, lengths differ by batch); 3 ranks
    with uneven shards, separate tables and an untied (sharded) or tied output layer."""
    _check(run_ranks(R.eval_bleu_validation, world, mt_data, flags, 60, ours, timeout_s=400), world)


@pytest.mark.slow
def test_fairseq_train_eval_bleu_matches_stock(mt_data, tmp_path):
    """Real torchrun fairseq-train on 2 ranks with --eval-bleu and --best-checkpoint-metric
    bleu: the valid lines (loss, BLEU) of the EmbRace architecture are the stock one's."""
    from fairseq_corpus import run_fairseq_train

    def train(arch, save):
        return run_fairseq_train([
            mt_data, "--task", "translation", "--arch", arch, *_eval_bleu_args(save),
            "--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"],
            nproc=2, env={"EMBRACE_LOG_PRECISION": "8"}, timeout=400).check()

    stock, ours = train("transformer", tmp_path / "stock"), train("embrace_transformer", tmp_path / "ours")
    _same_valid_lines(stock, ours)
    assert (tmp_path / "ours" / "checkpoint_best.pt").exists()


def _eval_bleu_args(save):
    return [*R.TINY, "--share-all-embeddings",
            "--optimizer", "adam", "--lr", "0.01", "--max-tokens", "120", "--max-update", "12", "--seed", "3",
            "--validate-interval-updates", "6", "--eval-bleu", "--eval-bleu-detok", "space",
            "--eval-bleu-args", '{"beam": 2, "max_len_a": 1.2, "max_len_b": 3}',
            "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric", "--num-workers", "0",
            "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints", "--save-dir", str(save)]


@pytest.mark.slow
def test_deepspeed_launcher_eval_bleu_matches_stock(mt_data, tmp_path):
    """embrace-ds-train (fairseq's loop with the DeepSpeed trainer) on 2 ranks with
    --eval-bleu: the valid lines (loss, BLEU) equal stock fairseq-train's."""
    import json

    from fairseq_corpus import run_ds_train, run_fairseq_train

    stock = run_fairseq_train([mt_data, "--task", "translation", "--arch", "transformer",
                               *_eval_bleu_args(tmp_path / "stock"), "--cpu", "--distributed-backend", "gloo",
                               "--ddp-backend", "legacy_ddp"],
                              nproc=2, env={"EMBRACE_LOG_PRECISION": "8"}, timeout=400).check()
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    ours = run_ds_train(mt_data, ["--task", "translation", "--arch", "embrace_transformer",
                                  *_eval_bleu_args(tmp_path / "ours")], ds_json,
                        env={"EMBRACE_LOG_PRECISION": "8"}, timeout=400).check()
    _same_valid_lines(stock, ours)
    assert (tmp_path / "ours" / "checkpoint_best.pt").exists()


def _same_valid_lines(stock, ours):
    keys = ("valid_loss", "valid_bleu")
    s = [[float(r[k]) for k in keys] for r in stock.tagged("valid")]
    o = [[float(r[k]) for k in keys] for r in ours.tagged("valid")]
    assert len(s) >= 2 and len(o) == len(s)
    for a, b in zip(s, o):
        assert abs(a[0] - b[0]) <= 1e-4 * abs(a[0]) and abs(a[1] - b[1]) <= 1e-3, (s, o)
