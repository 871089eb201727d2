"""``python -m embrace_fairseq.perf.simulator validate|paper|measure``.

``validate BENCH_JSON [--fit]``: prediction error against a bench JSON's measured runs;
``validate BENCH_JSON --out-of-sample [--fit-on MODEL:GBIT|MODEL:REGIME]``: knobs fitted on
one model and link (a regime run's link is named by its regime), every other run predicted;
``paper [--out results/simulator/]``: 8 to 64 GPUs for the paper's models;
``regimes [--out results/simulator/regime_projection] [--compute-floor PROFILE_JSON]``: the
released models in the compute-matched regimes at 16-64 GPUs (with a measured compute floor);
``measure``: time the stock translation Transformer on this CPU (a profile JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

from embrace_fairseq.guards import one_line_errors
from embrace_fairseq.perf.simulator.measure import measure_translation_profile
from embrace_fairseq.perf.simulator.paper import latency_sensitivity, markdown, paper_study, plot
from embrace_fairseq.perf.simulator.profile import Options
from embrace_fairseq.perf.simulator.validation import fit_network, out_of_sample, validate


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.simulator",
                                 description="Step-time cost model of the data-parallel strategies, for any world size and link.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="prediction error against a bench JSON's measured runs")
    v.add_argument("bench_json")
    v.add_argument("--efficiency", type=float, default=1.0, help="share of the line rate collectives reach")
    v.add_argument("--overhead-ms", type=float, default=0.0, help="software cost per collective")
    v.add_argument("--host-ns-per-byte", type=float, default=0.0, help="CPU time per byte sent (one-machine emulation)")
    v.add_argument("--no-oversubscription", action="store_true",
                   help="do not scale compute by ranks per CPU core")
    v.add_argument("--tied-output", action="append", default=[], metavar="MODEL=MODE",
                   help="override a profile's tied_output (none|gather|vocab_parallel)")
    v.add_argument("--defer-rows", action="store_true",
                   help="model the relaxed deferral of gradient rows (a design the exchange does not implement yet)")
    v.add_argument("--fit", action="store_true",
                   help="also fit efficiency, per-collective overhead and host cost per byte (with held-out errors)")
    v.add_argument("--out-of-sample", action="store_true",
                   help="fit the network knobs on one model and link only, predict every other run with them "
                        "(the knobs given above are not used)")
    v.add_argument("--fit-on", type=_fit_on, metavar="MODEL:GBIT|MODEL:REGIME",
                   help="with --out-of-sample: the runs to fit on, the link by its Gbit/s or, for runs calibrated to "
                        "regimes, by the regime's name (default: the first model at its lowest link / first regime)")
    v.add_argument("--out", help="write the comparison JSON here")
    p = sub.add_parser("paper", help="8-64 GPU projection of the paper's models (as built, every stock baseline)")
    p.add_argument("--out", default="results/simulator/")
    r = sub.add_parser("regimes", help="16-64 GPU projection of the released models in the compute-matched regimes")
    r.add_argument("--out", default="results/simulator/regime_projection",
                   help="path stem: writes STEM.json, STEM.md and STEM.png")
    r.add_argument("--compute-floor", metavar="PROFILE_JSON",
                   help="a gpu_profile result: each model's forward + backward at least as long as measured there")
    r.add_argument("--worlds", default="16,32,64", type=lambda v: tuple(int(x) for x in v.split(",")),
                   help="GPU counts, comma-separated (default 16,32,64; 4 is the benchmark's size)")
    m = sub.add_parser("measure", help="time the stock translation Transformer on this CPU (a profile JSON)")
    m.add_argument("--data", default="data/deen/bin")
    m.add_argument("--max-tokens", type=int, default=512)
    m.add_argument("--worlds", default="2,4,8", help="world sizes to deal batches to")
    m.add_argument("--out", default="results/simulator/cpu_profile.json")
    return ap


def _measure(a: argparse.Namespace) -> int:
    prof = measure_translation_profile(a.data, max_tokens=a.max_tokens, worlds=[int(x) for x in a.worlds.split(",")])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"profiles": {"translation": prof}, "runs": []}, indent=2))
    print(json.dumps(prof["compute_s"]), f"zipf_s={prof['zipf_s']:.2f}", f"-> {a.out}")
    for n, c in prof["sparse_load_check"].items():
        print(f"N={n}: busiest rank's rows measured {c['busiest_rows_measured']:.0f}, Zipf model "
              f"{c['busiest_rows_zipf']:.0f} (average off-owner ids {c['off_owner_mean_zipf']:.0f})")
    return 0


def _print_validation(res: dict) -> None:
    print(f"{'model':12s} {'N':>3s} {'Gbit':>5s} {'strategy':20s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for r in res["runs"]:
        print(f"{r['model']:12s} {r['world_size']:3d} {r['link_gbit']:5g} {r['strategy']:20s} "
              f"{r['measured_s']:9.4f} {r['predicted_s']:9.4f} {100 * r['rel_error']:+6.1f}%")
    if res["mean_abs_rel_error"] is None:
        return
    print(f"mean |error| {100 * res['mean_abs_rel_error']:.1f}%, median {100 * res['median_abs_rel_error']:.1f}%, "
          f"max {100 * res['max_abs_rel_error']:.1f}% over {len(res['runs'])} runs"
          + (f"; the runs' own step-time spread (IQR/median) is {100 * res['median_measured_rel_iqr']:.0f}% (median)"
             if res.get("median_measured_rel_iqr") is not None else ""))
    sp = res.get("speedups_of_embrace_schedule") or []
    if sp:
        print("speedup of embrace_schedule over:   measured  predicted")
        for x in sp:
            print(f"  {x['model']:11s} N={x['world_size']} {x['link_gbit']:4g} Gbit {x['over']:20s} "
                  f"{x['measured']:6.2f}x  {x['predicted']:6.2f}x")
        print(f"mean |error| of the speedups: {100 * res['speedup_mean_abs_rel_error']:.1f}%")


def _fit_on(text: str) -> Tuple[str, Union[float, str]]:
    """``MODEL:GBIT`` or ``MODEL:REGIME`` (the model name may hold colons; the link is after
    the last one: a number is a rate in Gbit/s, a known regime's name a regime)."""
    from embrace_fairseq.perf.simulator.regimes import get_regime

    model, sep, link = text.rpartition(":")
    if not (sep and model and link):
        raise argparse.ArgumentTypeError(f"expected MODEL:GBIT or MODEL:REGIME, got {text!r}")
    try:
        return model, float(link)
    except ValueError:
        pass
    try:
        return model, get_regime(link).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected MODEL:GBIT or MODEL:REGIME, got {text!r}: {exc}") from None


def _pct(x: Optional[float], signed: bool = False) -> str:
    return "-" if x is None else (f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%")


def _print_out_of_sample(res: dict) -> None:
    if res["skipped"]:
        print(f"out of sample: nothing predicted ({res['skipped']})")
        return
    f, k = res["fitted_on"], res["knobs"]
    where = (f"{f['model']} in {f['regime']} (calibrated {f['link_gbit']:.3g} Gbit/s)" if "regime" in f
             else f"{f['model']} at {f['link_gbit']:g} Gbit/s") + (f", {f['world_size']} ranks" if "world_size" in f else "")
    print(f"fitted on {where} ({f['runs']} runs): efficiency {k['efficiency']:.2f}, overhead "
          f"{1e3 * k['overhead_s']:.2f} ms per collective, host {1e9 * k['host_s_per_byte']:.0f} ns per byte, "
          f"ranks sharing a core {k.get('shared_core_slowdown', 1.0):.1f}x slower; in-sample mean |error| {_pct(res['in_sample']['mean_abs_rel_error'])}; compute from {res['compute']}")
    print(f"{'model':12s} {'N':>3s} {'link':>10s} {'strategy':20s} {'measured':>9s} {'predicted':>9s} "
          f"{'error':>7s}  set")
    for r in res["runs"]:
        link = f"{r['regime']}" if r.get("regime") else f"{r['link_gbit']:g} Gbit"
        print(f"{r['model']:12s} {r['world_size']:3d} {link:>10s} {r['strategy']:20s} "
              f"{r['measured_s']:9.4f} {r['predicted_s']:9.4f} {100 * r['rel_error']:+6.1f}%  "
              f"{'held out' if r['held_out'] else 'fit'}")
    print("held out, per model and link (error = (predicted - measured) / measured):")
    print(f"{'model':12s} {'link':>22s} {'runs':>4s} {'mean':>7s} {'mean |e|':>8s} {'max |e|':>8s}")
    for m, s in res["by_model"].items():
        links = [x for x in res["by_model_link"] if x["model"] == m]
        # a model's own line where it has several links
        for g in links + ([dict(s, link_gbit=None)] if len(links) > 1 else []):
            link = ("all" if g["link_gbit"] is None else
                    f"{g['regime']} ({g['link_gbit']:.3g} Gbit)" if g.get("regime") else f"{g['link_gbit']:g} Gbit")
            print(f"{m:12s} {link:>22s} {g['count']:4d} {_pct(g['mean_signed_rel_error'], True):>7s} "
                  f"{_pct(g['mean_abs_rel_error']):>8s} {_pct(g['max_abs_rel_error']):>8s}")
    target = f"{100 * res['target_mean_abs_rel_error']:.0f} %"
    if res.get("target_per") == "model":
        missed = [m for m, ok in res["by_model_within_target"].items() if not ok]
        print(f"held out: mean |error| {_pct(res['held_out_mean_abs_rel_error'])} over {res['held_out']['count']} "
              f"runs; per workload " + ("within" if res["within_target"] else "NOT within")
              + f" the {target} target" + (f" (missed: {', '.join(missed)})" if missed else ""))
        return
    print(f"held out: mean |error| {_pct(res['held_out_mean_abs_rel_error'])} over {res['held_out']['count']} runs "
          f"(mean signed {_pct(res['held_out']['mean_signed_rel_error'], True)}): "
          + ("within" if res["within_target"] else "NOT within") + f" the {target} target")


def _write_json(res: dict, out: Optional[str]) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2))


