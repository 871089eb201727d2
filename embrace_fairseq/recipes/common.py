"""Shared pieces of the recipes: launching fairseq tools, parsing their logs, versions, plots."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from embrace_fairseq.core.process_group import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
USER_DIR = REPO_ROOT / "user_dir"
BIN = Path(sys.executable).parent
_LOG = re.compile(r"^\S+ \S+ \| [A-Z]+ \| (?P<name>[^|]+?) \| (?P<msg>\{.*\})\s*$")

# The optimisation the recipes use (fairseq's Transformer recipe, scaled down), and the
# logging and seeding every recipe run shares; each recipe adds its model and batch flags.
def adam_inverse_sqrt(lr: str = "1e-3", warmup: int = 100) -> List[str]:
    """Adam with the inverse square-root schedule, gradient clipping and dropout 0.1."""
    return ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", lr, "--clip-norm", "1.0",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(warmup), "--warmup-init-lr", "1e-7",
            "--dropout", "0.1"]


ADAM_INVERSE_SQRT = adam_inverse_sqrt()
RUN_ARGS = ["--seed", "1", "--num-workers", "0", "--log-format", "json", "--log-interval", "5",
            "--no-epoch-checkpoints"]


#: where a recipe writes its results file and plot: an ignored folder, so that running a
#: recipe never changes the tracked tree (``--record`` writes into ``results/`` instead,
#: the committed results the README cites)
RUN_RESULTS = REPO_ROOT / "work_dirs" / "results"
RECORDED_RESULTS = REPO_ROOT / "results"


def add_results_args(p) -> None:
    """``--results DIR`` and ``--record`` (write the committed results in ``results/``)."""
    p.add_argument("--results", type=Path, default=None,
                   help=f"folder for the results file and plot (default {RUN_RESULTS.relative_to(REPO_ROOT)}/, "
                        "ignored by git)")
    p.add_argument("--record", action="store_true",
                   help="write the results into results/, the committed files the README cites")


def results_dir(a) -> Path:
    """The folder ``--results`` / ``--record`` name (one of them at most).

    >>> import argparse
    >>> results_dir(argparse.Namespace(results=None, record=False)) == RUN_RESULTS
    True
    >>> results_dir(argparse.Namespace(results=None, record=True)) == RECORDED_RESULTS
    True
    """
    if a.results is not None and a.record:
        raise SystemExit("--results and --record name two places for the results: give one")
    if a.results is not None:
        return a.results
    return RECORDED_RESULTS if a.record else RUN_RESULTS


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH; run scripts/setup.sh")
    return found


def torchrun_train_cmd(ranks: int, data_bin: Path, args: Sequence[str]) -> List[str]:
    """The documented training command: torchrun + fairseq-train with the user dir."""
    return [tool("torchrun"), "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), tool("fairseq-train"), str(data_bin),
            "--user-dir", str(USER_DIR), *args]


def child_env(threads: int = 1) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("DS_ACCELERATOR", "cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def stream(cmd: Sequence[str], log_path: Path, on_line: Optional[Callable[[str], None]] = None,
           env: Optional[Dict[str, str]] = None, stdin_text: Optional[str] = None) -> List[str]:
    """Run a command, tee its output to ``log_path``, call ``on_line`` per line; raise on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    lines: List[str] = []
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env or child_env(), stdin=subprocess.PIPE if stdin_text else None)
        if stdin_text:
            proc.stdin.write(stdin_text)
            proc.stdin.close()
        for line in proc.stdout:
            log.write(line)
            lines.append(line.rstrip("\n"))
            if on_line:
                on_line(line.rstrip("\n"))
        rc = proc.wait()
    if rc != 0:
        tail = "\n".join(lines[-30:])
        raise RuntimeError(f"command failed with exit code {rc}: {' '.join(cmd)}\n{tail}\n(full log: {log_path})")
    return lines


def json_records(lines: Sequence[str], name: str) -> List[dict]:
    out = []
    for line in lines:
        m = _LOG.match(line.strip())
        if m and m.group("name").strip() == name:
            try:
                out.append(json.loads(m.group("msg")))
            except json.JSONDecodeError:
                pass
    return out


