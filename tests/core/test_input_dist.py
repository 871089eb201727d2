"""input_dist.plan_exchange in real gloo ranks (3 ranks and the 2-rank subgroup, uneven
vocabularies, a vocabulary smaller than the world): what each rank gets equals a hand
computation from all ranks' ids."""
import pytest
import torch

import rank_fns_core as C


def _results():
    return C.core_results("input_dist")  # one spawn of 3 ranks per session, shared by tests/core


def expected(vocab, members, case, rank):
    """By hand: every rank's unique ids, who owns each, who asks what of whom."""
    bounds = C.hand_bounds(vocab, members)
    uniq = {q: sorted(set(C.case_ids(case, q, members, vocab).reshape(-1).tolist())) for q in range(members)}
    mine = uniq[rank]
    ids = C.case_ids(case, rank, members, vocab).reshape(-1).tolist()
    return {
        "unique_ids": mine,
        "inverse": [mine.index(i) for i in ids],
        "send_counts": [sum(1 for u in mine if C.hand_owner(u, bounds) == o) for o in range(members)],
        "recv_counts": [sum(1 for u in uniq[q] if C.hand_owner(u, bounds) == rank) for q in range(members)],
        "requested_local": [u - bounds[rank] for q in range(members) for u in uniq[q]
                            if C.hand_owner(u, bounds) == rank],
    }


@pytest.mark.parametrize("vocab,members", C.CONFIGS)
def test_exchange_plan_matches_hand_computation(vocab, members):
    res = _results()
    for case in C.ID_CASES:
        for rank in range(members):
            got = res[rank][(vocab, members, case)]
            assert got == expected(vocab, members, case, rank), (vocab, members, case, rank)
    # the cases exercise what they are named for
    if vocab > members:
        last = members - 1
        assert res[last][(vocab, members, "empty_last")]["unique_ids"] == []
        assert sum(res[0][(vocab, members, "random")]["send_counts"][1:]) > 0  # ids do cross ranks
    assert all(res[r][(vocab, members, "all_ids")]["recv_counts"] == [C.hand_bounds(vocab, members)[r + 1]
                                                                      - C.hand_bounds(vocab, members)[r]] * members
               for r in range(members))


@pytest.mark.parametrize("vocab,members", C.CONFIGS)
def test_invalid_id_raises_on_every_rank(vocab, members):
    res = _results()
    for bad_rank, bad_value in ((members - 1, vocab), (0, -3)):
        for rank in range(members):
            kind, msg = res[rank][(vocab, members, "bad", bad_rank, bad_value)]
            assert kind == "InvalidIdError", (rank, kind, msg)
            assert f"embedding id {bad_value} " in msg and f"table of {vocab} rows" in msg, msg
            assert f"seen on rank {bad_rank}" in msg, msg
            if rank != bad_rank:
                assert f"raised on rank {rank} too" in msg, msg
        # and no rank was left inside a collective
        assert all(res[r][(vocab, members, "after_bad")] == list(range(vocab)) for r in range(members))
