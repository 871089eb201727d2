"""schedule.plan (pure): readiness order, buckets, piece cutting, the simulated issue
order with both dimensions on and off, and determinism."""
import random

import pytest

from embrace_fairseq.schedule.plan import (
    Bucket,
    ScheduleOptions,
    TensorSpec,
    build_schedule,
    cut_pieces,
    make_buckets,
    readiness_order,
)


def specs(sizes, esize=4):
    return [TensorSpec(f"l{i}", n, esize, i) for i, n in enumerate(sizes)]


def test_schedule_is_static_and_prioritised():
    """Model level: the input-near bucket overtakes the rest of a big earlier one;
    off: readiness order. Tensor level off: one collective per bucket."""
    sp = specs([1000, 400_000, 1000, 2_000_000, 1000])
    on = build_schedule(sp, ScheduleOptions(piece_bytes=256 << 10, bucket_bytes=1 << 20))
    again = build_schedule(sp, ScheduleOptions(piece_bytes=256 << 10, bucket_bytes=1 << 20))
    assert on.issue_order == again.issue_order
    input_bucket = min(on.buckets, key=lambda b: b.priority).index
    order = [p.bucket for p in on.issue_order]
    # the input-near bucket finishes before the last piece of a bigger, earlier-ready one
    assert max(i for i, b in enumerate(order) if b == input_bucket) < max(i for i, b in enumerate(order) if b != input_bucket)
    fifo = build_schedule(sp, ScheduleOptions(model_level=False, piece_bytes=256 << 10, bucket_bytes=1 << 20))
    assert [p.bucket for p in fifo.issue_order] == sorted(p.bucket for p in fifo.issue_order)
    whole = build_schedule(sp, ScheduleOptions(tensor_level=False, bucket_bytes=1 << 20))
    assert len(whole.issue_order) == len(whole.buckets)
    # every element of every bucket is covered exactly once
    for sched in (on, fifo, whole):
        for b in sched.buckets:
            pieces = sorted(sched.pieces_of(b.index), key=lambda p: p.start)
            assert sum(p.numel for p in pieces) == b.numel and pieces[0].start == 0


def test_readiness_order_is_reverse_position():
    sp = [TensorSpec("a", 1, 4, 0), TensorSpec("b", 1, 4, 2), TensorSpec("c", 1, 4, 1), TensorSpec("d", 1, 4, 2)]
    assert readiness_order(sp) == [3, 1, 2, 0]  # farthest from the input first; ties: reverse registration


def test_buckets_fill_up_to_the_limit_in_readiness_order():
    sp = specs([100, 100, 100, 1000, 50])  # 400, 400, 400, 4000, 200 bytes
    ready = readiness_order(sp)  # 4, 3, 2, 1, 0
    buckets = make_buckets(sp, ready, 1000)
    assert [b.tensors for b in buckets] == [(4,), (3,), (2, 1), (0,)]  # the 4000-byte tensor alone
    assert [b.nbytes for b in buckets] == [200, 4000, 800, 400]
    assert [b.priority for b in buckets] == [4, 3, 1, 0]  # the most input-near tensor of each
    assert [b.index for b in buckets] == [0, 1, 2, 3]


@pytest.mark.parametrize("numel,esize,piece", [(1000, 4, 256), (1001, 4, 256), (7, 2, 4), (10, 4, 40), (10, 4, 4000),
                                               (999_983, 4, 1 << 16)])
def test_pieces_cover_the_bucket_in_near_equal_slices(numel, esize, piece):
    b = Bucket(index=5, tensors=(0,), numel=numel, nbytes=numel * esize, priority=0)
    pieces = cut_pieces(b, piece)
    assert all(p.bucket == 5 for p in pieces) and [p.index for p in pieces] == list(range(len(pieces)))
    assert pieces[0].start == 0 and all(p.start + p.numel == q.start for p, q in zip(pieces, pieces[1:]))
    assert sum(p.numel for p in pieces) == numel
    sizes = [p.numel for p in pieces]
    assert max(sizes) - min(sizes) <= 1
    assert all(p.nbytes == p.numel * esize <= max(piece, esize) for p in pieces)
    assert len(pieces) == max(1, -(-numel * esize // piece))  # as few as the limit allows
    assert cut_pieces(b, None) == [type(pieces[0])(5, 0, 0, numel, numel * esize)]
    assert cut_pieces(Bucket(0, (), 0, 0, 0), piece) == []


def test_urgent_piece_overtakes_with_the_model_level_only():
    # a huge output-near layer becomes ready first, the input layer right after it
    sp = [TensorSpec("embed_near", 1000, 4, 0), TensorSpec("huge", 4_000_000, 4, 5)]
    opts = dict(piece_bytes=1 << 20, bucket_bytes=1 << 20, max_in_flight=1)
    on = build_schedule(sp, ScheduleOptions(**opts))
    off = build_schedule(sp, ScheduleOptions(model_level=False, **opts))
    near = next(b.index for b in on.buckets if b.priority == 0)
    pos_on = [p.bucket for p in on.issue_order].index(near)
    pos_off = [p.bucket for p in off.issue_order].index(near)
    assert pos_off == len(off.issue_order) - 1  # readiness order: behind every piece of the huge bucket
    assert pos_on < pos_off  # priority: it jumps the queue as soon as it is ready
    assert len(on.simulated) == len(on.issue_order) and all(s <= e for s, e in on.simulated)


def test_deterministic_whatever_the_call_history():
    rng = random.Random(3)
    sp = [TensorSpec(f"t{i}", rng.randint(1, 300_000), rng.choice([2, 4]), rng.randint(0, 9)) for i in range(40)]
    opts = ScheduleOptions(piece_bytes=64 << 10, bucket_bytes=256 << 10, max_in_flight=3)
    first = build_schedule(sp, opts)
    build_schedule(list(reversed(sp)), opts)  # something else in between
    second = build_schedule(list(sp), opts)
    assert first.issue_order == second.issue_order and first.describe() == second.describe()
    # every piece exactly once
    assert len(set(first.issue_order)) == len(first.issue_order) == sum(
        len(cut_pieces(b, opts.piece_bytes)) for b in first.buckets)


@pytest.mark.parametrize("bad,match", [({"piece_bytes": 0}, "piece_bytes"), ({"max_in_flight": 0}, "max_in_flight"),
                                       ({"bucket_bytes": -1}, "bucket_bytes")])
def test_options_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        ScheduleOptions(**bad)
