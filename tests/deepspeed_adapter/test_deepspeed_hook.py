"""EmbRace's DeepSpeed hook against stock DeepSpeed, in real gloo ranks.

Each spawned run trains several engines in turn (see rank_fns_deepspeed.py): starting
DeepSpeed costs far more than the tiny models' ten steps.
"""
import glob
import json
import os
import time

import pytest
import torch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import rank_fns_deepspeed as R  # noqa: E402
from embrace_fairseq.deepspeed_adapter import (  # noqa: E402
    EmbraceConfigError,
    initialize,
    parse_embrace_config,
)
from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402

RTOL = 1e-4


_rel = R.rel_diff


def _assert_same_training(ref, got, label):
    assert _rel(got["losses"], ref["losses"]) < RTOL, (label, got["losses"], ref["losses"])
    assert ref["state"].keys() == got["state"].keys()
    for name in ref["state"]:
        assert _rel(got["state"][name], ref["state"][name]) < RTOL, (label, name)


_RUNS = {}


@pytest.fixture(scope="module")
def trace_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traces"))


def _runs(world, trace_root):
    """One spawned run per world size, shared by the tests below (DeepSpeed start-up
    dominates). World 2 also writes traces and checks gradient accumulation over 10 steps;
    world 3 takes 4 (an uneven shard or a wrong average shows from the first step)."""
    if world not in _RUNS:
        _RUNS[("started", world)] = time.time() - 1.0  # for the /dev/shm check below
        trace_dir = trace_root if world == 2 else None
        steps = 10 if world == 2 else 4
        if world == 2:  # the gate choices (test_exchange_gate_only_when_asked_for) ride along
            runs = run_ranks(R.equivalence_and_gate_choices, world, steps, trace_dir, True, timeout_s=300,
                             pg_timeout_s=120)
            _RUNS[world] = [r["equivalence"] for r in runs]
            _RUNS["gate_choices"] = [r["gate_choices"] for r in runs]
        else:
            _RUNS[world] = run_ranks(R.equivalence_run, world, steps, None, False, timeout_s=240,
                                     pg_timeout_s=120)
    return _RUNS[world]


@pytest.mark.parametrize("world", [2, 3])
def test_matches_stock_deepspeed(world, trace_root):
    """(a) losses and gathered weights equal stock DeepSpeed with each schedule dimension
    on and off, tied and untied, overlap off, gradient clipping on; (b) a rank slowed in
    its backward hook: no deadlock, same result."""
    results = _runs(world, trace_root)
    for rank, res in enumerate(results):
        for key, got in res.items():
            if key[0] in ("stock", "stock_gas"):
                continue
            ref = res[("stock_gas", True)] if key[0] == "embrace_gas" else res[("stock", key[1])]
            _assert_same_training(ref, got, (world, rank, key))
        # the same static list on every rank (the deadlock-freedom argument)
        assert res[("embrace", False, True, True)]["schedule"] == results[0][("embrace", False, True, True)]["schedule"]
    # weights agree across ranks, as data parallel training must keep them
    for key in results[0]:
        for name, t in results[0][key]["state"].items():
            for other in results[1:]:
                assert (other[key]["state"][name] == t).all(), (key, name)
    # the schedule dimensions really change the order
    sched = {k[2:]: v["schedule"] for k, v in results[0].items() if k[0] == "embrace" and not k[1]}
    assert sched[(True, True)] != sched[(False, True)]
    assert len(sched[(True, True)]) > len(sched[(True, False)])


def test_gradient_accumulation_matches_stock(trace_root):
    """gradient_accumulation_steps=2 (reduce at the boundary only): same as stock."""
    results = _runs(2, trace_root)
    for r in results:
        assert len(r[("embrace_gas", True)]["losses"]) == 10
        _assert_same_training(r[("stock_gas", True)], r[("embrace_gas", True)], "gas=2")


def test_trace_shows_overlap(trace_root):
    """(c) with overlap on, dense all-reduces start inside backward; with it off, none do.
    The Chrome trace holds compute phases and every kind of collective."""
    _runs(2, trace_root)
    trace_dir, world = trace_root, 2
    for rank in range(world):
        on = json.load(open(os.path.join(trace_dir, f"on.rank{rank}.json")))
        off = json.load(open(os.path.join(trace_dir, f"off.rank{rank}.json")))
        assert on["otherData"]["dense_started_in_backward"] > 0, on["otherData"]
        assert off["otherData"]["dense_started_in_backward"] == 0, off["otherData"]
        names = {e["name"] for e in on["traceEvents"]}
        assert {"forward", "backward", "step", "dense_grad", "grad_rows", "rows", "ids"} <= names
        assert on["otherData"]["bytes_by_kind"]["dense_grad"] > 0
        # model level: no dense piece is issued while an embedding gradient exchange is in flight
        exch = [(e["ts"], e["ts"] + e["dur"]) for e in on["traceEvents"] if e.get("name") == "grad_rows"]
        dense = [e["ts"] for e in on["traceEvents"] if e.get("name") == "dense_grad"]
        assert exch and not [t for t in dense for s, e in exch if s < t < e]
    assert len(glob.glob(os.path.join(trace_dir, "*.json"))) == 2 * world


