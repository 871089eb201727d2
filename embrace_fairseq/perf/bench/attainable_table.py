"""What the cores allow over several benchmark runs: one table of
:mod:`embrace_fairseq.perf.bench.attainable`'s reckoning for every run key of every
results folder given (the report holds it for its own folder only)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from embrace_fairseq.perf.bench.markdown import attainable_section
from embrace_fairseq.perf.bench.report import attainable_check
from embrace_fairseq.perf.provenance import source_state


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m embrace_fairseq.perf.bench.attainable_table DIR... [--out FILE]``: the table
    of :func:`~.attainable.machine_limits` over the runs of every results folder (their ``bench.json``;
    folders written before the per-step CPU times were kept use their means), printed
    and, with ``--out``, written as Markdown with the commits the runs were measured on."""
    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.bench.attainable_table", description=main.__doc__)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    limits: Dict[str, Any] = {}
    sources = []
    for d in args.dirs:
        result = json.loads((d / "bench.json").read_text())
        commit = ((result["meta"].get("source") or {}).get("commit") or "?")[:7]
        sources.append(f"`{d}` (commit {commit})")
        for key, lim in attainable_check(result["runs"], result["meta"]).items():
            limits[f"{d.name}: {key}"] = lim
    state = source_state()
    lines = ([f"Runs: {', '.join(sources)}.", f"Table written by commit `{state.get('commit')}`.", ""]
             + attainable_section(limits))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
