"""A wheel's RECORD (PEP 376 / the wheel spec): path, sha256=<urlsafe base64, no padding>, size."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    path: str
    hash: str  # "sha256=..." or "" (the RECORD itself, files written after install)
    size: str


def file_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def parse(text: str) -> list[Entry]:
    entries = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if len(row) != 3:
            raise ValueError(f"a RECORD row that is not path,hash,size: {row!r}")
        entries.append(Entry(*row))
    return entries


def dump(entries: list[Entry]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for e in entries:
        writer.writerow([e.path, e.hash, e.size])
    return out.getvalue()


def entry_for(path: str, data: bytes) -> Entry:
    return Entry(path, file_hash(data), str(len(data)))


def matches(entry: Entry, data: bytes) -> bool:
    """True when `data` is what the entry records (hash and, where given, size)."""
    if not entry.hash.startswith("sha256="):
        return False
    return entry.hash == file_hash(data) and (not entry.size or entry.size == str(len(data)))
