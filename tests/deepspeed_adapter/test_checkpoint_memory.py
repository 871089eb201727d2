"""The memory a checkpoint save costs a rank that does not write it, under ZeRO-1 and
ZeRO-2 (real DeepSpeed, real gloo ranks): the writer gets every rank's optimizer
partition and RNG state; the other ranks deserialise nothing of their peers' (it used
to be every rank's state on every rank: world x state per GPU)."""
import pytest

pytest.importorskip("deepspeed")

from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402

from rank_fns_checkpoint_memory import save_receipts  # noqa: E402


def _received_by_non_writers(world):
    res = run_ranks(save_receipts, world, timeout_s=300, pg_timeout_s=120)
    received = {}
    for stage in (1, 2):
        writer, others = res[0][stage], [r[stage] for r in res[1:]]
        assert writer["full"] and not any(r["full"] for r in others)
        assert writer["per_rank_states"] == writer["rng_states"] == world and writer["states_load"]
        # the writer holds each rank's own partition, as that rank serialised it
        assert writer["per_rank_bytes"] == [r[stage]["own_state_bytes"] for r in res]
        assert writer["received"] > sum(r["own_state_bytes"] for r in others)  # its peers' states and RNGs
        received[stage] = [r["received"] for r in others]
    return received


def test_non_writers_receive_no_peer_state():
    assert _received_by_non_writers(3) == {1: [0, 0], 2: [0, 0]}


@pytest.mark.slow
def test_non_writer_receipts_do_not_grow_with_the_world_size():
    assert _received_by_non_writers(2) == {1: [0], 2: [0]}  # as at 3 ranks (the default test)
