"""The series' patch files read and applied in memory, without git.

A `git format-patch` file holds one diff per file (`diff --git a/P b/P`),
each a list of hunks. Applying is strict: every context and removed line
must match byte for byte (no fuzz); a hunk may sit at another line than its
header says (an earlier hunk of another patch moved it), as `git apply`
allows, and the nearest match wins. Renames, mode changes and binary diffs
are refused: the series has none, and a patch file that has them was not
written by `make refresh`.

Everything here works on bytes in memory; nothing touches a file, so a
failure leaves every file as it was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = b"\\ No newline at end of file"


class PatchError(Exception):
    """A patch file that cannot be read, or a diff that does not apply; the message says where."""


@dataclass
class Hunk:
    old_start: int
    old: list[bytes]  # the lines it replaces, with their line endings
    new: list[bytes]  # the lines it puts there
    header: str


@dataclass
class FileDiff:
    path: str
    new_file: bool = False
    deleted: bool = False
    hunks: list[Hunk] = field(default_factory=list)


def parse_patch(text: bytes, name: str = "patch") -> list[FileDiff]:
    """The file diffs of one patch file, in order. Raises PatchError on anything it cannot read exactly."""
    lines = text.split(b"\n")
    # A trailing newline leaves one empty string after the last line.
    if lines and lines[-1] == b"":
        lines.pop()
    diffs: list[FileDiff] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith(b"diff --git "):
            i += 1
            continue
        m = re.match(rb"^diff --git a/(\S+) b/(\S+)$", line)
        if not m or m.group(1) != m.group(2):
            raise PatchError(f"{name}: line {i + 1}: a diff header that is a rename or that cannot be read: "
                             f"{line[:200]!r}")
        fd = FileDiff(_path(m.group(1), name, i))
        i += 1
        # Extended headers, up to the first hunk or the next diff.
        while i < len(lines) and not lines[i].startswith((b"@@ ", b"diff --git ")):
            h = lines[i]
            if h.startswith(b"new file mode "):
                fd.new_file = True
            elif h.startswith(b"deleted file mode "):
                fd.deleted = True
            elif h.startswith((b"index ", b"--- ", b"+++ ")):
                pass
            elif h.startswith((b"old mode", b"new mode", b"rename ", b"copy ", b"similarity", b"dissimilarity",
                               b"Binary files", b"GIT binary patch")):
                raise PatchError(f"{name}: {fd.path}: {h.decode(errors='replace')!r} is not supported "
                                 "(only text edits, new and deleted files)")
            else:
                raise PatchError(f"{name}: line {i + 1}: unexpected line in the header of {fd.path}: {h[:200]!r}")
            i += 1
        while i < len(lines) and lines[i].startswith(b"@@ "):
            hunk, i = _parse_hunk(lines, i, name, fd.path)
            fd.hunks.append(hunk)
        if not fd.hunks and not (fd.new_file or fd.deleted):
            raise PatchError(f"{name}: {fd.path}: a diff without hunks")
        diffs.append(fd)
    return diffs


def _path(raw: bytes, name: str, lineno: int) -> str:
    path = raw.decode("utf-8", errors="strict")
    parts = path.split("/")
    # The paths come from a file; never let one leave the tree it applies to.
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise PatchError(f"{name}: line {lineno + 1}: path {path!r} is not a plain relative path")
    return path


def _parse_hunk(lines: list[bytes], i: int, name: str, path: str) -> tuple[Hunk, int]:
    m = _HUNK.match(lines[i])
    if not m:
        raise PatchError(f"{name}: {path}: line {i + 1}: a hunk header that cannot be read: {lines[i][:200]!r}")
    old_start = int(m.group(1))
    old_len = 1 if m.group(2) is None else int(m.group(2))
    new_len = 1 if m.group(4) is None else int(m.group(4))
    header = lines[i].decode(errors="replace")
    old: list[bytes] = []
    new: list[bytes] = []
    i += 1
    while len(old) < old_len or len(new) < new_len:
        if i >= len(lines):
            raise PatchError(f"{name}: {path}: hunk {header!r} ends early (truncated patch file?)")
        line = lines[i]
        tag, body = line[:1], line[1:] + b"\n"
        if tag == b" ":
            old.append(body)
            new.append(body)
        elif tag == b"-":
            old.append(body)
        elif tag == b"+":
            new.append(body)
        elif line == b"":  # an empty context line whose leading space was lost
            old.append(b"\n")
            new.append(b"\n")
        else:
            raise PatchError(f"{name}: {path}: line {i + 1}: unexpected line in hunk {header!r}: {line[:200]!r}")
        i += 1
        if i < len(lines) and lines[i] == _NO_NEWLINE:
            # The line just read has no newline at the end of its file.
            if tag in (b" ", b""):
                old[-1] = old[-1][:-1]
                new[-1] = new[-1][:-1]
            elif tag == b"-":
                old[-1] = old[-1][:-1]
            else:
                new[-1] = new[-1][:-1]
            i += 1
    if len(old) != old_len or len(new) != new_len:
        raise PatchError(f"{name}: {path}: hunk {header!r} has {len(old)}/{len(new)} lines, not {old_len}/{new_len}")
    return Hunk(old_start, old, new, header), i


def split_lines(data: bytes) -> list[bytes]:
    """`data` as lines that keep their `\\n` (the last one may have none)."""
    lines = data.split(b"\n")
    out = [line + b"\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def apply_file_diff(fd: FileDiff, data: bytes | None, name: str = "patch") -> bytes | None:
    """The file's bytes after the diff (None: the diff deletes it). `data` None: the file does not exist.

    Raises PatchError naming the patch, the file and the hunk that does not apply.
    """
    if fd.new_file:
        if data is not None:
            raise PatchError(f"{name}: creates {fd.path}, which already exists")
        data = b""
    elif data is None:
        raise PatchError(f"{name}: changes {fd.path}, which does not exist")
    lines = split_lines(data)
    offset = 0
    for number, hunk in enumerate(fd.hunks, 1):
        # A hunk that adds to an empty file, or at its very start, says line 0.
        expected = max(hunk.old_start - 1, 0) + offset if hunk.old else hunk.old_start + offset
        at = _find(lines, hunk.old, expected)
        if at is None:
            raise PatchError(f"{name}: hunk #{number} of {fd.path} ({hunk.header}) does not match the file "
                             f"(expected near line {expected + 1}): the file is not the one the series was made on")
        lines[at:at + len(hunk.old)] = hunk.new
        offset = at - max(hunk.old_start - 1, 0) + len(hunk.new) - len(hunk.old) if hunk.old else \
            offset + len(hunk.new)
    result = b"".join(lines)
    if fd.deleted:
        if result:
            raise PatchError(f"{name}: deletes {fd.path}, but the file has more than the patch removes")
        return None
    return result


def _find(lines: list[bytes], old: list[bytes], expected: int) -> int | None:
    """Where `old` sits in `lines`: at `expected`, else the nearest position (None: nowhere)."""
    n = len(old)
    if n == 0:
        return min(max(expected, 0), len(lines))
    last = len(lines) - n
    if last < 0:
        return None
    for delta in range(0, max(expected, last - expected) + 1):
        for at in ((expected,) if delta == 0 else (expected - delta, expected + delta)):
            if 0 <= at <= last and lines[at] == old[0] and lines[at:at + n] == old:
                return at
    return None
