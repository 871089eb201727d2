"""Command line: ``python -m embrace_fairseq.data_prep --out data [options]``."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import List, Optional

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.data_prep.errors import DataPrepError
from embrace_fairseq.data_prep.pipeline import (
    DEFAULT_LM_TEST_FROM,
    DEFAULT_LM_VALID_FROM,
    DEFAULT_TEST_MODULES,
    DEFAULT_VALID_MODULES,
    DEFAULT_VOCAB,
    prepare_deen,
    prepare_lm,
)
from embrace_fairseq.data_prep.manifest import load_manifest, write_manifest
from embrace_fairseq.guards import one_line_errors


class NotAFolderError(UserError, ValueError):
    """A folder option names an existing file."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m embrace_fairseq.data_prep",
                                description="Prepare the German-English (LibreOffice help) and "
                                            "English LM (State of the Union) data sets.")
    p.add_argument("--out", type=Path, default=Path("data"), help="output folder (default: data)")
    p.add_argument("--cache", type=Path, default=None,
                   help="download cache (default: <out>/cache)")
    p.add_argument("--only", choices=("all", "deen", "lm"), default="all")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                   help="joint de-en sentencepiece vocabulary (default: %(default)s)")
    p.add_argument("--lm-vocab-size", type=int, default=DEFAULT_VOCAB,
                   help="LM sentencepiece vocabulary (default: %(default)s)")
    p.add_argument("--max-train-pairs", type=int, default=None,
                   help="keep a deterministic subset of this many training pairs")
    p.add_argument("--no-ui-strings", action="store_true",
                   help="do not add the libreoffice-l10n-de UI strings to the training set")
    p.add_argument("--valid-modules", nargs="+", default=list(DEFAULT_VALID_MODULES))
    p.add_argument("--test-modules", nargs="+", default=list(DEFAULT_TEST_MODULES))
    p.add_argument("--lo-version", default=None,
                   help="Debian version of the LibreOffice packages (default: apt's candidate)")
    p.add_argument("--lm-valid-from", type=int, default=DEFAULT_LM_VALID_FROM)
    p.add_argument("--lm-test-from", type=int, default=DEFAULT_LM_TEST_FROM)
    p.add_argument("--force", action="store_true", help="redo every step")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


@one_line_errors.command
def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, path in (("--out", args.out), ("--cache", args.cache)):
        if path is not None and path.exists() and not path.is_dir():
            raise NotAFolderError(f"{flag} {path} is a file; name a folder (it is created if missing)")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    start = time.perf_counter()
    try:
        if args.only in ("all", "deen"):
            prepare_deen(args.out, args.cache, args.vocab_size, args.max_train_pairs,
                         not args.no_ui_strings, args.valid_modules, args.test_modules,
                         args.lo_version, force=args.force)
        if args.only in ("all", "lm"):
            prepare_lm(args.out, args.cache, args.lm_vocab_size, args.lm_valid_from,
                       args.lm_test_from, force=args.force)
    except DataPrepError as exc:  # a download, a package or a tool outside the code
        print(one_line_errors.one_line(exc), file=sys.stderr)
        return one_line_errors.USER_ERROR_EXIT
    write_manifest(args.out, load_manifest(args.out))
    logging.getLogger(__name__).info("finished in %.1f s; manifest: %s",
                                     time.perf_counter() - start, args.out / "manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
