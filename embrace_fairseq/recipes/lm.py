"""Language model recipe: State of the Union addresses, EmbRace Transformer LM, perplexity.

``python -m embrace_fairseq.recipes.lm [--arch embrace_transformer_lm] [--ranks 2] [--max-update N]``

Prepares the data (idempotent), trains with ``torchrun ... fairseq-train --user-dir
user_dir --task language_modeling``, scores the held-out years with ``fairseq-eval-lm``
and writes ``work_dirs/results/lm[_<arch>].json`` (``--record``: ``results/``) (with the command typed and the commit it ran on)
and a loss-curve PNG. ``--arch transformer_lm`` is the stock model with the same budget.
The job reports no set-up or data minutes (its figures do not depend on them), so one
file per architecture holds its latest run.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import List, Optional

from embrace_fairseq.perf.provenance import source_state
from embrace_fairseq.recipes.common import (ADAM_INVERSE_SQRT, REPO_ROOT, add_results_args, results_dir, RUN_ARGS, USER_DIR, fresh_save_dir, json_records, start_run,
                                          plot_losses, progress_printer, stream, tool, torchrun_train_cmd,
                                          versions)

MODEL_ARGS = [
    "--decoder-layers", "2", "--decoder-embed-dim", "256", "--decoder-ffn-embed-dim", "512",
    "--decoder-attention-heads", "4", "--share-decoder-input-output-embed",
    "--tokens-per-sample", "128", "--sample-break-mode", "none",
]
TRAIN_ARGS = [
    *ADAM_INVERSE_SQRT, "--weight-decay", "0.01", "--max-tokens", "2048", *RUN_ARGS,
]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Train and evaluate the State of the Union language model.")
    p.add_argument("--arch", default="embrace_transformer_lm")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--max-update", type=int, default=150)
    p.add_argument("--data", type=Path, default=REPO_ROOT / "data")
    p.add_argument("--work-dir", type=Path, default=REPO_ROOT / "work_dirs" / "lm")
    add_results_args(p)
    p.add_argument("--skip-data", action="store_true")
    a = p.parse_args(argv)
    a.results = results_dir(a)
    t0 = time.time()
    tag, work = start_run("lm", a.arch, "embrace_transformer_lm", a.work_dir, a.data, a.skip_data, only="lm")
    data_bin = a.data / "lm" / "bin"
    save_dir = fresh_save_dir(work, "lm")
    train_cmd = torchrun_train_cmd(a.ranks, data_bin, [
        "--task", "language_modeling", "--arch", a.arch, *MODEL_ARGS, *TRAIN_ARGS,
        "--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
        "--max-update", str(a.max_update), "--save-dir", str(save_dir),
        "--validate-interval-updates", str(max(a.max_update // 4, 1)),
    ])
    print(f"[lm] training {a.arch} on {a.ranks} CPU ranks for {a.max_update} updates", flush=True)
    t1 = time.time()
    lines = stream(train_cmd, work / "train.log", on_line=progress_printer("[train]", a.max_update))
    t_train = time.time() - t1
    inner, valid = json_records(lines, "train_inner"), json_records(lines, "valid")
    print("[lm] scoring the test years with fairseq-eval-lm", flush=True)
    ev = stream([tool("fairseq-eval-lm"), str(data_bin), "--user-dir", str(USER_DIR),
                 "--path", str(save_dir / "checkpoint_last.pt"), "--gen-subset", "test", "--cpu",
                 "--tokens-per-sample", "128", "--sample-break-mode", "none", "--context-window", "64",
                 "--max-tokens", "4096", "--num-workers", "0", "--required-batch-size-multiple", "1"],
                work / "eval_lm.log")
    m = [re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", ln) for ln in ev]
    loss, ppl = [(float(x.group(1)), float(x.group(2))) for x in m if x][-1]
    wps = [float(r["wps"]) for r in inner if float(r.get("wps", 0)) > 0]
    result = {
        "arch": a.arch, "ranks": a.ranks, "updates": int(inner[-1]["num_updates"]) if inner else 0,
        "test_loss_base2": loss, "test_perplexity": ppl,
        "eval": "fairseq-eval-lm --gen-subset test --tokens-per-sample 128 --context-window 64 (sentencepiece tokens)",
        "valid_loss": [(int(r["valid_num_updates"]), float(r["valid_loss"])) for r in valid],
        "words_per_second": round(sum(wps) / len(wps), 1) if wps else None,
        "wall_seconds": {"total": round(time.time() - t0, 1), "train": round(t_train, 1)},
        "recipe_command": " ".join(["python -m embrace_fairseq.recipes.lm", *(sys.argv[1:] if argv is None else argv)]),
        "model_args": MODEL_ARGS, "train_command": " ".join(train_cmd), "versions": versions(),
        "source": source_state(),
    }
    a.results.mkdir(parents=True, exist_ok=True)
    out = a.results / f"lm{tag}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot_losses({a.arch: {"train": [(int(r["num_updates"]), float(r["loss"])) for r in inner],
                          "valid": result["valid_loss"]}}, a.results / f"lm{tag}_loss.png", f"SOTU LM, {a.arch}")
    print(f"[lm] test perplexity {ppl:.2f} (loss {loss:.4f} bits/token) -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
