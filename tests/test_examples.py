"""The examples run, check what they claim, and the README's quick start runs as written."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _load_demo():
    spec = importlib.util.spec_from_file_location("plot_save_memory", EXAMPLES / "plot_save_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_save_memory_quick(tmp_path, capsys):
    """The parent runs here; each strategy's worker still gets a process of its own."""
    demo = _load_demo()
    demo.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert (tmp_path / "plot_save_memory.png").stat().st_size > 0
    names = ["plain", *demo.strategies()]
    assert {"unfold", "save_memory", "auto"} <= set(names)
    for name in names:  # one table row each: name, then six numbers
        assert re.search(rf"^{name}\s+(\S+\s+){{5}}\S+$", out, re.M), f"no table row for {name}:\n{out}"
    assert out.count("| True") == 2 * 10, out  # 10 parameters: same grad_batch, and sums to .grad


def test_plot_save_memory_check_raises_on_disagreement(tmp_path):
    """The demo's own check must catch strategies that disagree, or a wrong sum."""
    demo = _load_demo()
    torch.manual_seed(0)
    grad_batch = {"w": torch.randn(4, 3, 2), "b": torch.randn(4, 3)}
    dumps = {name: str(tmp_path / f"{name}.pt") for name in ("plain", "a", "b")}
    torch.save({k: v.sum(0) for k, v in grad_batch.items()}, dumps["plain"])
    torch.save(grad_batch, dumps["a"])
    torch.save(grad_batch, dumps["b"])
    assert demo.check(dumps, 4) == sum(v.numel() * 4 for v in grad_batch.values())

    off = {k: v.clone() for k, v in grad_batch.items()}
    off["w"][1, 0, 0] += 1e-2
    off["w"][2, 0, 0] -= 1e-2  # same sum: only the per-sample comparison can catch it
    torch.save(off, dumps["b"])
    with pytest.raises(ValueError, match=r"\['w'\]"):
        demo.check(dumps, 4)

    torch.save(grad_batch, dumps["b"])
    torch.save({"w": grad_batch["w"].sum(0) * 2, "b": grad_batch["b"].sum(0)}, dumps["plain"])
    with pytest.raises(ValueError, match=r"\['w'\]"):
        demo.check(dumps, 4)


def test_custom_module():
    out = _run(str(EXAMPLES / "custom_module.py"))
    for param in ("weight", "bias"):  # ctx.explain() names the registered strategy
        assert re.search(rf"^1\.{param}\b.*\belementwise\b", out, re.M), out
    assert out.count("match the per-sample loop") == 6


def test_readme_quick_start_runs():
    """Every ```python block of the README, in order, as written."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)
    weight = namespace["model"][0].weight
    assert weight.grad_batch.shape == (32, 8, 1, 3, 3)  # as the README says
    assert weight.variance.shape == (8, 1, 3, 3)
