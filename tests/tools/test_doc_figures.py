"""Every measured figure of README.md and docs/*.md is in the results file its paragraph
cites, and a quantity several pages state has one value."""
from __future__ import annotations

import json
from pathlib import Path

from embrace_fairseq.recipes import results_table
from embrace_fairseq.tools import doc_figures as D


def test_every_figure_of_the_pages_comes_from_its_results_file():
    problems = D.check(D.ROOT)
    assert problems == [], "\n".join(problems)


def _tree(tmp_path: Path, readme: str, **docs: str) -> Path:
    (tmp_path / "results" / "bench" / "run_a").mkdir(parents=True)
    (tmp_path / "results" / "job.warm.json").write_text(json.dumps(
        {"bleu": 25.31, "updates": 2267, "wall_seconds": {"train": 1689.6}, "hidden_share": 0.472}))
    (tmp_path / "results" / "job.from_nothing.json").write_text(json.dumps({"bleu": 21.85, "updates": 1246}))
    (tmp_path / "results" / "bench" / "run_a" / "report.md").write_text(
        "| model | over c10d |\n|---|---|\n| translation | 1.06x [1.02, 1.09] |\n")
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "docs").mkdir()
    for name, text in docs.items():
        (tmp_path / "docs" / f"{name}.md").write_text(text)
    return tmp_path


GOOD = ("# t\n\nWarm (`results/job.warm.json`): 28.2 minutes of training, 2,267 updates, BLEU 25.31,\n"
        "hidden 47 %. The run of `results/bench/run_a` gave 1.06x [1.02, 1.09] over c10d.\n\n"
        "Tested with Python 3.11 on 2 ranks, `--max-tokens 2048`, buckets of 25 MB.\n\n"
        "| model | over c10d |\n|---|---|\n| translation | 1.06x [1.02, 1.09] |\n")


def test_figures_match_their_source_as_rounded_and_converted(tmp_path):
    # minutes from seconds, per cent from a fraction, the interval from a report; the
    # versions and sizes of an uncited paragraph are not figures; the table takes its
    # caption's source
    root = _tree(tmp_path, GOOD.replace("| model", "From `results/bench/run_a`:\n\n| model", 1))
    assert D.check(root) == []


def test_a_wrong_figure_is_named_with_its_page_and_line(tmp_path):
    root = _tree(tmp_path, GOOD.replace("BLEU 25.31", "BLEU 25.41").replace("1.06x [1.02", "1.07x [1.02", 1))
    assert D.check(root) == [
        "README.md:3: 25.41 not in results/job.warm.json",
        "README.md:4: 1.07x [1.02, 1.09] not in results/bench/run_a",
    ]
    # an estimate and its interval are one figure: each number in the file is not enough
    root = _tree(tmp_path / "a", GOOD.replace("1.06x [1.02, 1.09] over", "1.09x [1.02, 1.06] over"))
    assert D.check(root) == ["README.md:4: 1.09x [1.02, 1.06] not in results/bench/run_a"]
    # rounded as printed: 1689.6 s is 28.2 and 28.16 minutes, not 28.3 nor 28.17
    for shown in ("28.16", "28.2"):
        assert D.check(_tree(tmp_path / shown, GOOD.replace("28.2 minutes", f"{shown} minutes"))) == []
    for shown in ("28.17", "28.3"):
        root = _tree(tmp_path / shown, GOOD.replace("28.2 minutes", f"{shown} minutes"))
        assert D.check(root) == [f"README.md:3: {shown} minutes not in results/job.warm.json"]


def test_figures_of_two_runs_share_a_sentence_only_when_it_names_both(tmp_path):
    mixed = ("# t\n\nRuns `results/job.warm.json` and `results/job.from_nothing.json`.\n"
             "Set-up left 1,246 updates and BLEU 25.31.\n")
    problems = D.check(_tree(tmp_path, mixed))
    assert len(problems) == 1 and "figures of several sources in one sentence" in problems[0], problems
    named = ("# t\n\nFrom nothing (`results/job.from_nothing.json`) BLEU 21.85, warm\n"
             "(`results/job.warm.json`) BLEU 25.31.\n")
    assert D.check(_tree(tmp_path / "b", named)) == []


def test_a_quantity_with_two_values_or_without_a_source_fails(tmp_path):
    root = _tree(tmp_path, "# t\n\n```bash\nscripts/fault_suite.sh   # all 27 scenarios\n```\n",
                 RELIABILITY="# r\n\n28 of 28 scenarios pass (`docs/reliability.json`).\n")
    (root / "docs" / "reliability.json").write_text("[]")
    assert D.check(root) == ["the number of fault scenarios: 2 values across the pages "
                             "(README.md:4 27; docs/RELIABILITY.md:3 28)"]
    root = _tree(tmp_path / "b", "# t\n\nThe main job reached BLEU 25.31 in the end.\n")
    assert D.check(root) == ["README.md:3: a BLEU score (25.31) given without a cited results file"]


def test_the_main_job_table_is_the_rendering_of_the_results_files(tmp_path):
    run = {"recipe_command": "scripts/main_job.sh", "updates": 10, "bleu": 1.0, "chrf": 2.0,
           "valid_loss": [[10, 9.5]], "words_per_second": 100.0, "bleu_signature": "nrefs:1",
           "wall_seconds": {"total": 600.0, "data": 60.0, "train": 480.0, "generate": 60.0, "setup": 0.0},
           "source": {"commit": "0123456789abcdef", "dirty": False}}
    root = _tree(tmp_path, "# t\n")
    (root / "results" / "main_job.warm.json").write_text(json.dumps(run))
    table = results_table.render(root / "results")
    page = f"# t\n\n{results_table.BEGIN}\n{table}\n{results_table.END}\n"
    (root / "README.md").write_text(page)
    assert D.check(root) == []
    (root / "README.md").write_text(page.replace("| 1.00 |", "| 1.50 |"))
    assert D.check(root) == ["README.md: the main-job table differs from the results files "
                             "(python -m embrace_fairseq.recipes.results_table --write PAGE)"]