def versions() -> Dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "fairseq-fixed", "deepspeed", "sacrebleu", "sentencepiece", "embrace-fairseq"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def eta(elapsed_s: float, done: int, total: int, time_limit_s: Optional[float] = None) -> str:
    """``"ETA 3m20s"`` from the mean pace so far (validation pauses included), or from the
    time limit where that comes first."""
    if done <= 0 or total <= done:
        return "ETA 0s" if total <= done else "ETA -"
    left = int(round(elapsed_s / done * (total - done)))
    if time_limit_s is not None:
        left = min(left, max(0, int(round(time_limit_s - elapsed_s))))
    return f"ETA {left // 60}m{left % 60:02d}s" if left >= 60 else f"ETA {left}s"


def progress_printer(prefix: str, total_updates: int, time_limit_s: Optional[float] = None) -> Callable[[str], None]:
    """Print a compact progress line for fairseq's per-update and validation records;
    ``time_limit_s``: training also stops after that long (``--stop-time-hours``)."""
    start = time.time()

    def on_line(line: str) -> None:
        m = _LOG.match(line.strip())
        if not m:
            if "Traceback" in line or "Error" in line:
                print(f"{prefix} {line}", flush=True)
            return
        try:
            rec = json.loads(m.group("msg"))
        except json.JSONDecodeError:  # fairseq also logs its config as a Python dict
            return
        name = m.group("name").strip()
        if name == "train_inner":
            n = int(rec["num_updates"])
            if n % 10 == 0 or n == total_updates:
                elapsed = time.time() - start
                print(f"{prefix} update {n}/{total_updates} loss {rec['loss']} wps {rec.get('wps')} "
                      f"({elapsed:.0f}s, {eta(elapsed, n, total_updates, time_limit_s)})", flush=True)
        elif name == "valid":
            print(f"{prefix} validation after {rec.get('valid_num_updates')} updates: loss {rec.get('valid_loss')}", flush=True)

    return on_line


def plot_losses(curves: Dict[str, Dict[str, List[tuple]]], path: Path, title: str) -> Optional[Path]:
    """Training/validation loss against updates, one colour per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, c) in enumerate(curves.items()):
        color = f"C{i}"
        if c.get("train"):
            xs, ys = zip(*c["train"])
            ax.plot(xs, ys, color=color, alpha=0.6, label=f"{label} train")
        if c.get("valid"):
            xs, ys = zip(*c["valid"])
            ax.plot(xs, ys, "o-", color=color, label=f"{label} valid")
    ax.set_xlabel("updates")
    ax.set_ylabel("loss (base 2)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fresh_save_dir(work: Path, label: str) -> Path:
    """The run's checkpoint folder, emptied: fairseq-train resumes from a
    ``checkpoint_last.pt`` it finds there, which would make a rerun evaluate the earlier
    model (its updates already reached) or fail on one of another recipe."""
    save_dir = work / "checkpoints"
    if save_dir.exists() and any(save_dir.iterdir()):
        print(f"[{label}] training from scratch: removing the earlier run's checkpoints in {save_dir}", flush=True)
        shutil.rmtree(save_dir)
    return save_dir


def start_run(label: str, arch: str, default_arch: str, work_dir: Path, data: Path, skip_data: bool,
              only: Optional[str] = None) -> Tuple[str, Path]:
    """(result-file tag, work folder) of a recipe run for ``arch``; prepares the data first
    (cached after the first run) unless ``skip_data``. ``only`` limits data_prep to one set."""
    tag = "" if arch == default_arch else f"_{arch}"
    work = work_dir / arch
    work.mkdir(parents=True, exist_ok=True)
    if not skip_data:
        print(f"[{label}] preparing data (cached after the first run)", flush=True)
        cmd = [sys.executable, "-m", "embrace_fairseq.data_prep", "--out", str(data)]
        cmd += (["--only", only] if only else []) + ["-q"]
        stream(cmd, work / "data_prep.log", on_line=print)
    return tag, work
