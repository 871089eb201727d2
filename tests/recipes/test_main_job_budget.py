"""The main job's time budget: training gets what set-up and data preparation left."""
import pytest

from embrace_fairseq.recipes import main_job


def test_training_gets_the_rest_of_the_budget_less_the_reserve():
    assert main_job.training_minutes(30, 0) == pytest.approx(30 - main_job.RESERVE_MIN)
    assert main_job.training_minutes(30, 9.5 * 60) == pytest.approx(20.5 - main_job.RESERVE_MIN)
    # set-up ate the budget: a short run that overruns it rather than no model at all
    assert main_job.training_minutes(30, 29 * 60) == main_job.MIN_TRAIN_MIN


def test_defaults_are_the_time_budget_with_an_update_cap():
    a = main_job._parse([])
    assert a.time_budget == main_job.TIME_BUDGET_MIN == 30.0
    assert a.max_update == main_job.MAX_UPDATE
    # a comparison run with a fixed number of updates
    b = main_job._parse(["--arch", "transformer", "--max-update", "1200", "--time-budget", "0"])
    assert b.max_update == 1200 and not b.time_budget


def test_the_setup_time_comes_from_the_launcher(monkeypatch):
    monkeypatch.setenv("EMBRACE_JOB_T0", "100.0")
    assert main_job._setup_seconds(160.0) == 60.0
    monkeypatch.setenv("EMBRACE_JOB_T0", "not a time")
    assert main_job._setup_seconds(160.0) is None
