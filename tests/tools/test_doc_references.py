"""Every reference in README.md and docs/*.md resolves, and every results folder is cited."""
from __future__ import annotations

from pathlib import Path

from embrace_fairseq.tools import doc_references as D


def test_every_reference_of_the_pages_resolves():
    problems = D.check(D.ROOT)
    assert problems == [], "\n".join(problems)


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "embrace_fairseq" / "core").mkdir(parents=True)
    (tmp_path / "embrace_fairseq" / "core" / "__init__.py").write_text("")
    (tmp_path / "embrace_fairseq" / "core" / "trace.py").write_text("")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "OTHER.md").write_text("# other\n")
    for run in ("cited_run", "pooled_run", "stray_run"):
        (tmp_path / "results" / "bench" / run).mkdir(parents=True)
    (tmp_path / "results" / "bench" / "pooled.md").write_text("pools `results/bench/pooled_run`\n")
    return tmp_path


def test_each_kind_of_broken_reference_is_named(tmp_path):
    root = _tree(tmp_path)
    page = root / "README.md"
    page.write_text(
        "# t\n\nSee [other](docs/OTHER.md) and [gone](docs/GONE.md).\n\n"
        "```bash\n"
        "scripts/test.sh --max-tokens 10 --no-such-flag\n"
        "scripts/missing.sh\n"
        "python -m embrace_fairseq.no_such_module\n"
        "python -m json.tool x\n"
        "embrace-no-such-script DATA\n"
        "```\n\n"
        "`core/trace.hidden_share`, `core/nothere.py`, `results/bench/cited_run`, `results/bench/pooled.md`,\n"
        "`results/x.{json,md}`, `--embrace-*` flags, `-Wl,--linker-only,ALL`.\n")
    got = {(p.kind, p.text) for p in D.check_page(page, root)}
    assert got == {
        ("link", "docs/GONE.md"),
        ("flag", "--no-such-flag"),
        ("path", "scripts/missing.sh"),
        ("module", "embrace_fairseq.no_such_module"),
        ("script", "embrace-no-such-script"),
        ("path", "core/nothere.py"),
    }, got
    # the line numbers point at the reference
    by_text = {p.text: p.line for p in D.check_page(page, root)}
    assert by_text["docs/GONE.md"] == 3 and by_text["scripts/missing.sh"] == 7


def test_uncited_results_folders_are_listed(tmp_path):
    root = _tree(tmp_path)
    (root / "README.md").write_text("Runs: `results/bench/cited_run`; pooled in `results/bench/pooled.md`.\n")
    # pooled_run is cited through the pooled table a page cites; stray_run by nothing
    assert D.uncited_results(root) == ["results/bench/stray_run"]
    (root / "README.md").write_text("Runs: `results/bench/cited_run`.\n")
    assert D.uncited_results(root) == ["results/bench/pooled_run", "results/bench/stray_run"]


def test_the_results_index_maps_every_folder_and_is_no_citation(tmp_path):
    root = _tree(tmp_path)
    (root / "results" / "README.md").write_text(
        "| path | claim | page |\n|---|---|---|\n| `results/bench/cited_run` | a claim | README |\n"
        "| `results/bench/gone` | an old claim | nowhere |\n")
    assert D.index_problems(root) == [
        "results/bench/pooled_run: not in results/README.md",
        "results/bench/stray_run: not in results/README.md",
        "results/README.md: results/bench/gone: no such file or folder",
    ]
    # a page that links the index does not cite every folder the index names
    (root / "README.md").write_text("Runs: `results/bench/cited_run`; the index: `results/README.md`.\n")
    (root / "results" / "README.md").write_text("`results/bench/stray_run` `results/bench/pooled_run`\n")
    assert D.uncited_results(root) == ["results/bench/pooled_run", "results/bench/stray_run"]
    assert D.index_problems(root) == ["results/bench/cited_run: not in results/README.md"]
