"""``embrace_roberta*`` (RoBERTa / XLM-R) against stock ``roberta``.

Default run: in process, one ``masked_lm`` step on 2 ranks, the LM head forced
vocab-parallel and one rank's batch without a masked token (it still takes part in every
collective, or the step would hang), then the gather path with the other rank's batch
empty: each rank's loss equals the stock model's, and the gradients (averaged over ranks,
the table's rows on their owners) equal the stock ones. Slow: the same on 3 ranks; the
real ``fairseq-train --user-dir user_dir`` on 2 ranks with the vocab-parallel head and
``--update-freq 2`` logging the stock per-update losses and gradient norms (relative 1e-4;
``fairseq-train`` itself, ``--update-freq 2`` and the vocab-parallel output under it are in
the default run with the translation families); 3 ranks (uneven shards), the automatic and gather
paths, ``embrace-ds-train``, ``sentence_prediction`` fine-tuning from a stock masked-LM
checkpoint, ``fairseq-validate``, the hub interface, and the export back to stock.

The vocabulary: 44 words + 4 specials + ``<mask>`` = 49 rows (``--padding-factor 1``),
divisible by neither 2 nor 3.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import embrace_fairseq.fairseq_adapter  # noqa: F401  (registers the architectures, allow-lists globals)
from embrace_fairseq.tools.local_ranks import run_ranks
from fairseq_corpus import (REPO_ROOT, USER_DIR, fairseq_env, make_classification_corpus, make_lm_corpus,
                            run_ds_train, run_fairseq_tool, run_fairseq_train)
from rank_fns_roberta import ROBERTA_MODEL, ROBERTA_TINY, masked_lm_steps

PRECISE = {"EMBRACE_LOG_PRECISION": "8"}
REL = 1e-4
VOCAB = 49
COMMON = [
    "--cpu", "--distributed-backend", "gloo", "--dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "0.003", "--seed", "3", "--no-epoch-checkpoints",
    "--num-workers", "0", "--log-format", "json", "--log-interval", "1", "--ddp-backend", "legacy_ddp",
]
MLM = ["--task", "masked_lm", "--criterion", "masked_lm", *ROBERTA_TINY, "--sample-break-mode", "none",
       "--mask-prob", "0.15", "--max-tokens", "64"]
FORCED = ["--embrace-output", "vocab-parallel"]


@pytest.fixture(scope="module")
def dict_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("roberta_dict")
    (d / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(VOCAB - 5)))
    return str(d)


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("roberta_lm"), vocab_size=VOCAB - 5, n_train=200, n_valid=20,
                          extra_preprocess_args=["--padding-factor", "1"])


def _check_step(results, world, mode, empty_rank, defer=False):
    for rank, res in enumerate(results):
        # deferred: only the table's gradient is owed after the backward; the bias, a
        # dense parameter, has its gradient for the all-reduce
        owed = 1 if defer and mode == "vocab-parallel" else 0
        assert res["owed"] == (owed, True), (rank, mode, res)
        (stock_loss, stock_size), (loss, size) = res["loss"]["stock"], res["loss"]["ours"]
        assert size == stock_size and (size == 0) == (rank == empty_rank), (rank, res)
        assert abs(loss - stock_loss) <= 1e-5 * max(1.0, abs(stock_loss)), (rank, mode, res)
        assert res["grad_rel"] <= 1e-5, (rank, mode, res)
        assert res["choice"] == ("vocab-parallel" if mode == "vocab-parallel" else "off"), (mode, res)
        assert res["shard_rows"] == len(range(rank, VOCAB, world))  # strided: 1/N of the rows


def test_masked_lm_step_empty_rank_two_ranks(dict_dir):
    configs = [dict(mode="vocab-parallel", empty_rank=1), dict(mode="vocab-parallel", empty_rank=0, defer=True),
               dict(mode="gather", empty_rank=0, defer=True)]
    results = run_ranks(masked_lm_steps, 2, dict_dir, configs, timeout_s=180)
    for i, c in enumerate(configs):
        _check_step([r[i] for r in results], 2, c["mode"], c["empty_rank"], c.get("defer", False))


def test_masked_lm_step_three_ranks(dict_dir):
    configs = [dict(mode="vocab-parallel", empty_rank=2), dict(mode="vocab-parallel", empty_rank=-1,
                                                                 layout="contiguous", arch="roberta_prenorm"),
               dict(mode="gather", empty_rank=1)]
    results = run_ranks(masked_lm_steps, 3, dict_dir, configs, timeout_s=240)
    for i, c in enumerate(configs):
        _check_step([r[i] for r in results], 3, c["mode"], c["empty_rank"])


# ----------------------------------------------------------------------------- fairseq-train


def _train(data, arch, save_dir, nproc, extra=(), max_update=10, script="fairseq-train"):
    args = [str(data), "--arch", arch, *MLM, *COMMON, "--max-update", str(max_update), "--save-dir", str(save_dir),
            *extra]
    return run_fairseq_train(args, nproc=nproc, env=PRECISE, timeout=400).check()


def _assert_same(stock, ours, what, n=10, gnorm_rel=REL):
    for key, tol in (("loss", REL), ("gnorm", gnorm_rel)):
        a = [float(r[key]) for r in stock.updates]
        b = [float(r[key]) for r in ours.updates]
        assert len(a) == len(b) == n, (what, key, len(a), len(b))
        worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
        assert worst <= tol, f"{what}: {key} differs by {worst:.2e} relative\nstock={a}\nours={b}"
        print(f"{what}: {key} worst relative difference {worst:.2e}")


def _took(run, path):
    return f"EmbRace output layer: {path}" in run.output


@pytest.mark.slow  # two fairseq-train launches; the default run has the in-process step above
def test_fairseq_train_vocab_parallel_update_freq_two_ranks(lm_data, tmp_path):
    extra = ["--update-freq", "2"]
    stock = _train(lm_data, "roberta", tmp_path / "stock", 2, extra)
    ours = _train(lm_data, "embrace_roberta", tmp_path / "ours", 2, [*extra, *FORCED])
    assert _took(ours, "vocab-parallel") and not _took(ours, "gather"), ours.output[-3000:]
    # deferred by default: each micro-batch's table gradient computed at the next loss or the step
    assert "table's gradient is computed after the backward" in ours.output, ours.output[-3000:]
    _assert_same(stock, ours, "roberta x2 vocab-parallel update-freq 2")


SLOW_CASES = [
    # (stock arch, ranks, extra for both, extra for ours, output path taken)
    ("roberta", 3, ["--update-freq", "2"], FORCED, "vocab-parallel"),
    # auto: about 10 masked positions a rank against a 49 x 16 table: the hidden states move fewer bytes
    ("roberta", 3, [], ["--embrace-output", "auto"], "vocab-parallel"),
    ("roberta", 2, ["--update-freq", "2", "--clip-norm", "0.05"], ["--embrace-output", "gather"], None),
    ("roberta_prenorm", 2, [], [*FORCED, "--embrace-shard-layout", "contiguous"], "vocab-parallel"),
    # the LM head's own V x D weight: replicated, the token table alone sharded
    ("roberta", 3, ["--untie-weights-roberta"], [], None),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: f"{c[0]}-{c[1]}ranks-{'_'.join(c[2] + c[3])}")
def test_fairseq_train_more(case, lm_data, tmp_path):
    arch, nproc, extra, ours_extra, path = case
    stock = _train(lm_data, arch, tmp_path / "stock", nproc, extra)
    ours = _train(lm_data, "embrace_" + arch, tmp_path / "ours", nproc, [*extra, *ours_extra])
    if path is not None:
        assert _took(ours, path), ours.output[-3000:]
    else:
        assert not _took(ours, "vocab-parallel")
    _assert_same(stock, ours, f"{arch} x{nproc} {' '.join(extra + ours_extra)}")


@pytest.mark.slow
@pytest.mark.parametrize("nproc,ours_extra", [(2, FORCED), (3, [])], ids=["2ranks-vocab-parallel", "3ranks-auto"])
def test_embrace_ds_train_same_losses_as_stock(lm_data, tmp_path, nproc, ours_extra):
    """embrace-ds-train (fairseq's loop, the DeepSpeed engine at ZeRO 0) with --update-freq 2:
    embrace_roberta against stock roberta under the same launcher (relative 1e-4). Stock
    roberta under embrace-ds-train itself differs from fairseq-train by about 1e-3 in the
    gradient norm (loss within 1e-4), from the DeepSpeed trainer's scaling before backward,
    the same for both architectures; that comparison is test_ds_fairseq_loop's."""
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    args = [*MLM, "--dropout", "0", "--attention-dropout", "0", "--optimizer", "adam", "--lr", "0.003", "--seed", "3",
            "--num-workers", "0", "--max-update", "10", "--update-freq", "2", "--no-save"]
    stock = run_ds_train(lm_data, ["--arch", "roberta", *args], ds_json, nproc=nproc, env=PRECISE).check()
    ds = run_ds_train(lm_data, ["--arch", "embrace_roberta", *args, *ours_extra], ds_json, nproc=nproc,
                      env=PRECISE).check()
    assert "DeepSpeed engine: ZeRO stage 0" in ds.output, ds.output[-3000:]
    assert _took(ds, "vocab-parallel"), ds.output[-3000:]
    assert "table's gradient is computed after the backward" in ds.output, ds.output[-3000:]  # deferred by default
    _assert_same(stock, ds, f"embrace-ds-train roberta x{nproc}")


# ----------------------------------------------------------------------------- fine-tuning, tools, hub

_HUB = r"""
import json, sys
import torch
from fairseq.models.roberta import RobertaModel
kw = json.loads(sys.argv[4])
if kw.pop("embrace", False):  # a stock checkpoint built as embrace_roberta
    from embrace_fairseq.fairseq_adapter.roberta import EmbraceRobertaModel as RobertaModel
hub = RobertaModel.from_pretrained(sys.argv[1], checkpoint_file=sys.argv[2], data_name_or_path=sys.argv[3], bpe=None, **kw)
hub.eval()
tokens = torch.tensor([0, 9, 12, 48, 7, 2])
with torch.no_grad():
    feats = hub.extract_features(tokens)
    logits = hub.model(tokens.unsqueeze(0))[0]
print("RESULT " + json.dumps({"features": feats.flatten().tolist(), "logits": logits[0, 3].tolist(),
                              "class": type(hub.model).__name__,
                              "plugin": any(m.startswith("embrace_fairseq") for m in sys.modules)}))
"""


def _hub(path_dir, ckpt, data, trust_pickle=False, **kw):
    env = fairseq_env()
    if "user_dir" not in kw:
        env["PYTHONPATH"] = ""  # stock fairseq only: the plugin cannot even be found
    if trust_pickle:  # a checkpoint stock fairseq-train wrote (an argparse.Namespace inside): stock's own switch
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    proc = subprocess.run([sys.executable, "-c", _HUB, str(path_dir), ckpt, str(data), json.dumps(kw)], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def _close(a, b, tol=1e-5):
    return max(abs(x - y) for x, y in zip(a, b)) <= tol * max(1.0, max(abs(x) for x in a))


@pytest.mark.slow
def test_stock_checkpoint_fine_tuned_validated_hub_and_exported(lm_data, tmp_path):
    """Stock roberta pretrains (fairseq-train, 1 rank); embrace_roberta fine-tunes it on
    2 ranks with --finetune-from-model for sentence_prediction and stock roberta does the
    same: same losses. fairseq-validate of the EmbRace masked-LM checkpoint equals
    stock's; the hub interface loads the stock checkpoint into embrace_roberta
    (EmbraceRobertaModel.from_pretrained) with the stock features and logits; the EmbRace checkpoint
    exported back loads in stock fairseq without the plugin, same outputs."""
    pre = tmp_path / "pre"
    _train(lm_data, "roberta", pre, 1, max_update=6)
    stock_ckpt = pre / "checkpoint_last.pt"
    cls = make_classification_corpus(tmp_path / "cls", vocab_size=VOCAB - 5, srcdict=lm_data / "dict.txt",
                                     timeout=400)
    ft = ["--task", "sentence_prediction", "--criterion", "sentence_prediction", "--num-classes", "3",
          "--init-token", "0", "--separator-token", "2", *ROBERTA_MODEL, "--max-positions", "32",
          "--max-tokens", "64", "--finetune-from-model", str(stock_ckpt), "--max-update", "8",
          "--dropout", "0", "--attention-dropout", "0", "--optimizer", "adam", "--lr", "0.003", "--seed", "3",
          "--no-epoch-checkpoints", "--num-workers", "0", "--cpu", "--distributed-backend", "gloo",
          "--ddp-backend", "legacy_ddp"]
    stock = run_fairseq_train([str(cls), "--arch", "roberta", *ft, "--save-dir", str(tmp_path / "ft_s")], nproc=2,
                              env=PRECISE, timeout=400).check()
    ours = run_fairseq_train([str(cls), "--arch", "embrace_roberta", *ft, "--save-dir", str(tmp_path / "ft_o")],
                             nproc=2, env=PRECISE, timeout=400).check()
    _assert_same(stock, ours, "sentence_prediction fine-tuned from a stock checkpoint", n=8)

    # masked LM: EmbRace checkpoint on 2 ranks, then validate, hub, export
    ours_dir = tmp_path / "ours"
    _train(lm_data, "embrace_roberta", ours_dir, 2, ["--restore-file", str(stock_ckpt), "--reset-optimizer",
                                                     "--reset-dataloader", "--reset-meters"], max_update=9)
    val = ["--task", "masked_lm", "--tokens-per-sample", "32", "--sample-break-mode", "none", "--cpu",
           "--max-tokens", "64", "--valid-subset", "valid", "--seed", "3", "--criterion", "masked_lm"]
    v_ours = run_fairseq_tool("fairseq-validate", [str(lm_data), "--path", str(ours_dir / "checkpoint_last.pt"),
                                                   *val], check=True)
    exported = tmp_path / "export"
    exported.mkdir()
    subprocess.run([sys.executable, "-m", "embrace_fairseq.tools.export_stock", str(ours_dir / "checkpoint_last.pt"),
                    str(exported / "model.pt")], env=fairseq_env(), cwd=REPO_ROOT, check=True, capture_output=True)
    v_stock = run_fairseq_tool("fairseq-validate", [str(lm_data), "--path", str(exported / "model.pt"), *val],
                               user_dir=None, check=True)

    def losses(run):  # "valid on 'valid' subset | loss 5.638 | ppl 49.8 | ..." (3 digits: stock has no precision hook)
        return [ln.split("| loss ")[1].split(" |")[0] for ln in run.output.splitlines()
                if "valid on 'valid' subset" in ln and "| loss " in ln]

    assert losses(v_ours) and losses(v_ours) == losses(v_stock), (v_ours.output[-2000:], v_stock.output[-2000:])

    plain = _hub(pre, "checkpoint_last.pt", lm_data, trust_pickle=True)
    into_ours = _hub(pre, "checkpoint_last.pt", lm_data, trust_pickle=True, user_dir=str(USER_DIR), embrace=True)
    assert into_ours["class"] == "EmbraceRobertaModel" and plain["class"] == "RobertaModel", into_ours["class"]
    assert _close(plain["features"], into_ours["features"]) and _close(plain["logits"], into_ours["logits"])
    trained = _hub(ours_dir, "checkpoint_last.pt", lm_data, user_dir=str(USER_DIR))
    back = _hub(exported, "model.pt", lm_data)
    assert not back["plugin"] and back["class"] == "RobertaModel"
    assert trained["features"] == back["features"] and trained["logits"] == back["logits"]
