"""Analytic byte bounds: hand-computed cases, and the exchange sends exactly the minimum."""
import pytest
import torch

from embrace_fairseq.perf.bounds import STRATEGIES, min_bytes_per_step
from embrace_fairseq.tools.local_ranks import run_ranks

# V=10 over 2 ranks: rank 0 owns 0..4, rank 1 owns 5..9; D=4 fp32 rows of 16 bytes.
IDS_2 = [torch.tensor([[0, 1, 2, 7, 7]]), torch.tensor([3, 5, 6, 6])]


def _bounds(strategy, **kw):
    args = dict(world_size=2, vocab=10, dim=4, dense_numel=100, ids_per_rank=IDS_2, layout="contiguous")
    args.update(kw)
    return min_bytes_per_step(strategy, **args)


@pytest.mark.parametrize("strategy", ["fairseq_legacy_ddp", "fairseq_c10d", "deepspeed"])
def test_dense_strategies_all_reduce_everything(strategy):
    b = _bounds(strategy)
    # ring all-reduce on 2 ranks sends half of 2x the payload: the payload itself
    assert b == {"table_grad": 160.0, "dense_grad": 400.0, "total": 560.0}
    b4 = _bounds(strategy, world_size=4, ids_per_rank=IDS_2 * 2)
    assert b4["table_grad"] == 2 * 3 / 4 * 160 and b4["dense_grad"] == 2 * 3 / 4 * 400


def test_sparse_allgather_hand_count():
    b = _bounds("sparse_allgather")
    # unique ids: rank 0 {0,1,2,7}, rank 1 {3,5,6}: 7 blocks of an id and a row;
    # each rank sends the other's... its own block in a 2-rank all-gather: (N-1)/N of all
    assert b["ids"] == 0.5 * 7 * 4
    assert b["grad_rows"] == 0.5 * 7 * 16
    assert b["counts"] == 2 * 0.5 * 2 * 8  # sizes gathered twice (indices, values), int64
    assert b["dense_grad"] == 400.0
    assert b["total"] == 14 + 56 + 16 + 400
    tied = _bounds("sparse_allgather", tied_output="gather")
    assert tied == {"table_grad": 160.0, "dense_grad": 400.0, "total": 560.0}


@pytest.mark.parametrize("strategy", ["embrace_noschedule", "embrace_schedule"])
def test_embrace_hand_count(strategy):
    b = _bounds(strategy)
    # rank 0 asks rank 1 for id 7; rank 1 asks rank 0 for id 3: one id each way
    assert b["ids"] == 4.0 and b["rows"] == 16.0 and b["grad_rows"] == 16.0
    assert b["counts"] == 4.0  # one count to the one peer
    assert b["dense_grad"] == 400.0 and b["total"] == 440.0
    tied = _bounds(strategy, tied_output="gather")
    assert tied["table_gather"] == 80.0 and tied["table_grad"] == 80.0
    assert tied["total"] == 440.0 + 160.0
    # ids all owned locally: nothing but the header and the dense part
    local = _bounds(strategy, ids_per_rank=[torch.tensor([0, 4]), torch.tensor([5, 9])])
    assert local["ids"] == local["rows"] == local["grad_rows"] == 0.0


@pytest.mark.parametrize("strategy", ["deepspeed_zero1", "deepspeed_zero2"])
def test_zero_reduce_scatters_and_gathers_the_parameters(strategy):
    b = _bounds(strategy)
    # 2 ranks: a reduce-scatter sends half of the gradients, the all-gather half of the parameters
    assert b == {"table_grad": 80.0, "dense_grad": 200.0, "param_gather": 280.0, "total": 560.0}
    b4 = _bounds(strategy, world_size=4, ids_per_rank=IDS_2 * 2)
    assert b4["param_gather"] == 3 / 4 * 560 and b4["total"] == 2 * 3 / 4 * 560  # an all-reduce's worth


def test_embrace_vocab_parallel_output_hand_count():
    # 2 ranks with 3 and 5 target tokens, D=4 fp32 rows of 16 bytes, int32 ids
    b = _bounds("embrace_schedule", tied_output="vocab_parallel", tokens_per_rank=[3, 5])
    # each rank sends its own states to the other and the other's rows of the gradient back:
    # rank 0 3 rows out, 5 back; rank 1 5 out, 3 back; a mean of 4 rows each way
    assert b["hidden_gather"] == 4 * 16 and b["hidden_grad"] == 4 * 16
    # a count (int64), the targets (int32), the upstream gradients and logZ (2 fp32) of
    # 4 tokens on average, and three fp32 statistics per token to the owners of the
    # other's tokens (4 tokens on average)
    assert b["softmax_stats"] == 8 + 4 * (4 + 8) + 4 * 3 * 4
    assert "table_gather" not in b and b["total"] == 440.0 + 64 + 64 + 8 + 48 + 48
    with pytest.raises(ValueError, match="tokens_per_rank"):
        _bounds("embrace_schedule", tied_output="vocab_parallel")
    with pytest.raises(ValueError, match="tokens_per_rank"):
        _bounds("embrace_schedule", tied_output="vocab_parallel", tokens_per_rank=[3])


