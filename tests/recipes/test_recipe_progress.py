"""The recipes' console progress: one line per interval with an ETA, fairseq's records only."""
import json

from embrace_fairseq.recipes.common import eta, progress_printer


def test_eta_from_the_pace_so_far():
    assert eta(60.0, 10, 40) == "ETA 3m00s"  # 6 s per update, 30 left
    assert eta(5.0, 10, 20) == "ETA 5s"
    assert eta(10.0, 20, 20) == "ETA 0s"
    assert eta(0.0, 0, 20) == "ETA -"
    # a time limit that comes first wins; one that comes later changes nothing
    assert eta(60.0, 10, 40, time_limit_s=90.0) == "ETA 30s"
    assert eta(60.0, 10, 40, time_limit_s=600.0) == "ETA 3m00s"
    assert eta(700.0, 10, 40, time_limit_s=600.0) == "ETA 0s"


def test_progress_lines(capsys):
    on_line = progress_printer("[train]", 20)
    rec = lambda n: json.dumps({"num_updates": str(n), "loss": "7.5", "wps": "900"})  # noqa: E731
    on_line("2026-12-01 08:00:00 | WARNING | py.warnings | something deprecated")  # third-party noise: not shown
    on_line(f"2026-12-01 08:00:01 | INFO | train_inner | {rec(5)}")  # between intervals: not shown
    on_line(f"2026-12-01 08:00:02 | INFO | train_inner | {rec(10)}")
    on_line(f"2026-12-01 08:00:03 | INFO | valid | {json.dumps({'valid_num_updates': '10', 'valid_loss': '8.1'})}")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2, out
    assert out[0].startswith("[train] update 10/20 loss 7.5 wps 900 (") and "ETA" in out[0]
    assert out[1] == "[train] validation after 10 updates: loss 8.1"


def test_a_rerun_trains_from_scratch(tmp_path, capsys):
    from embrace_fairseq.recipes.common import fresh_save_dir

    assert fresh_save_dir(tmp_path, "job") == tmp_path / "checkpoints"  # nothing there: nothing said
    assert capsys.readouterr().out == ""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint_last.pt").write_bytes(b"earlier model")
    (tmp_path / "train.log").write_text("kept")
    save_dir = fresh_save_dir(tmp_path, "job")
    assert not save_dir.exists() and (tmp_path / "train.log").exists()
    assert "removing the earlier run's checkpoints" in capsys.readouterr().out
