"""Checkpoint safety of the guards: loads are weights_only (a malicious pickle is refused and
does not run), sidecars that are stale (file replaced outside) or orphaned do not refuse or
linger, and a damaged file is still refused."""
import os
import shutil

import pytest
import torch

from embrace_fairseq.guards import atomic_io, safe_load
from embrace_fairseq.guards.atomic_io import CorruptCheckpointError, atomic_save, remove_orphan_sidecars


class Payload:
    """Unpickling this would create a directory: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _malicious(path, marker):
    torch.save({"model": {"w": torch.ones(2)}, "extra_state": Payload(str(marker))}, path)


def test_malicious_pickle_is_refused_unrun(tmp_path):
    marker = tmp_path / "code_ran"
    ckpt = tmp_path / "evil.pt"
    _malicious(ckpt, marker)
    with pytest.raises(safe_load.UnsafeCheckpointError, match="nothing in it was executed") as err:
        safe_load.load(str(ckpt), name=f"checkpoint {ckpt}")
    assert "makedirs" in str(err.value) and str(ckpt) in str(err.value)
    with pytest.raises(safe_load.UnsafeCheckpointError):
        atomic_io.load_checkpoint(str(ckpt), map_location="cpu")
    with pytest.raises(safe_load.UnsafeCheckpointError):
        safe_load.load(ckpt.read_bytes())  # bytes inside a checkpoint too
    assert not marker.exists()


def test_allow_list_is_scoped_to_the_load(tmp_path):
    import argparse

    ckpt = tmp_path / "ns.pt"
    torch.save({"args": argparse.Namespace(a=1)}, ckpt)
    assert safe_load.load(str(ckpt), [argparse.Namespace])["args"].a == 1
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(ckpt)  # nothing was allowed process-wide


def test_numpy_rng_state_loads_weights_only():
    import io

    import numpy as np

    buf = io.BytesIO()
    torch.save({"numpy": np.random.get_state()}, buf)
    state = safe_load.load(buf.getvalue(), safe_load.numpy_globals())["numpy"]
    assert state[0] == "MT19937" and state[1].dtype == np.uint32


def test_file_replaced_outside_is_not_refused(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    atomic_save({"w": torch.zeros(100)}, str(path))
    other = tmp_path / "elsewhere.pt"
    torch.save({"w": torch.ones(100)}, other)
    shutil.copyfile(other, path)  # cp over it: the sidecar is stale
    with pytest.warns(RuntimeWarning, match="sidecar is rewritten"):
        got = atomic_io.load_checkpoint(str(path))
    assert torch.equal(got["w"], torch.ones(100))
    assert open(str(path) + ".sha256").read().split()[0] == atomic_io.file_digest(str(path))


def test_flipped_bit_is_still_refused(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    atomic_save({"w": torch.randn(4096)}, str(path))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        atomic_io.load_checkpoint(str(path))


def test_orphan_sidecars_are_removed(tmp_path):
    for name in ("checkpoint1.pt", "checkpoint2.pt", "checkpoint_last.pt"):
        atomic_save({"w": torch.zeros(1)}, str(tmp_path / name))
    os.remove(tmp_path / "checkpoint1.pt")  # what fairseq's --keep-* cleanup does
    removed = remove_orphan_sidecars(str(tmp_path))
    assert [os.path.basename(r) for r in removed] == ["checkpoint1.pt.sha256"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint2.pt", "checkpoint2.pt.sha256", "checkpoint_last.pt",
                                           "checkpoint_last.pt.sha256"]
