"""The patch series this package applies: which one for which vLLM release, where it is read from,
and its non-test part.

The series is kept for two vLLM releases (RELEASES, the one table the
command uses): v0.32.0, the release it is written on (`patches/`), and
v0.34.0 (`patches/v0.34.0/`, each patch carried over from v0.32.0's). The
installed vLLM's release picks the series; any other release is refused.

Each series folder is read from one of two places, the first that has
`series` wins:

- `vllm_kvchecksum/install/patches/` inside an installed wheel: `make wheels`
  (setup.py's build step) copies every series folder there (`series` and
  every patch it lists), so an operator needs nothing but the wheel;
- `patches/` of the clone the package is imported from (an editable install,
  or PYTHONPATH on a checkout), so a developer never runs a stale copy.

An installed vLLM has no `tests/`: of each patch only the diffs of files under
`vllm/` are applied (the non-test hunks); the rest is listed as skipped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .diffs import FileDiff, PatchError, apply_file_diff, parse_patch

# The release the series is written on, and the one release `make wheels` builds a patched wheel of.
BASE_VERSION = "0.32.0"
# Every release `vllm-kvchecksum apply` takes: release -> its series folder, relative to the series root
# (patches/ of a clone, or the wheel's shipped copy); "" is the root itself.
RELEASES: dict[str, str] = {
    "0.32.0": "",
    "0.34.0": "v0.34.0",
}
PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED = PACKAGE_DIR / "patches"
# The clone's patches/, when the package is imported from a checkout.
CLONE = PACKAGE_DIR.parents[1] / "patches"
# The files of vLLM's Python package; the rest of a patch (tests/) is not installed.
RUNTIME_PREFIX = "vllm/"


@dataclass(frozen=True)
class SeriesPatch:
    name: str
    data: bytes

    def diffs(self) -> list[FileDiff]:
        return parse_patch(self.data, self.name)


@dataclass(frozen=True)
class Series:
    where: Path
    patches: tuple[SeriesPatch, ...]
    # The vLLM release RELEASES picked it for; None for a folder named by hand (--patches).
    release: str | None = None

    def describe(self) -> str:
        what = f"the series for vLLM {self.release}" if self.release else "the series"
        return f"{what} ({len(self.patches)} patches from {self.where}, {self.local_version})"

    @property
    def digest(self) -> str:
        """sha256 over the names and bytes of the patches, in order (the workbench's series digest)."""
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.data + b"\0")
        return h.hexdigest()

    @property
    def local_version(self) -> str:
        """The local version label a patched vLLM carries: kvchecksum.s<12 hex digits of the digest>.

        The `s` keeps the label from being all digits, which PEP 440 would
        normalize (leading zeros dropped) and so rename the wheel.
        """
        return f"kvchecksum.s{self.digest[:12]}"

    def runtime_diffs(self) -> list[tuple[str, FileDiff]]:
        """(patch name, diff) of every file under vllm/, in series order."""
        return [(p.name, d) for p in self.patches for d in p.diffs() if d.path.startswith(RUNTIME_PREFIX)]

    def skipped_paths(self) -> list[str]:
        return sorted({d.path for p in self.patches for d in p.diffs() if not d.path.startswith(RUNTIME_PREFIX)})

    def runtime_paths(self) -> list[str]:
        return sorted({d.path for _, d in self.runtime_diffs()})


def read_series(where: Path, release: str | None = None) -> Series:
    """The series in `where` (a `series` file, one patch name a line, `#` comments)."""
    series_file = where / "series"
    if not series_file.is_file():
        raise PatchError(f"{series_file} is missing: no patch series there")
    patches = []
    for raw in series_file.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if "/" in name or name.startswith("."):
            raise PatchError(f"{series_file} lists {name!r}, which is not a file name in {where}")
        path = where / name
        if not path.is_file():
            raise PatchError(f"{series_file} lists {name}, which is not in {where}")
        patches.append(SeriesPatch(name, path.read_bytes()))
    if not patches:
        raise PatchError(f"{series_file} lists no patches")
    return Series(where, tuple(patches), release)


def supported_releases() -> str:
    """The table in words: `0.32.0 (patches/), 0.34.0 (patches/v0.34.0/)`."""
    return ", ".join(f"{release} ({series_label(release)})" for release in RELEASES)


def series_label(release: str) -> str:
    """Where a release's series lies, as the clone spells it: `patches/` or `patches/v0.34.0/`."""
    return "patches/" + (RELEASES[release] + "/" if RELEASES[release] else "")


class UnsupportedRelease(PatchError):
    """A vLLM release the table has no series for; the message names the supported ones."""


def series_dir(release: str) -> str:
    """The series folder of `release` (relative to the series root); UnsupportedRelease when it has none."""
    if release not in RELEASES:
        raise UnsupportedRelease(f"vllm-kvchecksum has a series for vLLM {', '.join(RELEASES)} only, "
                                 f"not {release}: {supported_releases()}")
    return RELEASES[release]


def series_root() -> Path:
    """The shipped copy when installed from the wheel, else the clone's patches/."""
    for where in (SHIPPED, CLONE):
        if (where / "series").is_file():
            return where
    raise PatchError(f"no patch series found: neither {SHIPPED} (an installed wheel of vllm-kvchecksum) nor "
                     f"{CLONE} (a clone of the repository) has a `series` file. Install the package from the "
                     "wheel `make wheels` builds, or run it from a clone.")


def default_series(release: str = BASE_VERSION) -> Series:
    """The series for vLLM `release`, from the shipped copy or the clone (series_root)."""
    sub = series_dir(release)
    root = series_root()
    where = root / sub if sub else root
    if not (where / "series").is_file():
        raise PatchError(f"{where / 'series'} is missing: this vllm-kvchecksum has no series for vLLM {release} "
                         f"({series_label(release)} in a clone). Install a helper wheel built from a clone that "
                         "has it (make wheels).")
    return read_series(where, release)


def patch_files(series: Series, read) -> tuple[dict[str, bytes | None], dict[str, bytes | None]]:
    """Apply the series' non-test diffs in memory; (before, after), each path -> bytes (None: absent).

    `read(path)` gives a file's current bytes, or None when it does not exist.
    Raises PatchError naming the first patch, file and hunk that does not apply.
    """
    before: dict[str, bytes | None] = {}
    current: dict[str, bytes | None] = {}
    for name, fd in series.runtime_diffs():
        if fd.path not in current:
            before[fd.path] = current[fd.path] = read(fd.path)
        current[fd.path] = apply_file_diff(fd, current[fd.path], name)
    return before, current
