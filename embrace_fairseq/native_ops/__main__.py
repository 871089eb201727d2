"""``python -m embrace_fairseq.native_ops [--bench]``: status of the native ops, and
their benchmark against the PyTorch references."""
from typing import Optional, Sequence

from . import AUTO_NATIVE, OPS, native_status


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m embrace_fairseq.native_ops", description="Native ops status and benchmark.")
    p.add_argument("--bench", action="store_true", help="time reference vs native ops and write JSON + Markdown")
    p.add_argument("--out", default="results/native_ops", help="folder for the benchmark results")
    p.add_argument("--quick", action="store_true", help="two small cases, few repetitions (a smoke run)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions per case (default 21, quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (ranks here run with 1)")
    args = p.parse_args(argv)
    print(native_status())
    if not args.bench:
        print("auto enables:", [op for op in OPS if AUTO_NATIVE[op]] or "none")
        return 0
    from .bench import run_benchmark

    return run_benchmark(args.out, quick=args.quick, reps=args.reps, threads=args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
