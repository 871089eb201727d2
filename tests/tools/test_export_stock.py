"""``embrace_fairseq.tools.export_stock``: an EmbRace checkpoint as a stock fairseq one.

In process (default run): checkpoint dicts as fairseq's trainer writes them, for a tied
translation model, an untied one and a tied LM; the export holds no global that torch's
``weights_only`` loader refuses, builds the stock class through fairseq's own loader and
gives bit-identical outputs. Slow: real ``fairseq-train`` checkpoints, the command line,
``fairseq-generate`` and the hub interface in a process that never imports
``embrace_fairseq`` against the EmbRace checkpoint with ``--user-dir``, and LM sampling
with ``fairseq-generate --task language_modeling`` under numpy 2.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch

from embrace_fairseq.tools.export_stock import ExportError, export_state, stock_name
from fairseq_corpus import (REPO_ROOT, USER_DIR, fairseq_env, make_lm_corpus, make_translation_corpus,
                            run_fairseq_tool)

importlib.import_module("embrace_fairseq.fairseq_adapter")  # registers the EmbRace architectures

TINY_MT = [
    "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
LANGS = ["--source-lang", "src", "--target-lang", "tgt"]
TINY_LM = ["--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
           "--decoder-attention-heads", "2", "--tokens-per-sample", "32"]


def _dict_file(path, words=40):
    path.write_text("".join(f"w{i} {100 - i}\n" for i in range(words)))


@pytest.fixture(scope="module")
def mt_dicts(tmp_path_factory):
    """Dictionaries only: enough for fairseq to set up the task and build models."""
    d = tmp_path_factory.mktemp("export_mt_dicts")
    _dict_file(d / "dict.src.txt")
    _dict_file(d / "dict.tgt.txt")
    return d


@pytest.fixture(scope="module")
def lm_dicts(tmp_path_factory):
    d = tmp_path_factory.mktemp("export_lm_dicts")
    _dict_file(d / "dict.txt")
    return d


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    return make_translation_corpus(tmp_path_factory.mktemp("export_mt"), vocab_size=40, n_train=60, n_valid=12)


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("export_lm"), vocab_size=40, n_train=60, n_valid=12)


def _trainer_state(data, task_name, arch, flags):
    """A checkpoint dict as fairseq's Trainer.state_dict() writes it, for a fresh model."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", str(USER_DIR), "--task", task_name, "--arch", arch, *flags, "--cpu"])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(2)
    model = task.build_model(cfg.model)
    state = {"args": None, "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
             "model": model.state_dict(), "criterion": {},
             "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                    "lr_scheduler_state": {"best": None}, "num_updates": 0}],
             "task_state": {}, "extra_state": {"metrics": {}, "train_iterator": {"epoch": 1}},
             "last_optimizer_state": {"state": {}}}
    return state, task, model


def _export_and_reload(state, tmp_path):
    from fairseq import checkpoint_utils

    out = export_state(state)
    path = tmp_path / "stock.pt"
    torch.save(out, path)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    torch.load(path, weights_only=True)  # nothing to allow-list
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)])
    return out, models[0].eval(), task


@pytest.mark.parametrize("flags", [["--share-all-embeddings"], []], ids=["tied", "untied"])
def test_translation_export_is_the_stock_model(mt_dicts, tmp_path, flags):
    state, task, ours = _trainer_state(mt_dicts, "translation", "embrace_transformer_iwslt_de_en",
                                       TINY_MT + flags + LANGS + ["--embrace-shard-layout", "contiguous"])
    out, stock, _ = _export_and_reload(state, tmp_path)
    assert type(stock).__name__ == "TransformerModel" and type(stock).__module__.startswith("fairseq.")
    assert out["cfg"]["model"]["arch"] == "transformer_iwslt_de_en" and out["cfg"]["common"]["user_dir"] is None
    assert not any(k.startswith("embrace") for k in out["cfg"]["model"]) and "last_optimizer_state" not in out
    src = torch.tensor([[5, 9, 12, 2], [1, 7, 8, 2]])  # left-padded, as fairseq batches sources
    prev = torch.tensor([[2, 6, 11], [2, 13, 1]])
    ours.eval()
    with torch.no_grad():
        want = ours(src, torch.tensor([4, 3]), prev)[0]
        got = stock(src, torch.tensor([4, 3]), prev)[0]
    assert torch.equal(got, want)


def test_lm_export_is_the_stock_model(lm_dicts, tmp_path):
    state, task, ours = _trainer_state(lm_dicts, "language_modeling", "embrace_transformer_lm",
                                       TINY_LM + ["--share-decoder-input-output-embed"])
    out, stock, _ = _export_and_reload(state, tmp_path)
    assert type(stock).__name__ == "TransformerLanguageModel"
    assert out["cfg"]["model"]["_name"] == "transformer_lm"
    ids = torch.tensor([[2, 5, 9, 12, 7]])
    ours.eval()
    with torch.no_grad():
        assert torch.equal(stock(ids)[0], ours(ids)[0])


def test_refuses_what_it_cannot_export(mt_dicts):
    state, _, _ = _trainer_state(mt_dicts, "translation", "transformer", TINY_MT + LANGS)
    with pytest.raises(ExportError, match="not an EmbRace architecture: 'transformer'"):
        export_state(state)
    assert stock_name("embrace_transformer_lm_gpt") == "transformer_lm_gpt"


# ----------------------------------------------------------------------------- slow: real commands

