"""docs/CONFIG.md is what the code gives: every ``--embrace-*`` flag of the registered
architectures and every key of the DeepSpeed ``"embrace"`` section, regenerated and
compared with the committed page."""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from embrace_fairseq.deepspeed_adapter.config import EmbraceConfig
from embrace_fairseq.tools import config_reference as R
from embrace_fairseq.tools.doc_references import ROOT

PAGE = ROOT / "docs" / "CONFIG.md"


def test_the_committed_page_is_the_generated_one():
    assert PAGE.read_text() == R.reference(), (
        "docs/CONFIG.md differs from the code: python -m embrace_fairseq.tools.config_reference > docs/CONFIG.md")


def test_every_flag_of_the_sources_and_every_key_is_on_the_page():
    text = PAGE.read_text()
    # flags as the adapter's sources spell them, found without the generator's parsers
    sources = "\n".join(p.read_text() for p in (ROOT / "embrace_fairseq" / "fairseq_adapter").glob("*.py"))
    literal = set(re.findall(r"\"(--embrace-[a-z-]+)\"", sources))
    # and the fields of make_dataclass configurations: ("embrace_output", ChoiceEnum(...), field(...))
    literal |= {"--" + f.replace("_", "-") for f in re.findall(r"\(\"(embrace_[a-z_]+)\", [\w\[\]]+(?:\(|,)", sources)}
    assert {"--embrace-output", "--embrace-schedule"} <= literal
    for flag in literal:
        assert f"| `{flag}` |" in text, flag
    for f in dataclasses.fields(EmbraceConfig):
        assert f"| `{f.name}` |" in text, f.name
    assert f"{len(dataclasses.fields(EmbraceConfig))} keys" in text


def test_a_new_flag_or_key_appears_without_an_edit_of_the_generator():
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--embrace-new-thing", choices=["a", "b"], default="a", help="does a | b")
    parser.add_argument("--not-ours", default=1)
    (flag,) = R.flags_of({"embrace_x": parser})
    assert flag == R.Flag("--embrace-new-thing", ("a", "b"), "a", False, None, "does a \\| b", ("embrace_x",))

    @dataclasses.dataclass(frozen=True)
    class Extended(EmbraceConfig):
        """Like the real one.

        model_level: first line
            continued.
        """
        brand_new: int = 3

    keys = {k.name: k for k in R.deepspeed_keys(Extended)}
    assert keys["model_level"].description == "first line continued."
    assert keys["brand_new"].default == 3 and keys["brand_new"].description == R.NO_DESCRIPTION
    page = R.render([flag], keys.values())
    assert "| `--embrace-new-thing` | `a`, `b` | `a` | all | does a \\| b |" in page
    assert "| `brand_new` |" in page and f"{len(dataclasses.fields(Extended))} keys" in page


def test_check_names_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "CONFIG.md"
    stale.write_text("# old\n")
    assert R.main(["--check", str(stale)]) == 1
    assert "differs from the code" in capsys.readouterr().err
    stale.write_text(R.reference())
    assert R.main(["--check", str(stale)]) == 0


def test_the_page_is_linked_from_the_pages_that_describe_options():
    for page in ("FAIRSEQ.md", "DEEPSPEED.md"):
        assert "(CONFIG.md)" in (ROOT / "docs" / page).read_text(), page
    assert "(docs/CONFIG.md)" in (ROOT / "README.md").read_text()
    assert Path(PAGE).exists()
