"""Results files name the commit they were measured on, and whether the tree was modified."""
import subprocess

from embrace_fairseq.perf.provenance import REPO_ROOT, source_state


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_commit_and_dirty_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("EMBRACE_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "results.json").write_text("{}")  # untracked output: still clean
    assert source_state(tmp_path)["dirty"] is False
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("{}")
    _git(tmp_path, "add", "results")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "results")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "results" / "r.json").write_text('{"rerun": 1}')  # a run rewrote a tracked result: clean
    assert source_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.txt").write_text("two\n")
    assert source_state(tmp_path) == {"commit": head, "dirty": True}


def test_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("EMBRACE_COMMIT", raising=False)
    assert source_state(tmp_path / "nowhere") == {"commit": None, "dirty": None}


def test_this_checkout_has_a_commit():
    state = source_state(REPO_ROOT)
    assert state["commit"] is None or len(state["commit"]) == 40


def test_a_sent_tree_names_its_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBRACE_COMMIT", "0123abc")
    assert source_state(tmp_path / "nowhere") == {"commit": "0123abc", "dirty": False}
