"""Host synchronisations removed from the hot path, counted on CPU: every op that reads
a device value back to the host (``_local_scalar_dense``: ``int()``, ``.item()``;
``nonzero``, whose output size is the count of a device tensor; ``.tolist()``) is
recorded while the function runs, and the values are checked against a reference."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from embrace_fairseq.core import vocab_parallel as V
from embrace_fairseq.core.ids import validate_ids

READ_BACKS = ("_local_scalar_dense", "nonzero")


class _ReadBacks(TorchDispatchMode):
    """Names of the ops the dispatcher sees that wait for the device's values."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in READ_BACKS):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def read_backs(monkeypatch):
    """Read-backs of the block (``.tolist()`` on CPU bypasses the dispatcher: counted by a
    wrapper)."""
    mode = _ReadBacks()
    tolist = torch.Tensor.tolist

    def counted(self):
        if mode.active:
            mode.ops.append("tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return mode


@pytest.mark.parametrize("ids,want", [
    ([3, 0, 9, 4], None), ([3, -2, 11, -7], -7), ([3, 12, 10, 1], 12), ([[9, 0], [10, 2]], 10)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_validate_ids_reads_the_range_back_once(ids, want, dtype, read_backs):
    t = torch.tensor(ids, dtype=dtype)
    with read_backs:
        got = validate_ids(t, 10)
    assert got == want and (got is None or isinstance(got, int))
    assert read_backs.ops == ["tolist"], read_backs.ops  # min and max in one read-back
    read_backs.ops.clear()
    with read_backs:
        assert validate_ids(torch.zeros(0, dtype=dtype), 10) is None
    assert read_backs.ops == []


def _vocab_inputs(tokens, shard, dim=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    col = torch.randint(-1, shard, (tokens,), generator=g) if shard else torch.full((tokens,), -1)
    return dict(col=col, z=torch.randn(tokens, shard, generator=g), weight=torch.randn(shard, dim, generator=g),
                hidden=torch.randn(tokens, dim, generator=g), q=torch.randn(tokens, dim, generator=g),
                e=torch.randn(tokens, shard, generator=g), coef=torch.randn(tokens, generator=g),
                g_nll=torch.randn(tokens, generator=g), g_smooth=torch.randn(tokens, generator=g))


@pytest.mark.parametrize("tokens,shard", [(9, 5), (6, 0), (0, 4), (7, 3)])
def test_vocab_parallel_target_terms_without_a_host_sync(tokens, shard, read_backs):
    """``z_y``, and the target's terms of both gradients, equal the dense one-hot
    formulas, with no read-back (they used ``nonzero``), also for an empty shard and no
    tokens."""
    x = _vocab_inputs(tokens, shard)
    col, owned = x["col"], x["col"] >= 0
    onehot = torch.zeros(tokens, shard)
    onehot[owned.nonzero().squeeze(1), col[owned]] = 1.0  # the reference (outside the count)
    with read_backs:
        zy = V.target_logits(x["z"], col)
        dh = V.hidden_grad(x["q"].clone(), x["weight"], col, x["coef"], x["g_nll"], None)
        gw = V.weight_grad(x["e"], x["hidden"], col, x["coef"], x["g_nll"], None)
    assert read_backs.ops == [], read_backs.ops
    assert torch.equal(zy, (x["z"] * onehot).sum(1))
    want_dh = x["q"] * x["coef"].unsqueeze(1) - x["g_nll"].unsqueeze(1) * (onehot @ x["weight"])
    torch.testing.assert_close(dh, want_dh, rtol=1e-6, atol=1e-6)
    want_gw = x["e"].t() @ (x["hidden"] * x["coef"].unsqueeze(1)) - onehot.t() @ (x["hidden"] * x["g_nll"].unsqueeze(1))
    torch.testing.assert_close(gw, want_gw, rtol=1e-6, atol=1e-6)
