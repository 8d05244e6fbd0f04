"""Keep the series in step across the vLLM releases it is carried on.

The series is written on v0.32.0 (`patches/`) and carried on v0.34.0
(`patches/v0.34.0/`). Each carried series has a table, `from-v0.32.0.txt`
in its folder, with one line for each patch of the v0.32.0 series, in order:

    <v0.32.0 patch> <its change digest> <carried patch> <its change digest>
    <v0.32.0 patch> <its change digest> dropped  # why

A change digest covers what a patch changes (the files and their added and
removed lines), not its context, line numbers or message, so a port that
only moves lines keeps it. When a patch on either side changes, the digests
recorded for its pair no longer match and `check` names the pair: make the
same change on the other base (or say in the table why not), then record the
new digests with `python -m workbench in-step --record`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .series import Patch, SeriesError, read_series

TABLE_NAME = "from-v0.32.0.txt"
DROPPED = "dropped"
_HEADER = """\
# How each patch of the v0.32.0 series (patches/series) is carried here, in
# order: <v0.32.0 patch> <change digest> <patch here> <change digest>, or
# <v0.32.0 patch> <change digest> dropped  # why
# A change to either side of a pair is made on the other too, or the table
# says why not; then `cd scripts && python -m workbench in-step --record`.
# (scripts/workbench/in_step.py)
"""


def change_digest(patch: Patch) -> str:
    """12 hex digits over the files a patch changes and its +/- lines."""
    h = hashlib.sha256()
    for line in patch.path.read_text().splitlines():
        if line.startswith("diff --git "):
            h.update(line.encode() + b"\n")
        elif line.startswith(("+++ ", "--- ")):
            continue
        elif line.startswith(("+", "-")):
            h.update(line.encode() + b"\n")
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    source: str  # the v0.32.0 patch's file name
    source_digest: str
    target: str | None  # the carried patch's file name; None: dropped
    target_digest: str | None
    why: str  # the comment after `#` (required for a dropped patch)


def read_table(path: Path) -> list[Row]:
    rows = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        text, _, why = raw.partition("#")
        fields = text.split()
        if not fields:
            continue
        if len(fields) == 3 and fields[2] == DROPPED:
            rows.append(Row(fields[0], fields[1], None, None, why.strip()))
        elif len(fields) == 4:
            rows.append(Row(fields[0], fields[1], fields[2], fields[3], why.strip()))
        else:
            raise SeriesError(f"{path}:{n}: expected '<patch> <digest> <patch> <digest>' or "
                              f"'<patch> <digest> dropped  # why', got {raw!r}")
    return rows


def check(source_dir: Path, target_dir: Path) -> list[str]:
    """What is out of step between the two series; empty when in step."""
    table = target_dir / TABLE_NAME
    if not table.exists():
        return [f"{table} is missing: every carried series has one"]
    rows = read_table(table)
    sources = read_series(source_dir)
    targets = read_series(target_dir)
    problems = []
    if [r.source for r in rows] != [p.name for p in sources]:
        problems.append(f"{table.name} lists the v0.32.0 patches {[r.source for r in rows]}, "
                        f"patches/series has {[p.name for p in sources]}: one row each, in order")
    carried = [r.target for r in rows if r.target is not None]
    if carried != [p.name for p in targets]:
        problems.append(f"{table.name} carries {carried}, {target_dir.name}/series has "
                        f"{[p.name for p in targets]}: each carried patch once, in order")
    # The two series share file names (0001-... on both): look each up in its own.
    source_by_name = {p.name: p for p in sources}
    target_by_name = {p.name: p for p in targets}
    for r in rows:
        if r.target is None and not r.why:
            problems.append(f"{r.source} is dropped on {target_dir.name} without a reason (add '# why')")
        src = source_by_name.get(r.source)
        if src is not None and change_digest(src) != r.source_digest:
            problems.append(f"{r.source} changed on v0.32.0 since it was last in step with "
                            f"{r.target or 'its dropping'}: make the same change in {target_dir.name}/"
                            f"{r.target or '(or say why it stays dropped)'}, then record")
        tgt = target_by_name.get(r.target) if r.target else None
        if tgt is not None and change_digest(tgt) != r.target_digest:
            problems.append(f"{target_dir.name}/{r.target} changed since it was last in step with "
                            f"{r.source}: make the same change on v0.32.0 (or say in the table why "
                            "not), then record")
    return problems


def record(source_dir: Path, target_dir: Path,
           pairs: dict[str, tuple[str | None, str]] | None = None) -> str:
    """Rewrite the table with the current digests, keeping its pairs and reasons.

    pairs: v0.32.0 patch -> (carried patch or None for dropped, why) for
    patches the table does not pair yet (a new patch on both sides, say), or
    pairs anew.
    """
    table = target_dir / TABLE_NAME
    old = {r.source: r for r in read_table(table)} if table.exists() else {}
    sources = read_series(source_dir)
    targets = {p.name: p for p in read_series(target_dir)}
    lines = [_HEADER]
    for src in sources:
        row = old.get(src.name)
        if pairs and src.name in pairs:
            target, why = pairs[src.name]
        elif row is not None:
            target, why = row.target, row.why
        else:
            raise SeriesError(f"{src.name} is new on v0.32.0 and not paired in {table}: pair it "
                              "(or drop it, with a reason) first")
        if target is None:
            if not why:
                raise SeriesError(f"{src.name} is dropped on {target_dir.name}: say why")
            lines.append(f"{src.name} {change_digest(src)} {DROPPED}  # {why}\n")
            continue
        if target not in targets:
            raise SeriesError(f"{table}: {src.name} is carried as {target}, which is not in "
                              f"{target_dir.name}/series")
        tail = f"  # {why}" if why else ""
        lines.append(f"{src.name} {change_digest(src)} {target} {change_digest(targets[target])}{tail}\n")
    table.write_text("".join(lines))
    return f"recorded {table}: {len(sources)} rows"
