"""Let torchvision's Python parts import where its C++ extension cannot load.

Why: PyPI's torchvision wheel for Linux is built against the CUDA build of torch. Beside
the CPU build of torch (the one `constraints.txt` pins for development), its extension
``torchvision/_C.so`` cannot load (it links ``libtorch_cuda.so``). torchvision then skips
its C++ ops, but ``torchvision/_meta_registrations.py`` still registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` at import, and ``import torchvision`` dies
with ``RuntimeError: operator torchvision::nms does not exist``. timm imports torchvision,
transformers does where it is installed, and backpack-for-pytorch depends on it.

What: before torchvision's first import, this module tries to load ``_C`` itself. Where that
works, it does nothing. Where it fails, it declares the schemas of torchvision's C++ ops
(``torch.library``) with CPU and CUDA kernels that raise a clear error. So
``import torchvision`` works, ``torchvision.models.resnet18()`` runs forward and backward
(pure PyTorch), and calling a C++ op (``nms``, ``roi_align``, ``deform_conv2d``...) raises
a ``RuntimeError`` that says why. torchvision's own wrappers (``torchvision.ops.nms``) raise
their "Couldn't load custom C++ ops" error first, as they would without the shim.

How it is installed: ``python tools/torchvision_cpu_shim.py install`` (run by the Makefile
after every environment install) checks ``import torchvision`` in a subprocess, and only
where it fails with the missing-operator error copies this file into the environment's
site-packages as ``_jacmem_torchvision_shim.py`` with a ``.pth`` file that imports it at
start-up. The import is cheap: it only adds a finder to ``sys.meta_path``, which acts on
the first ``import torchvision`` and then removes itself. ``... uninstall`` removes both
files. jacmem itself never imports this module: it is part of the development
environment, not of the package.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys

MODULE = "_jacmem_torchvision_shim"

# torchvision 0.28's operator schemas (torchvision/csrc/ops/*.cpp), name -> signature.
SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "qroi_align": "(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "ps_roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
    "-> Tensor",
    "deform_conv2d": "(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, "
    "Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, "
    "Tensor)",
    "box_iou_rotated": "(Tensor boxes1, Tensor boxes2) -> Tensor",
}

# The torch.library registrations live as long as this object.
_LIBRARY = None
# Why _C did not load, for the error message; None where the shim did nothing.
REASON: str | None = None


def _extension_path(package_dir: str) -> str | None:
    """torchvision's ``_C`` library in its package folder, as torchvision looks it up."""
    finder = importlib.machinery.FileFinder(
        package_dir, (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    )
    spec = finder.find_spec("_C")
    return spec.origin if spec is not None else None


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(
            f"torchvision::{name} is not available: torchvision's C++ extension could not be loaded "
            f"beside this torch ({REASON}). Only torchvision's pure-Python parts (models, transforms "
            "on tensors) work here; install a torchvision built for this torch to use its C++ ops. "
            f"(Set up by {MODULE}, which the jacmem development environment installs; see docs/install.rst in jacmem's repository.)"
        )

    return kernel


def define_ops(reason: str) -> None:
    """Declare torchvision's operators with kernels that raise; once."""
    global _LIBRARY, REASON
    if _LIBRARY is not None:
        return
    import torch

    REASON = reason
    library = torch.library.Library("torchvision", "FRAGMENT")
    for name, signature in SCHEMAS.items():
        library.define(name + signature)
        for key in ("CPU", "CUDA"):
            library.impl(name, _unavailable(name), key)
    library.define("_cuda_version() -> int")
    library.impl("_cuda_version", lambda: -1, "CompositeExplicitAutograd")
    _LIBRARY = library


def prepare(package_dir: str) -> None:
    """Load torchvision's ``_C`` where it loads; declare its ops where it does not."""
    import torch

    path = _extension_path(package_dir)
    if path is None:  # a source checkout without a build: torchvision copes by itself
        return
    try:
        torch.ops.load_library(path)
    except OSError as e:  # torch's message names the file; its cause says what is missing
        define_ops(str(e.__cause__ or e))


class _Finder(importlib.abc.MetaPathFinder):
    """Acts once, on the first ``import torchvision``, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.submodule_search_locations:
            prepare(list(spec.submodule_search_locations)[0])
        return None  # the usual finders import torchvision itself


def activate() -> None:
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


# -- installing into an environment ----------------------------------------------------

MISSING_OP = "operator torchvision::"


def _torchvision_error(python: str) -> str | None:
    """stderr of ``import torchvision`` in a fresh interpreter; None where it imports."""
    import subprocess

    result = subprocess.run([python, "-c", "import torchvision"], capture_output=True, text=True)
    return None if result.returncode == 0 else result.stderr


def _site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def install() -> int:
    import os
    import shutil

    target = os.path.join(_site_packages(), MODULE + ".py")
    pth = os.path.join(_site_packages(), MODULE + ".pth")
    if os.path.exists(target):
        shutil.copyfile(__file__, target)  # keep it current
        print(f"torchvision shim: updated in {target}")
        return 0
    if importlib.util.find_spec("torchvision") is None:
        print("torchvision shim: not needed (torchvision is not installed)")
        return 0
    error = _torchvision_error(sys.executable)
    if error is None:
        print("torchvision shim: not needed (import torchvision works)")
        return 0
    if MISSING_OP not in error or "does not exist" not in error:
        print("torchvision shim: import torchvision fails for another reason; not installing:\n" + error)
        return 1
    shutil.copyfile(__file__, target)
    with open(pth, "w") as f:
        f.write(f"import {MODULE}; {MODULE}.activate()\n")
    error = _torchvision_error(sys.executable)
    if error is not None:
        print("torchvision shim: installed, but import torchvision still fails:\n" + error)
        return 1
    print(f"torchvision shim: installed in {target} (torchvision's C++ extension does not load beside this torch)")
    return 0


def uninstall() -> int:
    import os

    for suffix in (".py", ".pth"):
        path = os.path.join(_site_packages(), MODULE + suffix)
        if os.path.exists(path):
            os.remove(path)
            print(f"torchvision shim: removed {path}")
    return 0


if __name__ == "__main__":
    commands = {"install": install, "uninstall": uninstall}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python {sys.argv[0]} install|uninstall (into the running interpreter's environment)")
    sys.exit(commands[sys.argv[1]]())