_NO_PLUGIN = r"""
import json, sys
import torch
from fairseq.models.transformer import TransformerModel
hub = TransformerModel.from_pretrained(sys.argv[1], checkpoint_file=sys.argv[2], data_name_or_path=sys.argv[3], beam=2)
lines = json.loads(sys.argv[4])
torch.manual_seed(7)
out = {"translate": hub.translate(lines, beam=2),
       "sample": hub.sample(lines, sampling=True, sampling_topk=4),
       "score": [round(float(h[0]["score"]), 5) for h in hub.generate([hub.encode(s) for s in lines], beam=2)],
       "class": type(hub.models[0]).__module__ + "." + type(hub.models[0]).__name__,
       "plugin_imported": any(m.startswith("embrace_fairseq") for m in sys.modules)}
print("RESULT " + json.dumps(out))
"""


def _hub_result(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _train_one_process(data, task_name, arch, flags, save_dir):
    return run_fairseq_tool("fairseq-train", [
        str(data), "--task", task_name, "--arch", arch, *flags, "--optimizer", "adam", "--lr", "0.01",
        "--max-tokens", "200", "--required-batch-size-multiple", "1", "--max-update", "25", "--cpu", "--seed", "1", "--save-dir", str(save_dir),
        "--no-epoch-checkpoints", "--num-workers", "0"], timeout=400, check=True)


def _hypotheses(run):
    return [ln for ln in run.stdout.splitlines() if ln.startswith(("H-", "P-"))]


@pytest.mark.slow
def test_exported_translation_loads_without_plugin(mt_data, tmp_path):
    """fairseq-train checkpoint -> export command -> stock fairseq-generate and the hub in a
    process without the plugin: the EmbRace checkpoint's hypotheses and scores."""
    ckpt_dir, exp_dir = tmp_path / "ckpt", tmp_path / "export"
    exp_dir.mkdir()
    _train_one_process(mt_data, "translation", "embrace_transformer", TINY_MT + ["--share-all-embeddings"], ckpt_dir)
    subprocess.run([sys.executable, "-m", "embrace_fairseq.tools.export_stock", str(ckpt_dir / "checkpoint_last.pt"),
                    str(exp_dir / "model.pt")], env=fairseq_env(), cwd=REPO_ROOT, check=True, capture_output=True)
    gen = ["--gen-subset", "valid", "--beam", "2", "--cpu", "--batch-size", "4"]
    ours = run_fairseq_tool("fairseq-generate", [str(mt_data), "--path", str(ckpt_dir / "checkpoint_last.pt"), *gen],
                            check=True)
    stock = run_fairseq_tool("fairseq-generate", [str(mt_data), "--path", str(exp_dir / "model.pt"), *gen],
                             user_dir=None, check=True)
    assert _hypotheses(stock) == _hypotheses(ours) and _hypotheses(ours)

    lines = json.dumps(["w1 w2 w3", "w7 w5 w9 w11 w0"])
    env = fairseq_env()
    env["PYTHONPATH"] = ""  # the plugin cannot even be found
    no_plugin = _hub_result(subprocess.run(
        [sys.executable, "-c", _NO_PLUGIN, str(exp_dir), "model.pt", str(mt_data), lines],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300))
    assert no_plugin["class"] == "fairseq.models.transformer.transformer_legacy.TransformerModel"
    assert not no_plugin["plugin_imported"]
    with_plugin = _hub_result(subprocess.run(
        [sys.executable, "-c", _NO_PLUGIN.replace("beam=2)", f"beam=2, user_dir={str(USER_DIR)!r})"),
         str(ckpt_dir), "checkpoint_last.pt", str(mt_data), lines],
        env=fairseq_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300))
    assert with_plugin["class"].endswith("EmbraceTransformerModel")
    for key in ("translate", "sample", "score"):
        assert no_plugin[key] == with_plugin[key], key


@pytest.mark.slow
def test_lm_sampling_and_export(lm_data, tmp_path):
    """fairseq-generate --task language_modeling (sampling, eos break mode) runs with the
    user dir under numpy 2; the exported LM scores the same without the plugin."""
    ckpt_dir = tmp_path / "ckpt"
    _train_one_process(lm_data, "language_modeling", "embrace_transformer_lm",
                       TINY_LM + ["--share-decoder-input-output-embed", "--sample-break-mode", "none"], ckpt_dir)
    ckpt = str(ckpt_dir / "checkpoint_last.pt")
    sample = ["--task", "language_modeling", "--gen-subset", "valid", "--cpu", "--sampling", "--beam", "1",
              "--sampling-topk", "5", "--seed", "3", "--batch-size", "4", "--tokens-per-sample", "32",
              "--sample-break-mode", "eos", "--prefix-size", "1", "--max-len-b", "8"]
    run = run_fairseq_tool("fairseq-generate", [str(lm_data), "--path", ckpt, *sample], check=True)
    assert [ln for ln in run.stdout.splitlines() if ln.startswith("H-")]  # stock fairseq stops on numpy.compat
    out = tmp_path / "lm.pt"
    subprocess.run([sys.executable, "-m", "embrace_fairseq.tools.export_stock", ckpt, str(out)],
                   env=fairseq_env(), cwd=REPO_ROOT, check=True, capture_output=True)
    score = ["--task", "language_modeling", "--gen-subset", "valid", "--cpu", "--tokens-per-sample", "32",
             "--max-tokens", "64", "--context-window", "16"]
    ours = run_fairseq_tool("fairseq-eval-lm", [str(lm_data), "--path", ckpt, *score], check=True)
    stock = run_fairseq_tool("fairseq-eval-lm", [str(lm_data), "--path", str(out), *score], user_dir=None, check=True)

    def loss(run):
        return [ln.split("| ")[-1] for ln in run.output.splitlines() if "Loss (base 2)" in ln]

    assert loss(stock) == loss(ours) and loss(ours)