def test_embrace_is_flat_in_n_and_sparse_grows():
    # the same 3 unique remote ids per rank, N = 2..8: EmbRace's per-rank volume stays,
    # the all-gather's grows with N
    totals = {}
    for n in (2, 4, 8):
        v = 8 * n
        ids = [torch.tensor([(r * 8 + 8 + k) % v for k in range(3)]) for r in range(n)]
        e = min_bytes_per_step("embrace_schedule", world_size=n, vocab=v, dim=16, dense_numel=0, ids_per_rank=ids,
                               layout="contiguous")
        s = min_bytes_per_step("sparse_allgather", world_size=n, vocab=v, dim=16, dense_numel=0, ids_per_rank=ids)
        totals[n] = (e["rows"], s["grad_rows"])
    assert totals[2][0] == totals[4][0] == totals[8][0] == 3 * 16 * 4
    assert totals[2][1] < totals[4][1] < totals[8][1]


def test_world_of_one_and_bad_input():
    one = min_bytes_per_step("deepspeed", world_size=1, vocab=5, dim=2, dense_numel=7, ids_per_rank=[torch.tensor([1])])
    assert one == {"total": 0.0}
    with pytest.raises(ValueError, match="unknown strategy"):
        _bounds("horovod")
    with pytest.raises(ValueError, match="2 ranks"):
        _bounds("deepspeed", ids_per_rank=IDS_2[:1])
    with pytest.raises(ValueError, match="outside"):
        _bounds("embrace_schedule", ids_per_rank=[torch.tensor([10]), torch.tensor([0])])
    with pytest.raises(ValueError, match="tied_output"):
        _bounds("embrace_schedule", tied_output="full_logits")
    assert set(STRATEGIES) >= {"fairseq_legacy_ddp", "deepspeed", "sparse_allgather", "embrace_schedule"}


def _ids_for(rank, world, vocab):
    g = torch.Generator().manual_seed(50 + rank)
    ids = torch.randint(0, vocab, (4, 7), generator=g)
    ids[0, :3] = ids[0, 3]  # repeats: counted once
    return ids


def ledger_of_one_step(rank, world, vocab, dim, tied):
    """Rank body: one ShardedEmbedding forward + backward (and a tied projection)."""
    from embrace_fairseq import CommLedger, ShardedEmbedding

    torch.manual_seed(3)
    ledger = CommLedger()
    emb = ShardedEmbedding(vocab, dim, padding_idx=1, ledger=ledger)
    ids = _ids_for(rank, world, vocab)
    y = emb(ids)
    loss = y.square().sum()
    if tied:
        loss = loss + (y @ emb.gathered_weight().t()).square().sum()
    loss.backward()
    return dict(ledger.sent)


@pytest.mark.parametrize(
    "world,vocab",
    # 3 ranks with an uneven vocab, and 2 ranks
    [(2, 40), (3, 41)],
)
def test_exchange_sends_the_minimum(world, vocab):
    dim = 6
    sent = run_ranks(ledger_of_one_step, world, vocab, dim, True)
    ids = [_ids_for(r, world, vocab) for r in range(world)]
    bound = min_bytes_per_step(
        "embrace_schedule", world_size=world, vocab=vocab, dim=dim, dense_numel=0, ids_per_rank=ids, tied_output="gather"
    )
    mean = {k: sum(s.get(k, 0) for s in sent) / world for k in ("ids", "rows", "grad_rows", "table_grad", "table_gather")}
    assert bound["ids"] > 0
    for kind in ("ids", "rows", "grad_rows", "table_grad"):
        assert mean[kind] == pytest.approx(bound[kind], rel=1e-12), (kind, mean, bound)
    # gloo's all-gather needs equal blocks: shards padded to the largest one
    pad_rows = (world - 1) * (-(-vocab // world) * world - vocab) / world
    assert mean["table_gather"] == pytest.approx(bound["table_gather"] + pad_rows * dim * 4)
