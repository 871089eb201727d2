"""ids: what counts as a valid id, which one is reported, and the message every rank raises."""
import pytest
import torch

from embrace_fairseq.core.ids import InvalidIdError, invalid_id_message, validate_ids


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_valid_ids_pass(dtype):
    assert validate_ids(torch.tensor([0, 4, 9], dtype=dtype), 10) is None
    assert validate_ids(torch.zeros(0, dtype=dtype), 10) is None  # an empty batch is legal
    assert validate_ids(torch.zeros(0, dtype=dtype), 0) is None
    assert validate_ids(torch.tensor([[9, 9], [0, 1]], dtype=dtype), 10) is None


@pytest.mark.parametrize("ids,vocab,bad", [
    ([3, 10, 2], 10, 10),  # one past the end
    ([3, 12, 11], 10, 12),  # the largest one above the range
    ([-1, 3], 10, -1),
    ([-5, 40, -2], 10, -5),  # below and above: the smallest (negative) one
    ([0], 0, 0),  # any id of an empty table
])
def test_first_offending_id(ids, vocab, bad):
    assert validate_ids(torch.tensor(ids), vocab) == bad
    assert validate_ids(torch.tensor(ids, dtype=torch.int32).view(1, -1), vocab) == bad


def test_message_and_error_type():
    msg = invalid_id_message(12, 10, 2)
    assert msg == "embedding id 12 is out of range for a table of 10 rows (valid ids are 0..9); seen on rank 2"
    assert issubclass(InvalidIdError, ValueError)
