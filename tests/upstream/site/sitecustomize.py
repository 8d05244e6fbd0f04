"""Start-up hook of the upstream gate's test processes (on their PYTHONPATH only).

vLLM imports transformers' torchvision-backed image processors (llava ->
pixtral -> `torchvision.transforms.v2`), so its tests need torchvision. The
only torchvision 0.28.0 wheel here is PyPI's CUDA build: next to
torch 2.13.0+cpu its compiled ops (`torchvision/_C.so`) cannot load, which
torchvision tolerates, except that `torchvision/_meta_registrations.py`
registers fake kernels for `torchvision::nms` and `torchvision::qnms`
unconditionally, and that raises "operator torchvision::nms does not exist",
so `import torchvision` fails.

This hook waits for the first `import torchvision`; if the compiled ops do
not load, it defines the schemas of those two operators (no kernels), so the
import succeeds and torchvision's pure-Python transforms work. Calling
`torchvision.ops.nms` still fails, as it would without the ops. Where the ops
do load (a CUDA torch), it does nothing. Nothing here imports torch before
something imports torchvision.
"""

import importlib.abc
import importlib.machinery
import sys

_LIBS = []  # a torch.library.Library drops its definitions when collected


def _define_missing_ops(search_locations) -> None:
    import glob
    import os

    import torch

    for location in search_locations or ():
        for so in glob.glob(os.path.join(location, "_C*.so")):
            try:
                torch.ops.load_library(so)
                return
            except (ImportError, OSError):
                pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)


class _TorchvisionWithoutOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            try:
                _define_missing_ops(spec.submodule_search_locations)
            except Exception as exc:  # never break the import itself
                print(f"upstream gate sitecustomize: {exc!r}", file=sys.stderr)
        return spec


sys.meta_path.insert(0, _TorchvisionWithoutOps())
