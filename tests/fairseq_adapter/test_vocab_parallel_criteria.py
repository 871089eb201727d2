"""The criteria's count prefetch starts a collective only for the model it was configured with."""
import types

import torch
import torch.nn as nn
from fairseq.criterions.cross_entropy import CrossEntropyCriterion

from embrace_fairseq.core.sharded_output import ShardedOutputProjection
from embrace_fairseq.fairseq_adapter import vocab_parallel_criteria as vpc


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.output_projection = ShardedOutputProjection(4, 11, mode="vocab-parallel")
        self.output_projection.force_exchange = True  # one rank, but through the collectives


class _Wrapper(nn.Module):  # what fairseq's data-parallel wrappers and DeepSpeed's engine look like
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_prefetch_only_for_the_configured_model(gloo1):
    vpc.apply()
    task = types.SimpleNamespace(target_dictionary=types.SimpleNamespace(pad=lambda: 1))
    criterion = CrossEntropyCriterion(task, sentence_avg=False)
    model = _Decoder()
    vpc.configure(model, criterion)
    layer = model.output_projection
    assert layer.takes_marker
    sample = {"target": torch.tensor([[5, 6, 1], [7, 1, 1]])}

    for runs in (model, _Wrapper(_Wrapper(model))):
        vpc._prefetch_token_counts(criterion, runs, sample)
        assert layer._counts_ahead is not None, "the configured model (or a wrapper of it) prefetches"
        assert layer._counts_ahead.wait() == [3]  # padding removed
        layer._counts_ahead = None
    # another model with the same criterion (a stock copy, run on one rank): no collective
    vpc._prefetch_token_counts(criterion, _Decoder(), sample)
    assert layer._counts_ahead is None
