"""agreement: the mismatch message names the differing fields with the ranks holding each
value; check_agreement / check_same_plan raise it on every rank (3 real ranks)."""
import pytest

import rank_fns_core as C
from embrace_fairseq.core.agreement import _show, digest60, mismatch_message


def test_message_names_fields_ranks_and_values():
    msg = mismatch_message(["rows", "dim", "pad"], [(11, 4, -1), (11, 4, 3), (12, 4, -1)], "a table", "Fix it.",
                           {"pad": "optional"})
    assert msg == ("the ranks disagree about a table: rows differs (ranks 0,1: 11; ranks 2: 12), "
                   "pad differs (ranks 0,2: None; ranks 1: 3). Fix it.")
    assert "dim" not in msg  # equal fields are not named


def test_show_styles_and_digest():
    assert _show("hex", 255) == "0000000000000ff" and _show("optional", -1) == "None" and _show(None, -1) == "-1"
    assert digest60("x") == digest60("x") != digest60("y") and 0 <= digest60("x") < 2**60


def _res():
    return C.core_results("agreement")  # one spawn of 3 ranks per session, shared by tests/core


def test_agreeing_ranks_pass():
    for r in _res():
        assert r["same"] == ("ok", "") and r["plan_same"] == ("ok", "")


def test_every_rank_raises_naming_ranks_and_values():
    a, b = f"{digest60('a'):015x}", f"{digest60('b'):015x}"
    for rank, r in enumerate(_res()):
        kind, msg = r["differ"]
        assert kind == "ConfigMismatchError", (rank, kind, msg)
        assert msg.startswith("the ranks disagree about the schedule: ") and msg.endswith("Start every rank alike.")
        assert "pieces differs (ranks 0,1: 8; ranks 2: 16)" in msg, msg
        assert f"schedule differs (ranks 0: {a}; ranks 1,2: {b})" in msg, msg
        assert "steps" not in msg
        kind, msg = r["three_values"]
        assert kind == "ConfigMismatchError" and "seed differs (ranks 0: 10; ranks 1: 11; ranks 2: 12)" in msg, msg
        kind, msg = r["plan"]
        assert kind == "ShardPlanMismatchError", (rank, kind, msg)
        assert "padding_idx differs (ranks 0,2: None; ranks 1: 3)" in msg and "rows differs" not in msg, msg
