"""Tiny synthetic corpora and launchers for tests that run the real fairseq command-line tools.

Everything runs in real processes (``fairseq-preprocess``, ``torchrun ... fairseq-train``,
``fairseq-generate``), from the virtual environment that runs the tests, so the tests exercise
exactly what a user types.

* :func:`make_translation_corpus` / :func:`make_lm_corpus` write random-token text over a small
  vocabulary and binarise it with ``fairseq-preprocess``; they return the data-bin folder.
* :func:`run_fairseq_train` launches ``torchrun --nproc_per_node N fairseq-train ...`` on a free
  port and parses the ``--log-format json`` records.
* :func:`run_fairseq_tool` runs any other console script (``fairseq-generate``, ...) in one process.
"""
from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from embrace_fairseq.tools.local_ranks import free_port  # noqa: F401  (re-exported for tests)

REPO_ROOT = Path(__file__).resolve().parents[2]
USER_DIR = REPO_ROOT / "user_dir"
# The venv's bin folder, found from the running interpreter. Not resolved: the interpreter is
# usually a symlink to the base Python, whose bin folder has no fairseq scripts.
VENV_BIN = Path(sys.executable).parent

PathLike = Union[str, os.PathLike]

# "2026-01-01 00:00:00 | INFO | train_inner | {...}": fairseq's log format (fairseq_cli/*.py).
_LOG_LINE = re.compile(r"^\S+ \S+ \| (?P<level>[A-Z]+) \| (?P<name>[^|]+?) \| (?P<msg>.*)$")
# fairseq-hydra-train logs through hydra's formatter: [time][name][LEVEL] - message
_HYDRA_LOG_LINE = re.compile(r"^\[[^\]]+\]\[(?P<name>[^\]]+)\]\[(?P<level>[A-Z]+)\] - (?P<msg>.*)$")


def venv_script(name: str) -> str:
    """Absolute path of a console script (``fairseq-train``, ``torchrun``...) of the test venv."""
    path = VENV_BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found in {VENV_BIN}")
    return str(path)


def fairseq_env(
    env: Optional[Mapping[str, str]] = None, *, keep_weights_only_override: bool = False
) -> Dict[str, str]:
    """Environment for a fairseq child process.

    - ``PYTHONPATH`` gets the repository root, so ``--user-dir user_dir`` can import
      ``embrace_fairseq`` without an editable install.
    - ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is removed unless asked for: tests must show that
      checkpoints load under torch's default ``weights_only=True``.
    - One OpenMP thread per process: the ranks share a couple of cores.
    - ``env`` entries are applied last and win.
    """
    out = dict(os.environ)
    if not keep_weights_only_override:
        out.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    # A stale torchrun environment from an outer launcher would make a child believe it is a rank.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(key, None)
    paths = [str(REPO_ROOT)] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    out.setdefault("OMP_NUM_THREADS", "1")
    out.setdefault("DS_ACCELERATOR", "cpu")
    if env:
        out.update(env)
    return out


def _run(cmd: Sequence[str], *, cwd: Optional[PathLike], env: Mapping[str, str], timeout: float,
         check: bool, input_text: Optional[str] = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            list(cmd), cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout,
            input=input_text, stdin=None if input_text is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out[-4000:]}\n"
            f"--- stderr\n{err[-4000:]}"
        ) from None
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


# --------------------------------------------------------------------------- corpora


