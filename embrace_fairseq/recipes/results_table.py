"""The main-job table of docs/PERFORMANCE.md, rendered from the runs' results files.

``python -m embrace_fairseq.recipes.results_table [--results results] [--write docs/PERFORMANCE.md]``

Prints the table of the main job's results files, one row per architecture and kind of
run (``results/main_job.from_nothing.json``, ``results/main_job.warm.json``: EmbRace;
``results/main_job_transformer.warm.json``: the stock architecture, same recipe); with
``--write`` replaces the block between the ``main-job-table`` markers of that page, so
the figures a reader sees are those of the files in the repository, never typed by hand.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from embrace_fairseq.recipes.common import REPO_ROOT

BEGIN = "<!-- main-job-table:begin (python -m embrace_fairseq.recipes.results_table --write docs/PERFORMANCE.md) -->"
END = "<!-- main-job-table:end -->"

#: (results file, row label): one row per architecture and kind of run
RUNS = [
    ("main_job.from_nothing.json", "EmbRace, from nothing"),
    ("main_job.warm.json", "EmbRace, warm"),
    ("main_job_transformer.from_nothing.json", "stock `transformer`, from nothing"),
    ("main_job_transformer.warm.json", "stock `transformer`, warm"),
]


def _minutes(seconds: Optional[float]) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.1f} min"


def _row(label: str, command: str, r: Dict[str, Any]) -> str:
    wall = r.get("wall_seconds", {})
    valid = r.get("valid_loss") or []
    commit = (r.get("source") or {}).get("commit")
    dirty = (r.get("source") or {}).get("dirty")
    at = "n/a" if not commit else commit[:7] + (" (modified)" if dirty else "")
    wps = r.get("words_per_second")
    setup, total = wall.get("setup"), wall.get("total")
    whole = f"{_minutes(total)} (recipe only)" if setup is None else _minutes(setup + total)
    return (f"| {label} | `{command}` | {r['updates']} | {r['bleu']:.2f} | {r['chrf']:.2f} | "
            f"{valid[-1][1]:.3f} | {'n/a' if wps is None else f'{wps:,.0f}'} | "
            f"{_minutes(setup)} | {_minutes(wall.get('data'))} | {_minutes(wall.get('train'))} | "
            f"{_minutes(wall.get('generate'))} | {whole} | {at} |")


def render(results: Path) -> str:
    """The markdown table of the main-job results files found under ``results``."""
    rows: List[str] = []
    signature = None
    for name, label in RUNS:
        path = results / name
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        # a figure nobody can trace to its command and code does not go in the table
        if not r.get("recipe_command") or not (r.get("source") or {}).get("commit"):
            raise ValueError(f"{path} records no command or no commit (recipe_command, source.commit): "
                             "rerun the job to regenerate it")
        rows.append(_row(label, r["recipe_command"], r))
        signature = signature or r.get("bleu_signature")
    if not rows:
        raise FileNotFoundError(f"no main-job results under {results}")
    head = ("| run | command | updates | BLEU | chrF | final valid loss | train words/s | set-up | data | "
            "training | decoding | wall, set-up included | commit |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    sig = f"\n\nsacrebleu signature: `{signature}`" if signature else ""
    return "\n".join([head, *rows]) + sig


def write(readme: Path, table: str) -> None:
    """Replace the block between :data:`BEGIN` and :data:`END` in ``readme`` with ``table``."""
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no main-job-table markers")
    head, rest = text.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}", encoding="utf-8")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Render the main-job table of docs/PERFORMANCE.md from the results files.")
    p.add_argument("--results", type=Path, default=REPO_ROOT / "results")
    p.add_argument("--write", type=Path, default=None, help="page whose main-job-table block to replace")
    a = p.parse_args(argv)
    table = render(a.results)
    if a.write is not None:
        write(a.write, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
