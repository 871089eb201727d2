"""The main job: German-English LibreOffice help, EmbRace Transformer on CPU ranks, BLEU.

``python -m embrace_fairseq.recipes.main_job [--arch embrace_transformer] [--ranks 2] [--time-budget MIN] [--max-update N]``

1. prepares the data (idempotent; ``python -m embrace_fairseq.data_prep``),
2. trains with the documented command ``torchrun ... fairseq-train --user-dir user_dir``
   for what the time budget leaves (``--stop-time-hours``) or ``--max-update`` updates,
3. translates the held-out test modules with ``fairseq-generate``,
4. scores detokenised output with sacrebleu (BLEU and chrF, with signatures),
5. writes ``main_job[_<arch>].<kind>.json`` and its loss curve
   ``main_job[_<arch>].<kind>.loss.png`` to ``work_dirs/results/`` (ignored by git; with
   ``--record``, to ``results/``, the committed files the README cites), where the kind of run is ``from_nothing``
   (this job created the environment or prepared the data) or ``warm`` (both were there):
   the set-up and data minutes, and so the training minutes the budget leaves, differ by
   kind, so each kind keeps its own file and a later run of one never overwrites the
   other. Each file records the command typed and the commit it ran on.

``--arch transformer --max-update N --time-budget 0`` runs the same recipe with the stock
architecture for the N updates an EmbRace run reached: same seed, same batches.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from embrace_fairseq.perf.provenance import source_state
from embrace_fairseq.recipes.common import (REPO_ROOT, adam_inverse_sqrt, add_results_args, results_dir, RUN_ARGS, USER_DIR, child_env,
                                          fresh_save_dir, json_records, start_run, plot_losses, progress_printer, stream, tool,
                                          torchrun_train_cmd, versions)

# Sized so that set-up, data preparation, training and decoding fit in 30 minutes from a
# fresh clone on 2 cores: a small Transformer with tied embeddings over the joint vocabulary.
MODEL_ARGS = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--share-all-embeddings",
]
# The budget is time, not updates: 30 minutes from nothing (scripts/main_job.sh's start,
# set-up and data preparation included) on 2 cores. Training gets what set-up and data
# left, less a reserve for fairseq-train's start, its last validation and save, and
# decoding; fairseq stops it with --stop-time-hours (its training time, averaged over
# ranks, so every rank stops at the same update). Machines differ by 2x in speed here, so a
# fixed number of updates would either waste the budget or overrun it.
TIME_BUDGET_MIN = 30.0
RESERVE_MIN = 2.0
MIN_TRAIN_MIN = 5.0
# Small batches and a higher peak learning rate: in the few epochs the budget holds, more
# updates of 1,024 tokens per rank learn more per second than fewer of 2,048 (validation
# loss 7.65 after 400 such updates against 7.83 after 300 of 2,048, the same words seen).
# (Also tried: pre-norm, lr 3e-3, 1,300 updates: lower loss but repetition loops, BLEU 12.4.)
MAX_UPDATE = 4000  # a cap; the time budget ends training first on 2 cores
TRAIN_ARGS = [
    *adam_inverse_sqrt(lr="2e-3", warmup=200), "--weight-decay", "0.0001",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "1024", "--max-source-positions", "256", "--max-target-positions", "256",
    "--skip-invalid-size-inputs-valid-test", *RUN_ARGS,
]


def training_minutes(budget_min: float, spent_s: float, reserve_min: float = RESERVE_MIN,
                     floor_min: float = MIN_TRAIN_MIN) -> float:
    """Minutes of training left in ``budget_min`` after ``spent_s`` seconds of set-up and
    data, less ``reserve_min``; never below ``floor_min`` (the run then overruns the budget
    and says so).

    >>> training_minutes(30, 9 * 60), training_minutes(30, 40 * 60)
    (19.0, 5.0)
    """
    return max(floor_min, budget_min - spent_s / 60.0 - reserve_min)


#: the kinds of run, each with its own results file
KINDS = ("from_nothing", "warm")


def run_kind(environment_built: bool, data_built: bool) -> str:
    """``from_nothing`` when this job built the environment or the data, else ``warm``.

    >>> run_kind(False, False), run_kind(True, False), run_kind(False, True)
    ('warm', 'from_nothing', 'from_nothing')
    """
    return "from_nothing" if environment_built or data_built else "warm"


def results_name(tag: str, kind: str, suffix: str = ".json") -> str:
    """``main_job[_<arch>].<kind><suffix>``: one file per architecture and kind of run.

    >>> results_name("", "warm"), results_name("_transformer", "from_nothing", ".loss.png")
    ('main_job.warm.json', 'main_job_transformer.from_nothing.loss.png')
    """
    if kind not in KINDS:
        raise ValueError(f"kind of run {kind!r}: one of {', '.join(KINDS)}")
    return f"main_job{tag}.{kind}{suffix}"


def _environment_built_since(start: Optional[float], venv: Path = Path(sys.prefix)) -> bool:
    """Did ``scripts/setup.sh`` create the environment after ``start`` (the launcher's
    start)? Its stamp ``.embrace-setup-*`` is written last, once the environment is
    complete. Without a launcher start the recipe runs inside an existing environment."""
    if start is None:
        return False
    return any(os.path.getmtime(s) >= start for s in glob.glob(str(venv / ".embrace-setup-*")))


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train and evaluate the German-English main job.")
    p.add_argument("--arch", default="embrace_transformer", help="embrace_transformer or the stock transformer")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--time-budget", type=float, default=TIME_BUDGET_MIN, metavar="MIN",
                   help="minutes for the whole job from scripts/main_job.sh's start (or this recipe's); "
                        "training gets what is left after set-up and data; 0: no time limit")
    p.add_argument("--max-update", type=int, default=MAX_UPDATE,
                   help="stop after this many updates if the time budget has not ended training first "
                        "(for a run to compare with: the updates of results/main_job.warm.json and --time-budget 0)")
    p.add_argument("--data", type=Path, default=REPO_ROOT / "data")
    p.add_argument("--work-dir", type=Path, default=REPO_ROOT / "work_dirs" / "main_job")
    add_results_args(p)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--skip-data", action="store_true", help="use the prepared data as it is")
    p.add_argument("--skip-train", action="store_true", help="evaluate the checkpoint of an earlier run")
    return p.parse_args(argv)


def _train(a: argparse.Namespace, data_bin: Path, work: Path, earlier: Path,
           train_min: Optional[float]) -> Tuple[List[str], List[str], float, Path]:
    """Run (or, with --skip-train, reread) the documented fairseq-train command, stopped
    after ``train_min`` minutes of training or ``--max-update`` updates:
    (command, log lines, training seconds, checkpoint to evaluate)."""
    save_dir = work / "checkpoints" if a.skip_train else fresh_save_dir(work, "main job")
    stop = ["--stop-time-hours", f"{train_min / 60:.4f}"] if train_min else []
    train_cmd = torchrun_train_cmd(a.ranks, data_bin, [
        "--task", "translation", "--source-lang", "de", "--target-lang", "en",
        "--arch", a.arch, *MODEL_ARGS, *TRAIN_ARGS, "--cpu", "--distributed-backend", "gloo",
        "--ddp-backend", "legacy_ddp", "--max-update", str(a.max_update), *stop, "--save-dir", str(save_dir),
        # validate every 250 updates (at least four times) for the loss curve
        "--validate-interval-updates", str(max(1, min(250, a.max_update // 4))),
    ])
    until = f"{a.max_update} updates" + (f" or {train_min:.1f} minutes, whichever comes first" if train_min else "")
    print(f"[main job] training {a.arch} on {a.ranks} CPU ranks for {until}", flush=True)
    t1 = time.time()
    if a.skip_train:
        lines = (work / "train.log").read_text().splitlines()
        previous = json.loads(earlier.read_text()) if earlier.exists() else {}
        t_train = previous.get("wall_seconds", {}).get("train", 0.0)
    else:
        lines = stream(train_cmd, work / "train.log",
                       on_line=progress_printer("[train]", a.max_update, train_min * 60 if train_min else None))
        t_train = time.time() - t1
    ckpt = save_dir / "checkpoint_last.pt"
    if not ckpt.exists():
        ckpt = sorted(save_dir.glob("checkpoint_*_*.pt"))[-1]
    return train_cmd, lines, t_train, ckpt


def _translate(a: argparse.Namespace, data_bin: Path, raw: Path, work: Path, ckpt: Path) -> Tuple[List[str], List[str]]:
    """fairseq-generate on the held-out test set: (hypotheses in test order, references)."""
    gen = stream([tool("fairseq-generate"), str(data_bin), "--user-dir", str(USER_DIR), "--path", str(ckpt),
                  "--task", "translation", "--source-lang", "de", "--target-lang", "en", "--gen-subset", "test",
                  "--beam", str(a.beam), "--max-tokens", "4000", "--max-len-a", "1.2", "--max-len-b", "10",
                  # fairseq drops a last batch smaller than the multiple (8): translate every sentence
                  "--required-batch-size-multiple", "1", "--cpu", "--post-process", "sentencepiece",
                  "--skip-invalid-size-inputs-valid-test", "--num-workers", "0"],
                 work / "generate.log", env=child_env(threads=2))
    hyps = {}
    for line in gen:
        if line.startswith("D-"):
            idx, _score, text = line.split("\t", 2)
            hyps[int(idx[2:])] = text
    refs = (raw / "test.en").read_text(encoding="utf-8").splitlines()
    if len(hyps) != len(refs):
        raise RuntimeError(f"fairseq-generate translated {len(hyps)} of {len(refs)} test sentences")
    hyp_list = [hyps.get(i, "") for i in range(len(refs))]
    (work / "test.hyp.en").write_text("\n".join(hyp_list) + "\n", encoding="utf-8")
    return hyp_list, refs


def _setup_seconds(t0: float) -> Optional[float]:
    """Seconds ``scripts/main_job.sh`` spent setting up before this process started (it
    exports its start time as ``EMBRACE_JOB_T0``); None when the recipe was run directly."""
    start = os.environ.get("EMBRACE_JOB_T0")
    try:
        return max(0.0, t0 - float(start)) if start else None
    except ValueError:
        return None


def main(argv: Optional[List[str]] = None) -> int:
    a = _parse(argv)
    a.results = results_dir(a)
    t0 = time.time()
    t_setup = _setup_seconds(t0)
    launcher_start = None if t_setup is None else t0 - t_setup
    data_built = not (a.data / "deen" / "bin").exists()
    tag, work = start_run("main job", a.arch, "embrace_transformer", a.work_dir, a.data, a.skip_data)
    t_data = time.time() - t0
    data_bin = a.data / "deen" / "bin"
    raw = a.data / "deen" / "raw"
    if not data_bin.exists():
        raise SystemExit(f"no binarised data at {data_bin}; run without --skip-data")

    # 1) train: the documented command, nothing hidden, for what is left of the budget
    train_min = None
    if a.time_budget > 0 and not a.skip_train:
        spent = time.time() - t0 + (t_setup or 0.0)
        train_min = training_minutes(a.time_budget, spent)
        if train_min == MIN_TRAIN_MIN:
            print(f"[main job] set-up and data took {spent / 60:.1f} min: training for {MIN_TRAIN_MIN:.0f} min, "
                  f"beyond the {a.time_budget:.0f}-minute budget", flush=True)
    built = {"environment": _environment_built_since(launcher_start), "data": data_built}
    kind_file = work / "run_kind"  # --skip-train evaluates the checkpoint of the run that made it
    if a.skip_train and kind_file.exists():
        kind = kind_file.read_text().strip()
    else:
        kind = run_kind(built["environment"], built["data"])
        kind_file.write_text(kind + "\n")
    out = a.results / results_name(tag, kind)
    print(f"[main job] kind of run: {kind} (built now: environment {built['environment']}, "
          f"data {built['data']}); results go to {out}", flush=True)
    train_cmd, lines, t_train, ckpt = _train(a, data_bin, work, out, train_min)
    inner = json_records(lines, "train_inner")
    valid = json_records(lines, "valid")
    epochs = json_records(lines, "train")

    # 2) translate the held-out test set
    print("[main job] translating the test set with fairseq-generate", flush=True)
    t2 = time.time()
    hyp_list, refs = _translate(a, data_bin, raw, work, ckpt)
    t_gen = time.time() - t2

    # 3) score detokenised text with sacrebleu
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hyp_list, [refs])
    c = chrf.corpus_score(hyp_list, [refs])
    wall = time.time() - t0 + (t_train if a.skip_train else 0.0)
    wps = [float(r["wps"]) for r in inner if "wps" in r and float(r["wps"]) > 0]
    result = {
        "arch": a.arch,
        "kind": kind,
        # what this job built before training (the set-up and data minutes depend on it)
        "built": built,
        "ranks": a.ranks,
        # the last train_inner record is every 5 updates; the epoch's summary has the last one
        "updates": max([int(r["num_updates"]) for r in inner] + [int(r["train_num_updates"]) for r in epochs
                                                                 if "train_num_updates" in r] or [0]),
        "time_budget_min": a.time_budget or None,
        "train_minutes_allotted": None if train_min is None else round(train_min, 2),
        "bleu": round(b.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf": round(c.score, 2),
        "chrf_signature": str(chrf.get_signature()),
        "test_sentences": len(refs),
        "translated": len(hyp_list),
        "words_per_second": round(sum(wps) / len(wps), 1) if wps else None,
        "final_train_loss": float(epochs[-1]["train_loss"]) if epochs else None,
        "valid_loss": [(int(r["valid_num_updates"]), float(r["valid_loss"])) for r in valid],
        "wall_seconds": {"total": round(wall, 1), "data": round(t_data, 1), "train": round(t_train, 1),
                         "generate": round(t_gen, 1),
                         # before the recipe: scripts/main_job.sh's set-up (first run: the environment)
                         "setup": None if t_setup is None else round(t_setup, 1)},
        # what the user typed, for the README's table
        "recipe_command": " ".join(["scripts/main_job.sh" if t_setup is not None else "python -m embrace_fairseq.recipes.main_job",
                                    *(sys.argv[1:] if argv is None else argv)]),
        "model_args": MODEL_ARGS,
        "train_command": " ".join(train_cmd),
        "versions": versions(),
        "source": source_state(),
    }
    a.results.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    curves = {a.arch: {"train": [(int(r["num_updates"]), float(r["loss"])) for r in inner],
                       "valid": result["valid_loss"]}}
    png = plot_losses(curves, a.results / results_name(tag, kind, ".loss.png"), f"de-en LibreOffice help, {a.arch}")
    print(f"[main job] {b}")
    print(f"[main job] {c}")
    print(f"[main job] signature: {bleu.get_signature()}")
    since = "" if t_setup is None else f" ({(t_setup + wall) / 60:.1f} min with set-up)"
    print(f"[main job] done in {wall / 60:.1f} min{since}", flush=True)
    print(f"[main job]   results:      {out}", flush=True)
    if png:
        print(f"[main job]   loss plot:    {png}", flush=True)
    print(f"[main job]   translations: {work / 'test.hyp.en'} (references {raw / 'test.en'})", flush=True)
    print(f"[main job]   checkpoint:   {ckpt}; logs: {work / 'train.log'}, {work / 'generate.log'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
