"""Where the 2D schedule's executor takes a reducing backward's start and end.

**The end, under reentrant activation checkpointing.** A reentrant checkpoint (fairseq's
``--checkpoint-activations``, torch's ``checkpoint(use_reentrant=True)``) recomputes its
layer in the backward and runs a backward of its own there. The end-of-backward callback
marks every parameter still without a gradient as unused (zeros) and issues the rest of the
list, so it must run at the end of the step's backward, not of a layer's: the model's
outputs anchor it there. Without the model, a gradient that arrives after that end raises
instead of being lost.

**The start, after a deferred step.** A backward whose hooks fire while the previous step's
deferred all-reduce (next-forward overlap) is not drained raises, naming the cause, instead
of marking its gradients against the previous step's state.

In one process (a one-rank gloo group), in the communication-thread and the single-thread
modes; ``tests/fairseq_adapter/test_fairseq_plugin.py`` and
``tests/deepspeed_adapter/test_ds_fairseq_loop.py`` train with ``--checkpoint-activations``
on several ranks against stock.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule


class Checkpointed(torch.nn.Module):
    """Two layers, each recomputed in the backward, and one that gets no gradient: every
    parameter with a gradient gets it inside a layer's own backward."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.unused = (torch.nn.Linear(4, 4) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.first, x, use_reentrant=self.reentrant)
        return checkpoint(self.second, h, use_reentrant=self.reentrant)


def _reducer(model: torch.nn.Module, single_thread: bool, watch: bool, active=lambda: True) -> ScheduledAllReduce:
    params = list(model.parameters())
    specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i) for i, p in enumerate(params)]
    opts = ScheduleOptions(piece_bytes=64, bucket_bytes=64, max_in_flight=2, compute_bytes_per_s=1e9,
                           link_bytes_per_s=1e9)
    return ScheduledAllReduce(params, build_schedule(specs, opts), None, single_thread=single_thread,
                              module=model if watch else None, active=active)


def _batch() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("single_thread", [False, True], ids=["thread", "single_thread"])
def test_the_step_ends_after_every_checkpointed_layer(gloo1, single_thread, reentrant):
    """Also torch's non-reentrant checkpoint (its default, saved-tensor hooks: no backward
    of its own), which the step's one backward covers."""
    reference = Checkpointed(reentrant)
    reference(_batch()).pow(2).sum().backward()
    model = Checkpointed(reentrant)
    red = _reducer(model, single_thread, watch=True)
    for _ in range(2):  # a second step: the state of the first was reset
        model.zero_grad(set_to_none=True)
        model(_batch()).pow(2).sum().backward()
        red.finish()
        # the unused layer only: both checkpointed layers' gradients came before the end
        assert red.no_grad_last_step == [4, 5]
        for name, p in model.named_parameters():
            want = dict(reference.named_parameters())[name].grad
            assert torch.equal(p.grad, torch.zeros_like(p) if want is None else want), name
    red.remove()


@pytest.mark.parametrize("single_thread", [False, True], ids=["thread", "single_thread"])
def test_without_the_model_a_late_gradient_raises(gloo1, single_thread):
    """The end is taken where the first layer's recompute ends (the second's parameters got
    their gradient there, the first's not yet): the first's gradient then raises, naming
    the cause, instead of reducing the zeros taken for it."""
    model = Checkpointed()
    red = _reducer(model, single_thread, watch=False)
    with pytest.raises(RuntimeError, match="arrived after the end of its backward was taken"):
        model(_batch()).pow(2).sum().backward()
    red.remove()


def test_accumulating_backwards_queue_nothing(gloo1):
    """A backward the reducer does not reduce (gradient accumulation) leaves it untouched;
    the next, reducing one ends after every layer."""
    model = Checkpointed()
    reducing = [False]
    red = _reducer(model, single_thread=False, watch=True, active=lambda: reducing[0])
    model(_batch()).pow(2).sum().backward()
    assert not red._started and not red._end_queued
    reducing[0] = True
    model(_batch()).pow(2).sum().backward()
    red.finish()
    assert red.no_grad_last_step == [4, 5]
    reference = Checkpointed()
    for _ in range(2):
        reference(_batch()).pow(2).sum().backward()
    for name, p in model.named_parameters():
        want = dict(reference.named_parameters())[name].grad
        assert torch.equal(p.grad, torch.zeros_like(p) if want is None else want), name
    red.remove()


def test_a_backward_before_the_deferred_step_drained_raises(gloo1):
    from embrace_fairseq.schedule.next_forward import NextForwardUpdates

    model = Checkpointed()
    red = _reducer(model, single_thread=False, watch=True)
    nf = NextForwardUpdates(model, red)
    model(_batch()).pow(2).sum().backward()
    nf.begin(lambda params: None)
    with pytest.raises(RuntimeError, match="deferred all-reduce was not drained"):
        model(_batch()).pow(2).sum().backward()
    nf.flush()  # drained: the next backward reduces
    model.zero_grad(set_to_none=True)
    model(_batch()).pow(2).sum().backward()
    red.finish()
    assert red.no_grad_last_step == [4, 5]
    nf.remove()
    red.remove()
