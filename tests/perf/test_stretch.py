"""The output stretch and the dependency-aware limit (perf/bench/stretch.py, report.dependency_limit)."""
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq.perf.bench.calibration import dependency_limit_steps, limit_steps
from embrace_fairseq.perf.bench.report import dependency_limit
from embrace_fairseq.perf.bench.stretch import StretchProbe, output_products, summarize, table_grad_seconds

V, D, T = 50, 8, 12


class _Sleep(torch.autograd.Function):
    """Identity that sleeps in its forward and backward: a known cost at a known place."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class TinyLM(nn.Module):
    """A table, two dense layers, a final norm and a tied output projection."""

    def __init__(self, below=0.0, output=0.0):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.norm = nn.LayerNorm(D)
        self.below, self.output = below, output

    def forward(self, ids):
        x = self.embed(ids)
        x = self.layers[0](x)
        if self.below:
            x = _Sleep.apply(x, self.below)  # between dense layers: not in the stretch
        x = self.norm(self.layers[1](x))
        if self.output:
            x = _Sleep.apply(x, self.output)  # after the last dense layer: in the stretch
        return F.linear(x, self.embed.weight)


TABLES = ("embed.weight",)


def _step(model, probe, ids):
    logits = model(ids)
    loss = F.cross_entropy(logits, ids)
    probe.loss_done()
    probe.backward_started()
    loss.backward()
    return probe.take()


def test_the_stretch_counts_the_output_side_only():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (T,))
    nap = 0.2  # long against a loaded machine's preemptions: the comparisons below hold under load
    out_side, below = TinyLM(output=nap), TinyLM(below=nap)
    marks = {}
    for name, m in (("output", out_side), ("below", below)):
        probe = StretchProbe(m, TABLES)
        marks[name] = [_step(m, probe, ids) for _ in range(3)]
        probe.close()
    med = {k: summarize(v, 0.0, 1.0) for k, v in marks.items()}
    # a cost after the last dense layer lands in the stretch, once forward and once backward
    assert med["output"]["forward_s"] >= nap and med["output"]["backward_s"] >= nap
    # the same cost between dense layers is overlappable: not in the stretch
    assert med["below"]["forward_s"] < nap / 2 and med["below"]["backward_s"] < nap / 2


def test_the_probe_needs_every_mark_and_a_dense_layer():
    m = TinyLM()
    probe = StretchProbe(m, TABLES)
    with pytest.raises(RuntimeError, match="did not pass every mark"):
        probe.take()
    probe.close()
    with pytest.raises(ValueError, match="no dense layer"):
        StretchProbe(nn.Embedding(V, D), ("weight",))


def test_output_products_are_the_table_reads():
    m = TinyLM()
    ids = torch.randint(0, V, (T,))
    assert output_products(m, TABLES, lambda: m(ids)) == [(T, V, D)]
    assert output_products(m, (), lambda: m(ids)) == []
    assert table_grad_seconds([(T, V, D)], repeats=1) > 0
    assert table_grad_seconds([]) == 0


def test_dependency_limit_is_at_least_the_plain_limit_and_the_stretch_plus_dense():
    floor = [1.0, 1.2]
    plain = limit_steps(floor, min_bytes=10e6, gbit=0.1)  # 0.8 s of wire
    dep = dependency_limit_steps(floor, stretch_share=0.3, dense_bytes=9e6, min_bytes=10e6, gbit=0.1)
    assert dep == pytest.approx([max(1.0, 0.3 + 0.72), max(1.2, 0.36 + 0.72)])
    assert all(d >= p for d, p in zip(dep, plain))


def test_a_runs_dependency_limit_uses_the_ring_dense_bytes():
    floor = {"model": "m", "world_size": 2, "step_s": [1.0, 1.0], "link_gbit": 0.08}
    per = {"compute_floor": floor, "embrace_schedule": dict(floor, step_s=[2.0, 2.2])}
    d = dependency_limit(per, floor, stretch_share=0.5, dense_numel=1_000_000, min_bytes=5e6)
    assert d["dense_bytes"] == pytest.approx(4e6)  # fp32, 2 (N-1)/N of the elements
    assert d["dense_over_link_s"] == pytest.approx(0.4)
    assert d["limit_s"] == pytest.approx(1.0)  # the floor: 0.5 + 0.4 < 1.0, 5 MB / 10 MB/s = 0.5 s
    d = dependency_limit(per, floor, stretch_share=0.9, dense_numel=1_000_000, min_bytes=5e6)
    assert d["limit_s"] == pytest.approx(1.3)
    assert d["over_limit"]["embrace_schedule"]["ratio"] == pytest.approx((2.0 * 2.2) ** 0.5 / 1.3)


def test_the_dependency_limit_page_names_each_run_and_its_commit():
    from embrace_fairseq.perf.bench.dependency_limit import markdown

    iv = {"ratio": 1.3, "low": 1.2, "high": 1.4, "steps": 8}
    res = {"source": {"commit": "abc1234def", "dirty": False},
           "stretches": {"mbart": {"forward_s": 0.2, "backward_s": 0.5, "table_grad_s": 0.1, "stretch_s": 0.6,
                                   "share": 0.25}},
           "runs": [{"run": "mbart/w2/a100-100g", "commit": "2f3c9b3aaaa", "plain_limit_s": 3.5,
                     "dependency_limit": {"stretch_s": 0.7, "dense_over_link_s": 3.4, "limit_s": 4.1},
                     "embrace": [{"strategy": "embrace_schedule", "over_limit": dict(iv, ratio=1.6),
                                  "over_dependency_limit": iv}]}]}
    page = markdown(res)
    assert "`abc1234def`" in page and "| mbart | 0.200 | 0.500 | 0.100 | 0.600 | 25.0 % |" in page
    assert "| mbart/w2/a100-100g | 3.500 | 0.700 + 3.400 | 4.100 |" in page and "1.30 [1.20, 1.40] | 2f3c9b3 |" in page


def test_profile_steps_times_the_stretch_inside_the_step():
    from embrace_fairseq.perf.bench.stretch import profile_steps

    torch.manual_seed(0)
    ids = torch.randint(0, V, (T,))
    nap = 0.1
    m = TinyLM(output=nap)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    res = profile_steps(m, TABLES, lambda i: F.cross_entropy(m(ids), ids), opt, steps=2)
    assert set(res["compute_s"]) == {"forward", "backward", "optimizer"}
    s = res["stretch"]
    assert s["stretch_s"] >= 2 * nap - s["table_grad_s"] and s["step_s"] == pytest.approx(sum(res["compute_s"].values()))
    assert 0 < s["share"] <= 1