def _validate(a: argparse.Namespace) -> int:
    with open(a.bench_json) as fh:
        bench = json.load(fh)
    tied = dict(x.split("=", 1) for x in a.tied_output)
    opts = Options(defer_rows=a.defer_rows)
    if a.out_of_sample:
        try:
            oos = out_of_sample(bench, fit_on=a.fit_on, tied=tied, opts=opts,
                                oversubscription=not a.no_oversubscription)
        except ValueError as exc:  # e.g. --fit-on names no run of the bench
            print(f"{one_line_errors.PREFIX}--out-of-sample: {exc}", file=sys.stderr)
            return one_line_errors.USER_ERROR_EXIT
        _print_out_of_sample(oos)
        _write_json(oos, a.out)
        return 1 if oos["skipped"] else 0
    res = validate(bench, efficiency=a.efficiency, overhead_s=a.overhead_ms / 1e3,
                   host_s_per_byte=a.host_ns_per_byte * 1e-9, tied=tied, opts=opts,
                   oversubscription=not a.no_oversubscription)
    _print_validation(res)
    if res["mean_abs_rel_error"] is None:
        print(res.get("skipped") or "no measured runs to compare with")
        return 1
    if a.fit:
        res["fit"] = f = fit_network(bench, tied=tied, opts=opts, oversubscription=not a.no_oversubscription)
        print(f"fitted: efficiency {f['efficiency']:.2f}, overhead {1e3 * f['overhead_s']:.2f} ms per collective, "
              f"host {1e9 * f['host_s_per_byte']:.0f} ns per byte, ranks sharing a core "
              f"{f.get('shared_core_slowdown', 1.0):.1f}x slower; mean |error| "
              f"{100 * f['in_sample_mean_abs_rel_error']:.1f}% in sample"
              + "".join(f", {100 * e:.1f}% holding out each {k}" for k, e in f["holdout"].items()))
    _write_json(res, a.out)
    return 0


def _paper(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    study = paper_study()
    study["latency_sensitivity"] = latency_sensitivity()
    (out / "paper_projection.json").write_text(json.dumps(study, indent=2))
    md = markdown(study)
    (out / "paper_projection.md").write_text(md)
    plot(study, out / "paper_projection.png")
    print(md)
    print(f"wrote {out / 'paper_projection.json'}, {out / 'paper_projection.md'}, {out / 'paper_projection.png'}")
    return 0


def _regimes(a: argparse.Namespace) -> int:
    from embrace_fairseq.perf.simulator.regime_projection import write_projection

    paths, md = write_projection(Path(a.out), command="python -m embrace_fairseq.perf.simulator "
                                 + " ".join(sys.argv[1:] if a.argv is None else a.argv),
                                 compute_floor=Path(a.compute_floor) if a.compute_floor else None, worlds=a.worlds)
    print(md)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    a.argv = None if argv is None else list(argv)
    return {"measure": _measure, "validate": _validate, "paper": _paper, "regimes": _regimes}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
