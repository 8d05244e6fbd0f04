"""The series on v0.34.0 stays in step with v0.32.0: a change lands on both
bases or the table says why not (scripts/workbench/in_step.py)."""

import shutil

import pytest
from workbench.in_step import TABLE_NAME, change_digest, check, read_table, record
from workbench.series import Patch, read_series
from workbench.tree import PATCHES

CARRIED = PATCHES / "v0.34.0"


def test_the_series_on_v0_34_is_in_step_with_v0_32():
    assert check(PATCHES, CARRIED) == []


def test_every_dropped_patch_says_why_and_every_kept_one_is_carried():
    rows = read_table(CARRIED / TABLE_NAME)
    assert [r.source for r in rows] == [p.name for p in read_series(PATCHES)]
    assert all(r.why for r in rows if r.target is None)
    assert [r.target for r in rows if r.target] == [p.name for p in read_series(CARRIED)]


@pytest.fixture
def copies(tmp_path):
    src, tgt = tmp_path / "patches", tmp_path / "patches" / "v0.34.0"
    shutil.copytree(PATCHES, src, ignore=shutil.ignore_patterns("v0.*"))
    shutil.copytree(CARRIED, tgt)
    assert check(src, tgt) == []
    return src, tgt


def _edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _change_an_added_line(series_dir, index):
    """Change the first added line of the series' patch `index`; its name."""
    name = read_series(series_dir)[index].name
    line = next(ln for ln in (series_dir / name).read_text().splitlines()
                if ln.startswith("+") and not ln.startswith("+++"))
    _edit(series_dir / name, line, line + "  # changed")
    return name


def test_a_change_on_v0_32_only_is_named_until_carried_and_recorded(copies):
    src, tgt = copies
    name = _change_an_added_line(src, 5)
    problems = check(src, tgt)
    assert len(problems) == 1 and name in problems[0] and "changed on v0.32.0" in problems[0]
    record(src, tgt)
    assert check(src, tgt) == []


def test_a_change_on_v0_34_only_is_named(copies):
    src, tgt = copies
    name = _change_an_added_line(tgt, 3)
    problems = check(src, tgt)
    assert len(problems) == 1 and name in problems[0] and "make the same change on v0.32.0" in problems[0]


def test_context_and_line_numbers_are_not_a_change(copies):
    src, tgt = copies
    patch = Patch("p", src / read_series(src)[0].name)
    before = change_digest(patch)
    text = patch.path.read_text()
    hunk = next(ln for ln in text.splitlines() if ln.startswith("@@ "))
    patch.path.write_text(text.replace(hunk, "@@ -1,7 +1,9 @@ moved", 1))
    assert change_digest(patch) == before


def test_a_dropped_patch_without_a_reason_is_refused(copies):
    src, tgt = copies
    table = tgt / TABLE_NAME
    text = table.read_text()
    dropped_line = next(ln for ln in text.splitlines() if " dropped " in ln and not ln.startswith("#"))
    table.write_text(text.replace(dropped_line, dropped_line.split("#")[0].rstrip()))
    assert any("without a reason" in p for p in check(src, tgt))


def test_a_patch_missing_from_the_table_is_named(copies):
    src, tgt = copies
    table = tgt / TABLE_NAME
    lines = table.read_text().splitlines(keepends=True)
    row = next(i for i, ln in enumerate(lines) if not ln.startswith("#"))
    table.write_text("".join(lines[:row] + lines[row + 1:]))
    assert any("one row each, in order" in p for p in check(src, tgt))
