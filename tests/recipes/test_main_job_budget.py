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


def test_each_kind_of_run_has_its_own_results_file(tmp_path):
    assert main_job.run_kind(environment_built=False, data_built=False) == "warm"
    assert main_job.run_kind(environment_built=True, data_built=False) == "from_nothing"
    assert main_job.run_kind(environment_built=False, data_built=True) == "from_nothing"
    names = {main_job.results_name(tag, kind) for tag in ("", "_transformer") for kind in main_job.KINDS}
    assert names == {"main_job.warm.json", "main_job.from_nothing.json",
                     "main_job_transformer.warm.json", "main_job_transformer.from_nothing.json"}
    with pytest.raises(ValueError, match="one of from_nothing, warm"):
        main_job.results_name("", "cold")


def test_the_environment_counts_as_built_when_its_stamp_is_newer_than_the_start(tmp_path):
    import os

    stamp = tmp_path / ".embrace-setup-0123456789ab"
    stamp.write_text("")
    os.utime(stamp, (1000.0, 1000.0))
    assert main_job._environment_built_since(999.0, tmp_path)      # set up during this job
    assert not main_job._environment_built_since(1001.0, tmp_path)  # there before the job
    assert not main_job._environment_built_since(None, tmp_path)    # the recipe run directly