def _random_sentences(rng: random.Random, n: int, vocab: Sequence[str], min_len: int,
                      max_len: int) -> List[List[str]]:
    return [[rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _write_lines(path: Path, sentences: Sequence[Sequence[str]]) -> None:
    path.write_text("".join(" ".join(s) + "\n" for s in sentences), encoding="utf-8")



def fresh_corpus(tmpdir: PathLike, seed: int, vocab_size: int, outputs: Sequence[str] = ("data-bin",)):
    """What every corpus builder starts from: ``(tmp, raw, output folders, rng, vocab)`` with
    ``tmp/raw`` created, the output folders under ``tmp`` removed (fairseq-preprocess refuses
    an existing dictionary), a generator seeded with ``seed`` and the words ``w0``..``w{V-1}``."""
    tmp = Path(tmpdir)
    raw = tmp / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    folders = tuple(tmp / name for name in outputs)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return tmp, raw, folders, random.Random(seed), [f"w{i}" for i in range(vocab_size)]


#: pristine copies of the corpora built in this process: {(builder, its arguments): folder}
_BUILT: Dict[Any, Path] = {}


def _reused_when_built_before(builder):
    """A corpus builder that, called again in the same process with the same arguments (but
    another ``tmpdir``), copies the first build's ``raw`` and output folders into ``tmpdir``
    instead of running ``fairseq-preprocess`` again (a process start and an import of fairseq,
    about 5 s on two cores; several test modules binarise the same corpus). The copy is made
    from a private pristine copy, so a test that damages its data cannot reach another."""
    signature = inspect.signature(builder)

    @functools.wraps(builder)
    def build(tmpdir: PathLike, **kwargs: Any) -> Path:
        bound = signature.bind(tmpdir, **kwargs)
        bound.apply_defaults()
        key = (builder.__name__, json.dumps({k: v for k, v in bound.arguments.items() if k not in ("tmpdir", "timeout",
                                                                                                   "in_process")},
                                            sort_keys=True, default=str))
        tmp = Path(tmpdir)
        if key not in _BUILT:
            dest = builder(tmpdir, **kwargs)
            pristine = Path(tempfile.mkdtemp(prefix="embrace_corpus_"))
            atexit.register(shutil.rmtree, pristine, True)
            for sub in ("raw", dest.name):
                shutil.copytree(tmp / sub, pristine / sub)
            _BUILT[key] = pristine
            return dest
        pristine = _BUILT[key]
        tmp.mkdir(parents=True, exist_ok=True)
        for sub in pristine.iterdir():
            shutil.rmtree(tmp / sub.name, ignore_errors=True)
            shutil.copytree(sub, tmp / sub.name)
        return tmp / "data-bin"

    return build


@_reused_when_built_before
def make_translation_corpus(
    tmpdir: PathLike,
    *,
    n_train: int = 300,
    n_valid: int = 30,
    n_test: int = 20,
    vocab_size: int = 50,
    min_len: int = 3,
    max_len: int = 12,
    src: str = "src",
    tgt: str = "tgt",
    seed: int = 0,
    extra_preprocess_args: Sequence[str] = (),
    timeout: float = 120,
) -> Path:
    """Write a random parallel corpus and binarise it with a joined dictionary.

    The target is a fixed word-for-word mapping of the source (a permutation of the vocabulary),
    reversed, so a model can learn something. Raw text goes to ``tmpdir/raw``, binarised data to
    ``tmpdir/data-bin``, which is returned (``train``, ``valid``, ``test`` splits).
    """
    tmp, raw, (dest,), rng, vocab = fresh_corpus(tmpdir, seed, vocab_size)
    perm = vocab[:]
    rng.shuffle(perm)
    mapping = dict(zip(vocab, perm))
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        sents = _random_sentences(rng, n, vocab, min_len, max_len)
        _write_lines(raw / f"{split}.{src}", sents)
        _write_lines(raw / f"{split}.{tgt}", [[mapping[w] for w in reversed(s)] for s in sents])
    cmd = [
        venv_script("fairseq-preprocess"),
        "--source-lang", src, "--target-lang", tgt,
        "--trainpref", str(raw / "train"), "--validpref", str(raw / "valid"),
        "--testpref", str(raw / "test"),
        "--destdir", str(dest), "--joined-dictionary", "--workers", "1",
        *extra_preprocess_args,
    ]
    _run(cmd, cwd=tmp, env=fairseq_env(), timeout=timeout, check=True)
    return dest


@_reused_when_built_before
def make_lm_corpus(
    tmpdir: PathLike,
    *,
    n_train: int = 300,
    n_valid: int = 30,
    n_test: int = 20,
    vocab_size: int = 50,
    min_len: int = 5,
    max_len: int = 20,
    seed: int = 0,
    extra_preprocess_args: Sequence[str] = (),
    timeout: float = 120,
) -> Path:
    """Write a random monolingual corpus and binarise it (``--only-source``) for language models.

    Returns ``tmpdir/data-bin`` with ``train``, ``valid``, ``test`` splits.
    """
    tmp, raw, (dest,), rng, vocab = fresh_corpus(tmpdir, seed, vocab_size)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        _write_lines(raw / f"{split}.txt", _random_sentences(rng, n, vocab, min_len, max_len))
    cmd = [
        venv_script("fairseq-preprocess"), "--only-source",
        "--trainpref", str(raw / "train.txt"), "--validpref", str(raw / "valid.txt"),
        "--testpref", str(raw / "test.txt"),
        "--destdir", str(dest), "--workers", "1",
        *extra_preprocess_args,
    ]
    _run(cmd, cwd=tmp, env=fairseq_env(), timeout=timeout, check=True)
    return dest


# --------------------------------------------------------------------------- launching

#: torchrun settings (as ``PET_*`` environment variables, so they reach any torchrun, also one a
#: script starts) under which each worker's lines carry its rank, ``[default<rank>]:``, and the
#: agent looks for failed workers once a second: a rank's own error is printed before the agent
#: stops the other workers.
PER_RANK_OUTPUT = {"PET_TEE": "3", "PET_MONITOR_INTERVAL": "1"}


def rank_lines(output: str, rank: int) -> List[str]:
    """The lines worker ``rank`` itself printed (output of a torchrun run with
    :data:`PER_RANK_OUTPUT`), without their prefix."""
    prefix = f"[default{rank}]:"
    return [ln[len(prefix):] for ln in output.splitlines() if ln.startswith(prefix)]



@dataclass
class FairseqRun:
    """Outcome of one fairseq command: exit code, raw output and the parsed JSON log records."""

    cmd: List[str]
    returncode: int
    stdout: str
    stderr: str
    # Every "{...}" log message, in order, with its logger name under "_tag"
    # ("train_inner" per update, "train"/"valid" per epoch, ...).
    records: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    @property
    def updates(self) -> List[Dict[str, Any]]:
        """Per-update records (``train_inner``; one per ``--log-interval`` updates)."""
        return [r for r in self.records if r["_tag"] == "train_inner"]

    def tagged(self, tag: str) -> List[Dict[str, Any]]:
        return [r for r in self.records if r["_tag"] == tag]

    def check(self) -> "FairseqRun":
        """Raise with the tail of the output unless the command succeeded; returns self."""
        if self.returncode != 0:
            raise AssertionError(
                f"exit {self.returncode}: {' '.join(self.cmd)}\n--- stdout\n{self.stdout[-4000:]}"
                f"\n--- stderr\n{self.stderr[-6000:]}"
            )
        return self


def parse_json_records(text: str) -> List[Dict[str, Any]]:
    """JSON log records from fairseq output (``--log-format json``; fairseq-hydra-train's
    ``common.log_format=json`` too), each with ``_tag`` set."""
    records = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line.strip()) or _HYDRA_LOG_LINE.match(line.strip())
        if not m or not m.group("msg").startswith("{"):
            continue
        try:
            rec = json.loads(m.group("msg"))
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            rec["_tag"] = m.group("name").strip()
            records.append(rec)
    return records


def run_fairseq_train(
    args: Sequence[str],
    nproc: int = 2,
    *,
    timeout: float = 300,
    cwd: Optional[PathLike] = None,
    env: Optional[Mapping[str, str]] = None,
    user_dir: Optional[PathLike] = USER_DIR,
    json_log: bool = True,
    torchrun_args: Sequence[str] = (),
    script: str = "fairseq-train",
    check: bool = False,
    keep_weights_only_override: bool = False,
) -> FairseqRun:
    """Run ``torchrun --nproc_per_node nproc <venv>/bin/<script> <args>`` and parse its log.

    ``args`` are passed through as given (data path, ``--arch``, ``--cpu``, ...). Added unless
    already present: ``--user-dir user_dir`` (pass ``user_dir=None`` to leave it out) and, when
    ``json_log``, ``--log-format json --log-interval 1`` so every update is one record. The
    master port is a free one. ``check=True`` raises on a non-zero exit; otherwise inspect
    ``returncode``/``stdout``/``stderr`` of the result.
    """
    args = list(args)
    if user_dir is not None and "--user-dir" not in args:
        args += ["--user-dir", str(user_dir)]
    if json_log:
        if "--log-format" not in args:
            args += ["--log-format", "json"]
        if "--log-interval" not in args:
            args += ["--log-interval", "1"]
    cmd = [
        venv_script("torchrun"),
        "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()),
        *torchrun_args,
        venv_script(script),
        *args,
    ]
    child_env = fairseq_env(env, keep_weights_only_override=keep_weights_only_override)
    proc = _run(cmd, cwd=cwd, env=child_env, timeout=timeout, check=False)
    run = FairseqRun(cmd, proc.returncode, proc.stdout, proc.stderr,
                     parse_json_records(proc.stdout + "\n" + proc.stderr))
    return run.check() if check else run


def run_ds_train(
    data: PathLike,
    args: Sequence[str],
    ds_config: PathLike,
    nproc: int = 2,
    *,
    launcher: str = "deepspeed",
    timeout: float = 600,
    env: Optional[Mapping[str, str]] = None,
    json_log: bool = True,
) -> FairseqRun:
    """Run ``scripts/ds_train_cpu.sh nproc data args`` (``embrace-ds-train`` on CPU ranks,
    started by the ``deepspeed`` launcher or by ``torchrun``) and parse its log like
    :func:`run_fairseq_train` (``--log-format json --log-interval 1`` unless given)."""
    args = list(args)
    if json_log:
        if "--log-format" not in args:
            args += ["--log-format", "json"]
        if "--log-interval" not in args:
            args += ["--log-interval", "1"]
    cmd = [str(REPO_ROOT / "scripts" / "ds_train_cpu.sh"), str(nproc), str(data), *args]
    child_env = fairseq_env({"EMBRACE_VENV": str(VENV_BIN.parent), "DS_CONFIG": str(ds_config),
                             "MASTER_PORT": str(free_port()), "EMBRACE_LAUNCHER": launcher, **(env or {})})
    proc = _run(cmd, cwd=None, env=child_env, timeout=timeout, check=False)
    return FairseqRun(cmd, proc.returncode, proc.stdout, proc.stderr,
                      parse_json_records(proc.stdout + "\n" + proc.stderr))


def losses_by_update(text: str) -> Dict[int, float]:
    """{update: logged loss} from the ``train_inner`` records of a ``--log-format json
    --log-interval 1`` log (set ``EMBRACE_LOG_PRECISION`` for more than fairseq's 3 digits)."""
    return {int(r["num_updates"]): float(r["loss"]) for r in parse_json_records(text) if r["_tag"] == "train_inner"}


def run_fairseq_tool(
    tool: str,
    args: Sequence[str],
    *,
    timeout: float = 300,
    cwd: Optional[PathLike] = None,
    env: Optional[Mapping[str, str]] = None,
    user_dir: Optional[PathLike] = USER_DIR,
    check: bool = False,
    keep_weights_only_override: bool = False,
    input_text: Optional[str] = None,
) -> FairseqRun:
    """Run one process of a fairseq console script (``fairseq-generate``, ``fairseq-validate``...).

    ``--user-dir user_dir`` is added unless present or ``user_dir=None``.
    """
    args = list(args)
    if user_dir is not None and "--user-dir" not in args:
        args += ["--user-dir", str(user_dir)]
    cmd = [venv_script(tool), *args]
    child_env = fairseq_env(env, keep_weights_only_override=keep_weights_only_override)
    proc = _run(cmd, cwd=cwd, env=child_env, timeout=timeout, check=False, input_text=input_text)
    run = FairseqRun(cmd, proc.returncode, proc.stdout, proc.stderr,
                     parse_json_records(proc.stdout + "\n" + proc.stderr))
    return run.check() if check else run


#: printed on stdout and stderr before each run of :func:`run_fairseq_tool_each`
_NEXT_RUN = "=== embrace test harness: next run ==="

_TOOL_EACH = (
    "import importlib, json, sys, traceback\n"
    "tool, runs, mark, check = json.loads(sys.stdin.read())\n"
    "cli_main = importlib.import_module('fairseq_cli.' + tool[len('fairseq-'):].replace('-', '_')).cli_main\n"
    "for argv in runs:\n"
    "    print(mark, flush=True)\n"
    "    print(mark, file=sys.stderr, flush=True)\n"
    "    sys.argv = [tool, *argv]\n"
    "    if check:\n"
    "        cli_main()\n"
    "        continue\n"
    "    try:\n"
    "        cli_main()\n"
    "        code = 0\n"
    "    except SystemExit as e:\n"
    "        code = e.code if isinstance(e.code, int) else 1\n"
    "    except BaseException:\n"
    "        traceback.print_exc()\n"
    "        code = 1\n"
    "    sys.stdout.flush()\n"
    "    print(f'{mark} exit {code}', file=sys.stderr, flush=True)\n"
)


def run_fairseq_tool_each(
    tool: str,
    runs: Sequence[Sequence[str]],
    *,
    timeout: float = 300,
    env: Optional[Mapping[str, str]] = None,
    user_dir: Optional[PathLike] = USER_DIR,
    check: bool = True,
) -> List[FairseqRun]:
    """Run a fairseq console script (``fairseq-generate``, ``fairseq-eval-lm``, ...) once per
    argument list, all in one process: its entry point (``fairseq_cli.<tool>.cli_main``) called
    in turn, so fairseq is imported once (a process start and an import of fairseq cost about
    5 s on two cores). Each run's output is its own :class:`FairseqRun`. ``check=True``: all of
    them succeeded (else this raises with the output's tail); ``check=False``: a run that raised
    gets return code 1 (its ``SystemExit`` code if it exited) and its traceback in ``stderr``,
    and the next run goes on (for start-up errors: each run stops before training).
    ``--user-dir user_dir`` is added as by :func:`run_fairseq_tool`."""
    argvs = []
    for args in runs:
        args = list(args)
        if user_dir is not None and "--user-dir" not in args:
            args += ["--user-dir", str(user_dir)]
        argvs.append(args)
    cmd = [sys.executable, "-c", _TOOL_EACH]
    proc = _run(cmd, cwd=None, env=fairseq_env(env), timeout=timeout, check=True,
                input_text=json.dumps([tool, argvs, _NEXT_RUN, check]))
    outs = proc.stdout.split(_NEXT_RUN + "\n")[1:]
    errs = proc.stderr.split(_NEXT_RUN + "\n")[1:]
    assert len(outs) == len(errs) == len(argvs), proc.stdout[-3000:] + proc.stderr[-3000:]
    codes = [0] * len(argvs)
    if not check:
        for i, err in enumerate(errs):
            m = re.search(re.escape(_NEXT_RUN) + r" exit (-?\d+)\n?$", err)
            assert m, err[-3000:]
            codes[i], errs[i] = int(m.group(1)), err[:m.start()]
    return [FairseqRun([tool, *argv], code, out, err, parse_json_records(out + "\n" + err))
            for argv, code, out, err in zip(argvs, codes, outs, errs)]


def make_multilingual_corpus(
    tmpdir: PathLike,
    *,
    langs: Sequence[str] = ("de", "en"),
    n_train: int = 240,
    n_valid: int = 24,
    n_test: int = 20,
    vocab_size: int = 51,
    min_len: int = 3,
    max_len: int = 12,
    seed: int = 0,
    extra_preprocess_args: Sequence[str] = (),
    timeout: float = 120,
    in_process: bool = False,
) -> Path:
    """A two-language corpus binarised for ``--task translation_multi_simple_epoch``: both
    directions (``de-en`` and ``en-de`` for the default ``langs``) over one shared dictionary.

    The second language is the first one word-for-word mapped (a permutation of the
    vocabulary) and reversed, as in :func:`make_translation_corpus`; the second direction is
    the same sentence pairs swapped. The shared dictionary is built once from the training
    text of both languages (``fairseq-preprocess --joined-dictionary --dict-only``), then each
    direction is binarised with it as ``--srcdict`` and ``--tgtdict``, the way M2M-100 / NLLB
    data is prepared. ``tmpdir/data-bin`` (returned) holds ``{split}.{src}-{tgt}.{lang}.bin/idx``
    for both directions, ``dict.{lang}.txt`` (identical files) and ``langs.txt`` (one language a
    line, for ``--lang-dict``). The task adds one ``__lang__`` token per language to the
    dictionary when it loads it. ``in_process=True`` runs fairseq-preprocess's entry point in
    this process (a test that has imported fairseq already saves a process start and an
    import of fairseq, about 5 s on two cores).
    """
    if len(langs) != 2:
        raise ValueError(f"two languages, got {list(langs)}")
    first, second = langs
    tmp, raw, (shared, dest), rng, vocab = fresh_corpus(tmpdir, seed, vocab_size, ("dict", "data-bin"))
    perm = vocab[:]
    rng.shuffle(perm)
    mapping = dict(zip(vocab, perm))
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        sents = _random_sentences(rng, n, vocab, min_len, max_len)
        _write_lines(raw / f"{split}.{first}", sents)
        _write_lines(raw / f"{split}.{second}", [[mapping[w] for w in reversed(s)] for s in sents])
    common = ["--workers", "1", *extra_preprocess_args]
    steps = [["--source-lang", first, "--target-lang", second, "--trainpref", str(raw / "train"),
              "--destdir", str(shared), "--joined-dictionary", "--dict-only", *common]]
    dictionary = shared / f"dict.{first}.txt"
    for src, tgt in ((first, second), (second, first)):
        steps.append(["--source-lang", src, "--target-lang", tgt, "--trainpref", str(raw / "train"),
                      "--validpref", str(raw / "valid"), "--testpref", str(raw / "test"), "--destdir", str(dest),
                      "--srcdict", str(dictionary), "--tgtdict", str(dictionary), *common])
    # fairseq-preprocess's own entry point (cli_main) once per step, in one process: one
    # import of fairseq instead of three (about 10 s less on two cores).
    script = ("import json, sys\nfrom fairseq_cli.preprocess import cli_main\n"
              "for argv in json.loads(sys.stdin.read()):\n    sys.argv = ['fairseq-preprocess', *argv]\n    cli_main()\n")
    if in_process:
        from fairseq_cli.preprocess import cli_main

        argv = sys.argv
        try:
            for step in steps:
                sys.argv = ["fairseq-preprocess", *step]
                cli_main()
        finally:
            sys.argv = argv
    else:
        _run([sys.executable, "-c", script], cwd=tmp, env=fairseq_env(), timeout=timeout, check=True,
             input_text=json.dumps(steps))
    (dest / "langs.txt").write_text("".join(f"{lang}\n" for lang in langs), encoding="utf-8")
    return dest


def make_classification_corpus(
    tmpdir: PathLike,
    *,
    n_train: int = 120,
    n_valid: int = 24,
    vocab_size: int = 44,
    num_classes: int = 3,
    min_len: int = 4,
    max_len: int = 14,
    seed: int = 0,
    srcdict: Optional[PathLike] = None,
    timeout: float = 120,
) -> Path:
    """A sentence-classification corpus for ``--task sentence_prediction`` (RoBERTa fine-tuning):
    ``tmpdir/data-bin/input0`` (the sentences, binarised with ``srcdict`` when given, e.g. the
    masked-LM corpus's ``dict.txt``, so a pretrained checkpoint's table fits) and
    ``tmpdir/data-bin/label`` (the labels ``0`` .. ``num_classes - 1``, their own dictionary).
    A sentence's label is its first word's index modulo ``num_classes``: learnable. Returns
    ``tmpdir/data-bin`` (``train`` and ``valid`` splits)."""
    tmp, raw, (dest,), rng, vocab = fresh_corpus(tmpdir, seed, vocab_size)
    for split, n in (("train", n_train), ("valid", n_valid)):
        sents = _random_sentences(rng, n, vocab, min_len, max_len)
        _write_lines(raw / f"{split}.input0", sents)
        _write_lines(raw / f"{split}.label", [[str(int(s[0][1:]) % num_classes)] for s in sents])
    for part in ("input0", "label"):
        cmd = [venv_script("fairseq-preprocess"), "--only-source", "--trainpref", str(raw / f"train.{part}"),
               "--validpref", str(raw / f"valid.{part}"), "--destdir", str(dest / part), "--workers", "1"]
        if part == "input0" and srcdict is not None:
            cmd += ["--srcdict", str(srcdict)]
        _run(cmd, cwd=tmp, env=fairseq_env(), timeout=timeout, check=True)
    return dest
