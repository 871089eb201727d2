"""ledger: CommLedger bookkeeping, and the bytes the exchanges record per kind for a small
exchange on 3 real ranks against a count made by hand."""
import threading

import pytest

import rank_fns_core as C
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.ledger import CommLedger, global_ledger, ledgers_for, off_rank, record_all


def test_record_totals_snapshot_reset():
    led = CommLedger()
    led.record(K.IDS, 8, 4)
    led.record(K.IDS, 2, 6)
    led.record(K.ROWS, 100, 0, inter_node=40)
    assert led.snapshot() == {"sent": {"ids": 10, "rows": 100}, "received": {"ids": 10, "rows": 0},
                              "calls": {"ids": 2, "rows": 1}, "inter_node": {"ids": 10, "rows": 40}}
    assert led.total_sent() == 110 and led.total_sent([K.ROWS, K.COUNTS]) == 100
    assert led.total_received([K.IDS]) == 10
    led.reset()
    assert led.snapshot() == {"sent": {}, "received": {}, "calls": {}, "inter_node": {}}


def test_record_is_thread_safe():
    led = CommLedger()

    def hammer():
        for _ in range(2000):
            led.record(K.DENSE_GRAD, 1, 2)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert led.sent[K.DENSE_GRAD] == 8000 and led.received[K.DENSE_GRAD] == 16000 and led.calls[K.DENSE_GRAD] == 8000


def test_ledgers_for_and_off_rank():
    extra = CommLedger()
    assert ledgers_for(None) == [global_ledger()]
    assert ledgers_for(global_ledger()) == [global_ledger()]  # never counted twice
    both = ledgers_for(extra)
    assert both[0] is global_ledger() and both[1] is extra and len(both) == 2
    before = global_ledger().sent[K.COUNTS]
    record_all([extra], K.COUNTS, 5, 7)
    assert extra.sent[K.COUNTS] == 5 and global_ledger().sent[K.COUNTS] == before
    assert off_rank([3, 4, 5], 1) == 8 and off_rank([3, 4, 5], 0) == 9 and off_rank([], 0) == 0


# 7 rows over 3 ranks: rank 0 owns 0..2, rank 1 owns 3..4, rank 2 owns 5..6; D = 2 fp32 (8 B a row).
# ids: rank 0 [0, 1, 1, 5, 6] -> unique {0,1,5,6}: asks rank 0 for 2, rank 2 for 2
#      rank 1 [3, 4, 0, 3]    -> unique {0,3,4}:   asks rank 0 for 1, rank 1 for 2
#      rank 2 []              -> asks nothing
# so rank 0 is asked 2 (itself) + 1 (rank 1); rank 1 is asked 2 (itself); rank 2 is asked 2 (rank 0).
# Only what leaves a rank counts: the part of an AlltoAll a rank sends itself stays home.
HEADER = 2 * 3 * 8  # two peers, three int64 fields each way
EXCHANGE = {
    #        ids (int32) sent, received   rows sent, received   gradient rows sent, received
    0: {"ids": (2 * 4, 1 * 4), "rows": (1 * 8, 2 * 8), "grad_rows": (2 * 8, 1 * 8)},
    1: {"ids": (1 * 4, 0), "rows": (0, 1 * 8), "grad_rows": (1 * 8, 0)},
    2: {"ids": (0, 2 * 4), "rows": (2 * 8, 0), "grad_rows": (0, 2 * 8)},
}
# all-gather: shards padded to 3 rows (3 x 8 B); each rank sends its part to 2 peers and gets 2.
# reduce-scatter: a rank sends the rows it does not own, gets its own rows from 2 peers.
PART = 3 * 8
TABLE = {0: {"table_grad": ((7 - 3) * 8, 2 * 3 * 8)},
         1: {"table_grad": ((7 - 2) * 8, 2 * 2 * 8)},
         2: {"table_grad": ((7 - 2) * 8, 2 * 2 * 8)}}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_exchange_bytes_equal_hand_count(rank):
    snap = C.core_results("ledger")[rank]["exchange"]
    want_sent = {"counts": HEADER, **{k: v[0] for k, v in EXCHANGE[rank].items()}}
    want_recv = {"counts": HEADER, **{k: v[1] for k, v in EXCHANGE[rank].items()}}
    assert snap["sent"] == want_sent and snap["received"] == want_recv, snap
    assert snap["calls"] == {"counts": 1, "ids": 1, "rows": 1, "grad_rows": 1}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_table_bytes_equal_hand_count(rank):
    res = C.core_results("ledger")[rank]
    snap = res["table"]
    # gather_full and a PendingGather: two all-gathers
    assert snap["sent"]["table_gather"] == 2 * 2 * PART and snap["received"]["table_gather"] == 2 * 2 * PART
    assert (snap["sent"]["table_grad"], snap["received"]["table_grad"]) == TABLE[rank]["table_grad"]
    assert snap["calls"] == {"table_gather": 2, "table_grad": 1}
    # the process-wide ledger got every record too
    for what in ("sent", "received", "calls"):
        total = {k: res["exchange"][what].get(k, 0) + snap[what].get(k, 0)
                 for k in set(res["exchange"][what]) | set(snap[what])}
        assert res["global"][what] == total, what
