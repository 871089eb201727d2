"""``manifest.json``: what was built, from what, and the checksum of every output file.

It is also the record that makes reruns cheap: each step stores its configuration (which
includes the checksums of its inputs) and the sha256 of its outputs; a step whose
configuration is unchanged and whose outputs still hash the same is skipped. The file holds no
timestamps or absolute paths and is written with sorted keys, so a forced rerun reproduces it
byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

MANIFEST_NAME = "manifest.json"
FORMAT = 1


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def hash_files(root: Path, paths: Iterable[Path]) -> Dict[str, str]:
    """``{posix path relative to root: sha256}`` for the given files."""
    root = Path(root)
    return {Path(p).resolve().relative_to(root.resolve()).as_posix(): sha256_file(p)
            for p in sorted(Path(p) for p in paths)}


def files_under(folder: Path) -> list:
    """Every regular file below ``folder`` (sorted)."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def tool_versions() -> Dict[str, Optional[str]]:
    """Versions of the Python packages whose behaviour shapes the outputs."""
    return {
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "fairseq": _dist_version("fairseq-fixed", "fairseq"),
        "sentencepiece": _dist_version("sentencepiece"),
        "sacrebleu": _dist_version("sacrebleu"),
    }


def load_manifest(out_dir: Path) -> Dict[str, Any]:
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        return {"format": FORMAT}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if data.get("format") != FORMAT:
        return {"format": FORMAT}
    return data


def write_manifest(out_dir: Path, manifest: Dict[str, Any]) -> Path:
    """Write atomically with the ``files`` index rebuilt from the step records."""
    files: Dict[str, str] = {}
    for record in manifest.get("steps", {}).values():
        files.update(record.get("files", {}))
    manifest["files"] = dict(sorted(files.items()))
    path = Path(out_dir) / MANIFEST_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)
    return path


def step_is_current(out_dir: Path, manifest: Dict[str, Any], name: str, config: Dict[str, Any]) -> bool:
    """True if step ``name`` ran with ``config`` and all its outputs exist unchanged."""
    record = manifest.get("steps", {}).get(name)
    if not record or record.get("config") != _jsonable(config) or not record.get("files"):
        return False
    root = Path(out_dir)
    for rel, digest in record["files"].items():
        path = root / rel
        if not path.is_file() or sha256_file(path) != digest:
            return False
    return True


def record_step(out_dir: Path, manifest: Dict[str, Any], name: str, config: Dict[str, Any],
                outputs: Iterable[Path], info: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Store a finished step (config, output checksums, info) and write the manifest."""
    record = {"config": _jsonable(config), "files": hash_files(out_dir, outputs), "info": _jsonable(info or {})}
    manifest.setdefault("steps", {})[name] = record
    write_manifest(out_dir, manifest)
    return record


def _jsonable(obj: Any) -> Any:
    """Round-trip through JSON so tuples and lists compare equal to what was loaded."""
    return json.loads(json.dumps(obj, sort_keys=True))
