"""The fairseq data-parallel wrapper of the 2D schedule, in process on a one-rank gloo
group: what fairseq's trainer asks of it (``no_sync``, ``all_reduce_grads``) and when it
is used. Equivalence with the stock backends on 2 and 3 ranks: test_fairseq_plugin.py."""
import torch
import torch.nn as nn

from embrace_fairseq.fairseq_adapter.scheduled_ddp import ScheduledDataParallel, wants_schedule


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_accumulates_under_no_sync_and_reduces_at_the_last_backward(gloo1):
    ref, ours = _model(), _model()
    wrapped = ScheduledDataParallel(ours)
    xs = [torch.randn(3, 4) for _ in range(3)]
    for x in xs:
        ref(x).square().sum().backward()
    for x in xs[:-1]:
        with wrapped.no_sync():
            wrapped(x).square().sum().backward()
            assert not wrapped.reducer._started  # the hooks stood aside: only accumulated
            wrapped.all_reduce_grads()  # inside no_sync: nothing to reduce yet
    wrapped(xs[-1]).square().sum().backward()
    assert wrapped.reducer._started  # the last backward fed the schedule
    wrapped.all_reduce_grads()
    assert not wrapped.reducer._started  # finished and reset for the next update
    for a, b in zip(_grads(ref), _grads(ours)):
        torch.testing.assert_close(a, b)  # one rank: the average is the sum itself
    # the next update starts clean: the reducer took every piece of this one
    for p in ours.parameters():
        p.grad = None
    wrapped(xs[0]).square().sum().backward()
    wrapped.all_reduce_grads()
    assert all(p.grad is not None for p in ours.parameters())


def test_used_only_for_models_with_sharded_tables_and_the_flag_on(gloo1):
    model = _model()
    assert not wants_schedule(model)  # no sharded table
    model.embrace_schedule = "on"
    assert not wants_schedule(model)  # still none: fairseq's own wrapper
