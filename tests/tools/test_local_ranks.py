"""Local ranks are forked from a fork server that imported torch and fairseq once; each rank
still sees what its caller has at the call, as a spawned rank would: the environment, the
working folder, ``sys.path`` and the standard streams (the server has the ones of the first
call)."""
import os
import textwrap

import rank_fns_local_ranks as fns

from embrace_fairseq.tools.local_ranks import RanksFailed, run_ranks, world_of


def test_ranks_take_the_callers_environment_and_folder(monkeypatch, tmp_path):
    run_ranks(world_of, 2)  # the fork server runs from here on
    monkeypatch.setenv("EMBRACE_TEST_LOCAL_RANKS", "after the server started")
    monkeypatch.chdir(tmp_path)
    got = run_ranks(fns.environment_and_folder, 3, "EMBRACE_TEST_LOCAL_RANKS")
    assert got == [("after the server started", str(tmp_path))] * 3
    monkeypatch.delenv("EMBRACE_TEST_LOCAL_RANKS")
    assert run_ranks(fns.environment_and_folder, 2, "EMBRACE_TEST_LOCAL_RANKS") == [(None, str(tmp_path))] * 2


def test_a_rank_function_on_a_path_added_later(monkeypatch, tmp_path):
    run_ranks(world_of, 2)
    (tmp_path / "late_rank_fns.py").write_text(textwrap.dedent("""
        def pid_and_rank(rank, world):
            import os
            return os.getpid(), rank
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import late_rank_fns

    got = run_ranks(late_rank_fns.pid_and_rank, 2)
    assert [r for _, r in got] == [0, 1]
    assert len({pid for pid, _ in got} | {os.getpid()}) == 3  # a process each, not the caller


def test_rank_output_reaches_the_callers_stderr(capfd):
    run_ranks(world_of, 2)
    capfd.readouterr()
    assert run_ranks(fns.say_on_stderr, 2, "written by rank") == [0, 1]
    err = capfd.readouterr().err
    assert "written by rank 0" in err and "written by rank 1" in err


def test_a_failing_rank_names_its_error():
    try:
        run_ranks(fns.environment_and_folder, 2)  # its third argument is missing
    except RanksFailed as e:
        assert "TypeError" in str(e) and "rank 0" in str(e) and "rank 1" in str(e)
    else:
        raise AssertionError("no RanksFailed")