def test_exchange_gate_only_when_asked_for(trace_root):
    """The gate (dense pieces held while an embedding exchange runs) is off by default,
    with or without next-forward overlap; "exchange_gate": true turns it on, also where
    next-forward overlap falls back (clipping). From the shared 2-rank run."""
    _runs(2, trace_root)
    results = _RUNS["gate_choices"]
    # (gate, next-forward) for: defaults; next_forward; exchange_gate; both; both + clipping
    want = [(False, False), (False, True), (True, False), (True, True), (True, False)]
    assert results == [want, want], results


@pytest.mark.parametrize(
    "section, needle",
    [
        ({"model_levle": True}, '"embrace.model_levle"'),
        ({"piece_bytes": 0}, '"embrace.piece_bytes"'),
        ({"max_in_flight": "2"}, '"embrace.max_in_flight"'),
        ({"tensor_level": 1}, '"embrace.tensor_level"'),
        ({"trace": ""}, '"embrace.trace"'),
        ({"relaxed_embedding": "yes"}, '"embrace.relaxed_embedding"'),
        ({"link_bytes_per_s": 0}, '"embrace.link_bytes_per_s"'),
        ({"compute_bytes_per_s": "fast"}, '"embrace.compute_bytes_per_s"'),
        ({"link_bytes_per_s": True}, '"embrace.link_bytes_per_s"'),
        ({"exchange_gate": 1}, '"embrace.exchange_gate"'),
        ({"exchange_gate": "auto"}, '"embrace.exchange_gate"'),
        ({"next_forward": "yes"}, '"embrace.next_forward"'),
        ([], '"embrace" must be a JSON object'),
    ],
)
def test_bad_embrace_config_stops_startup(section, needle):
    """(d) a bad "embrace" section stops initialize() with an error naming it, before DeepSpeed starts."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "embrace": section}
    with pytest.raises(EmbraceConfigError) as err:
        initialize(model=torch.nn.Linear(2, 2), config=cfg)
    assert needle in str(err.value)


def test_unsupported_zero_stage_is_refused():
    with pytest.raises(EmbraceConfigError, match="zero_optimization.stage"):
        initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})


def test_schedule_rates_come_from_the_config():
    from embrace_fairseq.deepspeed_adapter.engine_hook import schedule_options
    from embrace_fairseq.schedule.plan import ScheduleOptions

    default = schedule_options(parse_embrace_config(None))
    assert (default.compute_bytes_per_s, default.link_bytes_per_s) == (None, None)  # measured
    assert schedule_options(parse_embrace_config({"link_bytes_per_s": None})).link_bytes_per_s is None
    cfg = parse_embrace_config({"compute_bytes_per_s": 2e9, "link_bytes_per_s": 125000000, "piece_bytes": 4096,
                                "model_level": False, "max_in_flight": 3, "bucket_bytes": 8192})
    opts = schedule_options(cfg)
    assert opts == ScheduleOptions(model_level=False, piece_bytes=4096, max_in_flight=3, bucket_bytes=8192,
                                   compute_bytes_per_s=2e9, link_bytes_per_s=1.25e8)
    assert isinstance(opts.link_bytes_per_s, float)


def test_example_configs_parse():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_config")
    for path in glob.glob(os.path.join(root, "*.json")):
        parse_embrace_config(json.load(open(path)).get("embrace"))
    assert parse_embrace_config(None) == parse_embrace_config({})


@pytest.mark.slow
def test_launcher_trains_and_generate_reads_checkpoint(tmp_path):
    """embrace-ds-train (via scripts/ds_train_cpu.sh, 2 CPU ranks) trains a tiny translation
    model; fairseq-generate --user-dir user_dir decodes with its checkpoint on one process."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from fairseq_corpus import fairseq_env, make_translation_corpus, run_fairseq_tool

    root = Path(__file__).resolve().parents[2]
    data = make_translation_corpus(tmp_path / "corpus", n_train=200)
    env = dict(fairseq_env(), EMBRACE_VENV=str(Path(sys.executable).parent.parent),
               DS_CONFIG=str(root / "ds_config" / "embrace_cpu.json"))
    train = subprocess.run(
        [str(root / "scripts" / "ds_train_cpu.sh"), "2", str(data), "--task", "translation",
         "--arch", "embrace_transformer", "--share-all-embeddings", "--encoder-layers", "1", "--decoder-layers", "1",
         "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
         "--max-tokens", "500", "--max-epoch", "2", "--save-dir", str(tmp_path / "ckpt")],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "done training" in train.stdout + train.stderr
    assert re.search(r"\| valid \| epoch 002 \| .*loss [0-9.]+", train.stdout + train.stderr)  # fairseq's own lines
    gen = run_fairseq_tool("fairseq-generate", [str(data), "--path", str(tmp_path / "ckpt" / "checkpoint_last.pt"),
                                                "--cpu", "--beam", "2", "--max-tokens", "1000", "--gen-subset", "test"])
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "BLEU4" in gen.stdout + gen.stderr


def test_no_shared_memory_left_behind(trace_root):
    """DeepSpeed's CPU comm layer would map a 69 MB /dev/shm buffer per rank that nothing
    unlinks (deepspeed_adapter/cpu_comm.py): neither path may leave one behind (checked
    after the shared 2-rank run, which starts both stock DeepSpeed and EmbRace's engines)."""
    results = _runs(2, trace_root)
    assert all(("stock", True) in r and ("embrace", True, True, True) in r for r in results)
    t0 = _RUNS[("started", 2)]
    fresh = [f for f in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*") if os.path.getmtime(f) >= t0]
    assert fresh == [], fresh
