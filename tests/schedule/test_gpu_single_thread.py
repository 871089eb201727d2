"""The scheduled dense all-reduce as NCCL needs it, shown on a one-rank gloo group:
single-thread mode issues every piece from the autograd thread in the list's order;
credits wait for a piece to *finish* (Pending.synchronize: a CUDA event on GPUs); the
exchange gate's lock is never held across a collective."""
import threading

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.schedule.executor import ExchangeGate, ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))


def _reducer(model, credit, **kw):
    params = list(model.parameters())
    specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i) for i, p in enumerate(params)]
    opts = ScheduleOptions(piece_bytes=64, bucket_bytes=256, max_in_flight=credit)
    return ScheduledAllReduce(params, build_schedule(specs, opts), None, **kw)


def _record(monkeypatch, log, check=None):
    real = collectives.all_reduce_async

    class Traced:
        def __init__(self, p, k):
            self.p, self.k = p, k

        def __getattr__(self, name):
            return getattr(self.p, name)

        def synchronize(self):
            log.append(("finished", self.k))
            return self.p.synchronize()

    def issue(t, group=None):
        k = sum(1 for e in log if e[0] == "issue")
        log.append(("issue", k, threading.get_ident()))
        if check is not None:
            check()
        return Traced(real(t, group), k)

    monkeypatch.setattr(collectives, "all_reduce_async", issue)


def test_single_thread_issues_from_the_autograd_thread_in_list_order(gloo1, monkeypatch):
    model = _model()
    log = []
    _record(monkeypatch, log)
    red = _reducer(model, credit=1, single_thread=True)
    ref = _model()
    model(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    issued_in_backward = [e for e in log if e[0] == "issue"]
    assert issued_in_backward, "pieces are issued during backward, from the hooks"
    red.finish()
    issues = [e for e in log if e[0] == "issue"]
    assert len(issues) == len(red.schedule.issue_order)
    assert {e[2] for e in issues} == {threading.get_ident()}  # CPU autograd runs on this thread
    # credit 1: a piece is issued only after the previous one finished
    order = [(e[0], e[1]) for e in log]
    for k in range(1, len(issues)):
        assert order.index(("finished", k - 1)) < order.index(("issue", k))
    ref(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)  # world of one: the average is the gradient


def test_single_thread_gate_defers_pieces_until_the_exchange_is_done(gloo1, monkeypatch):
    model = _model()
    log = []
    _record(monkeypatch, log)
    gate = ExchangeGate()
    red = _reducer(model, credit=2, single_thread=True, gate=gate)
    gate.enter()  # an embedding exchange in flight for the whole backward
    model(torch.randn(5, 8)).sum().backward()
    assert not log, "no piece while the gate is closed"
    gate.leave()  # opens: the ready pieces go now, in order, as far as free credits allow (a
    # hook never blocks on a credit: the piece holding it may wait for a peer's fence)
    issued = [e[1] for e in log if e[0] == "issue"]
    assert len(issued) >= 2 and issued == list(range(len(issued)))  # both credits were free
    red.finish()
    assert [e[1] for e in log if e[0] == "issue"] == list(range(len(red.schedule.issue_order)))


def test_thread_mode_holds_no_lock_across_a_collective(gloo1, monkeypatch):
    model = _model()
    gate = ExchangeGate()
    free = []

    def lock_is_free():
        got = gate._cond.acquire(blocking=False)
        free.append(got)
        if got:
            gate._cond.release()

    _record(monkeypatch, [], check=lock_is_free)
    red = _reducer(model, credit=2, single_thread=False, gate=gate)
    model(torch.randn(5, 8)).sum().backward()
    red.finish()
    assert free and all(free)
