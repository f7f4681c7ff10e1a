"""The development environment has what the tests and `make bench` build models from:
torchvision's ResNets, timm's ViTs and HF transformers' GPT-2, all random-init, nothing
downloaded. Where PyPI's torchvision cannot load its C++ ops beside the CPU torch, the
Makefile's shim (tools/torchvision_cpu_shim.py) makes its Python parts importable; these
tests fail if neither works."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SHIM = Path(__file__).resolve().parents[2] / "tools" / "torchvision_cpu_shim.py"


def _backward_works(model, x):
    model(x).float().sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_torchvision_resnet18_forward_backward():
    torchvision = pytest.importorskip("torchvision")
    _backward_works(torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32))


def test_timm_vit_tiny():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10)
    _backward_works(model, torch.randn(2, 3, 32, 32))


def test_transformers_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    assert model.transformer.wte.weight.grad is not None


def test_torchvision_c_ops_fail_clearly():
    """With the shim in place, a C++ op raises an error that says why, not a crash."""
    torchvision = pytest.importorskip("torchvision")
    shim = sys.modules.get("_jacmem_torchvision_shim")
    if shim is None or shim.REASON is None:
        pytest.skip("torchvision's own C++ extension is loaded here; the shim did nothing")
    boxes, scores = torch.rand(3, 4), torch.rand(3)
    with pytest.raises(RuntimeError, match="is not available: torchvision's C\\+\\+ extension could not be loaded"):
        torch.ops.torchvision.nms(boxes, scores, 0.5)
    with pytest.raises(RuntimeError, match="torchvision::roi_align is not available"):
        torch.ops.torchvision.roi_align(torch.rand(1, 1, 4, 4), torch.rand(1, 5), 1.0, 2, 2, 1, False)
    with pytest.raises(RuntimeError):  # torchvision's wrapper checks first, with its own message
        torchvision.ops.nms(boxes, scores, 0.5)


def test_shim_does_nothing_where_the_extension_loads(tmp_path):
    """The shim defines no operator where torchvision's ``_C`` loads, or where there is none."""
    spec = importlib.util.spec_from_file_location("shim_under_test", SHIM)
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    shim.prepare(str(tmp_path))  # an empty folder: no _C to load, nothing to declare
    assert shim.REASON is None and shim._LIBRARY is None


def test_shim_module_imports_without_torch():
    """The .pth line runs at every interpreter start: it must not import torch."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(SHIM)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
