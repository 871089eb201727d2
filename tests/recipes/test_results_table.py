"""The README's main-job table comes from the results files, marker to marker."""
import json

import pytest

from embrace_fairseq.recipes import results_table


def _result(bleu, setup):
    return {"recipe_command": "scripts/main_job.sh", "updates": 1500, "bleu": bleu, "chrf": 45.1, "valid_loss": [[750, 6.9], [1500, 6.1]],
            "words_per_second": 1234.5, "bleu_signature": "nrefs:1|tok:13a",
            "wall_seconds": {"total": 1300.0, "data": 50.0, "train": 1150.0, "generate": 40.0,
                             "setup": setup},
            "source": {"commit": "0123456789abcdef", "dirty": False}}


def test_table_from_results_and_readme_block_replaced(tmp_path):
    (tmp_path / "main_job.from_nothing.json").write_text(json.dumps(_result(20.5, 240.0)))
    stock = dict(_result(20.31, None), recipe_command="scripts/main_job.sh --arch transformer --max-update 1500 "
                                                      "--time-budget 0")
    (tmp_path / "main_job_transformer.warm.json").write_text(json.dumps(stock))
    table = results_table.render(tmp_path)
    rows = table.splitlines()
    assert rows[2].startswith("| EmbRace, from nothing | `scripts/main_job.sh` | 1500 | 20.50 | 45.10 | 6.100 | 1,234 | 4.0 min")
    assert rows[2].endswith("| 25.7 min | 0123456 |")
    assert "`scripts/main_job.sh --arch transformer --max-update 1500 --time-budget 0`" in rows[3]  # as typed
    assert "| n/a |" in rows[3] and rows[3].endswith("| 21.7 min (recipe only) | 0123456 |")  # run without the script
    assert "`nrefs:1|tok:13a`" in table

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{results_table.BEGIN}\nold figures\n{results_table.END}\nafter\n")
    results_table.write(readme, table)
    text = readme.read_text()
    assert "old figures" not in text and text.startswith("intro\n") and text.endswith("after\n")
    assert table in text


def test_each_kind_of_run_has_its_row_and_an_untraceable_file_is_refused(tmp_path):
    (tmp_path / "main_job.from_nothing.json").write_text(json.dumps(_result(20.5, 240.0)))
    (tmp_path / "main_job.warm.json").write_text(json.dumps(_result(25.0, 2.0)))
    rows = results_table.render(tmp_path).splitlines()
    assert rows[2].startswith("| EmbRace, from nothing |") and "| 20.50 |" in rows[2]
    assert rows[3].startswith("| EmbRace, warm |") and "| 25.00 |" in rows[3]
    (tmp_path / "main_job.warm.json").write_text(json.dumps(dict(_result(25.0, 2.0), source={})))
    with pytest.raises(ValueError, match="main_job.warm.json records no command or no commit"):
        results_table.render(tmp_path)


def test_no_results_or_no_markers_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        results_table.render(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        results_table.write(readme, "t")
