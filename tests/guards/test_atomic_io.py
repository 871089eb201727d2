"""atomic_io: atomic save/copy with a SHA-256 sidecar, a failed write keeps the previous
file, and reading refuses truncated or corrupted files (unit tests, no fairseq)."""
import errno
import os

import pytest
import torch

from embrace_fairseq.guards import atomic_io as A


def _leftovers(folder):
    return [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_save_load_roundtrip_with_sidecar(tmp_path):
    path = str(tmp_path / "ck.pt")
    A.atomic_save({"w": torch.arange(5.0)}, path)
    assert torch.equal(A.load_checkpoint(path)["w"], torch.arange(5.0))
    assert open(path + A.SIDECAR).read() == A.file_digest(path) + "\n"  # the new digest alone
    A.atomic_save({"w": torch.ones(3)}, path)  # overwrite
    assert torch.equal(A.load_checkpoint(path)["w"], torch.ones(3))
    assert open(path + A.SIDECAR).read() == A.file_digest(path) + "\n"
    assert not _leftovers(tmp_path)


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = str(tmp_path / "ck.pt")
    A.atomic_save({"v": 1}, path)
    before = open(path, "rb").read()

    def disk_full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(A.CheckpointWriteError) as err:
        A.atomic_write(path, disk_full)
    msg = str(err.value)
    assert path in msg and "No space left on device" in msg and "unchanged" in msg, msg
    assert err.value.errno == errno.ENOSPC
    assert open(path, "rb").read() == before and A.load_checkpoint(path) == {"v": 1}
    assert not _leftovers(tmp_path)


def test_non_io_error_is_raised_unchanged(tmp_path):
    path = str(tmp_path / "ck.pt")

    def bug(f):
        raise KeyError("not an I/O problem")

    with pytest.raises(KeyError):
        A.atomic_write(path, bug)
    assert not os.path.exists(path) and not _leftovers(tmp_path)


def test_corrupted_and_truncated_files_are_refused(tmp_path):
    path = str(tmp_path / "ck.pt")
    A.atomic_save({"w": torch.randn(1000)}, path)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit inside the tensor data
    open(path, "wb").write(bytes(raw))
    with pytest.raises(A.CorruptCheckpointError, match="SHA-256 does not match"):
        A.load_checkpoint(path)
    # truncated, without a sidecar: the zip reader's error is named as corruption
    os.remove(path + A.SIDECAR)
    open(path, "wb").write(bytes(raw[: len(raw) // 3]))
    with pytest.raises(A.CorruptCheckpointError, match="truncated or corrupted") as err:
        A.load_checkpoint(path)
    assert path in str(err.value)


def test_file_without_sidecar_is_only_read(tmp_path):
    path = str(tmp_path / "other_tool.pt")
    torch.save({"a": 1}, path)
    A.verify(path)
    assert A.load_checkpoint(path) == {"a": 1}
    with pytest.raises(FileNotFoundError):
        A.load_checkpoint(str(tmp_path / "missing.pt"))


def test_sidecar_lists_old_and_new_digest_during_the_rename(tmp_path):
    """A crash between the sidecar update and the rename leaves either file valid."""
    path = str(tmp_path / "ck.pt")
    A.atomic_save({"v": 1}, path)
    old = A.file_digest(path)
    seen = {}
    real_replace = os.replace

    def spy(src, dst):
        if dst == path:
            seen["sidecar"] = open(path + A.SIDECAR).read().split()
            seen["new"] = A.file_digest(src)
        return real_replace(src, dst)

    os.replace = spy
    try:
        A.atomic_save({"v": 2}, path)
    finally:
        os.replace = real_replace
    assert seen["sidecar"] == [seen["new"], old]


def test_atomic_copy(tmp_path):
    src, dst = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    A.atomic_save({"x": 3}, src)
    A.atomic_copy(src, dst)
    assert open(src, "rb").read() == open(dst, "rb").read() and A.load_checkpoint(dst) == {"x": 3}
    assert open(dst + A.SIDECAR).read().split() == [A.file_digest(dst)]


def test_other_load_errors_are_not_called_corruption(tmp_path):
    path = str(tmp_path / "ck.pt")
    exc = RuntimeError("Weights only load failed because of class Foo")
    assert A.corrupt_error(path, exc) is exc
    other = ValueError("caller's own problem")
    assert A.corrupt_error(path, other) is other
    assert isinstance(A.corrupt_error(path, EOFError("Ran out of input")), A.CorruptCheckpointError)
