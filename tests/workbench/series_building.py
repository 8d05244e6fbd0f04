"""Building small patch series for the workbench's tests, as `make refresh` writes them."""

from __future__ import annotations

from pathlib import Path

from workbench import series as S


def write_files(tree: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)


def commit_series(work: Path, edits: list[tuple[str, dict[str, str]]], patches: Path) -> None:
    """On `work`, a base repo (series.init_base_repo), commit each edit
    (message, {path: new text}) with fixed dates, so the same edits give the
    same patch files; write them to `patches` as `make refresh` does; put
    `work` back at the base."""
    for message, files in edits:
        write_files(work, files)
        S.run(["git", "add", "-A"], cwd=work)
        S.run(["git", "commit", "-q", "-m", message], cwd=work,
              env={"GIT_AUTHOR_DATE": S.BASE_DATE, "GIT_COMMITTER_DATE": S.BASE_DATE})
    patches.mkdir()
    S.refresh(work, patches)
    S.run(["git", "reset", "-q", "--hard", S.BASE_TAG], cwd=work)
