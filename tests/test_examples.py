"""The examples run, check what they claim, and the README's quick start runs as written."""

from __future__ import annotations

import importlib.util
import re
import runpy
from pathlib import Path

import pytest
import torch

from jacmem.derivatives import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load_demo():
    spec = importlib.util.spec_from_file_location("plot_save_memory", EXAMPLES / "plot_save_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_save_memory_quick(tmp_path, capsys, monkeypatch):
    """``--quick`` end to end. To keep it to seconds, the parent runs here, ``auto``'s
    two workers (time, memory) in processes of their own as in the demo, and the other
    workers in this process (the memory figures do not matter here, and each process
    start imports torch)."""
    demo = _load_demo()
    spawn = demo.run_worker

    def run_worker(strategy, batch, repeats, dump, malloc):
        if strategy == "auto":
            return spawn(strategy, batch, repeats, dump, malloc)
        return demo.worker(strategy, batch, repeats, dump)

    monkeypatch.setattr(demo, "run_worker", run_worker)
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


def test_custom_module(capsys):
    """Run in this process (a process start costs a torch import); what it registers
    is taken out of the registry afterwards."""
    before = set(REGISTRY)
    try:
        runpy.run_path(str(EXAMPLES / "plot_custom_module.py"), run_name="__main__")
    finally:
        for module_type in set(REGISTRY) - before:
            del REGISTRY[module_type]
    out = capsys.readouterr().out
    for param in ("weight", "bias"):  # ctx.explain() names the registered strategy
        assert re.search(rf"^1\.{param}\b.*\belementwise\b", out, re.M), out
    assert out.count("match the per-sample loop") == 6


def _run_quick(monkeypatch, name: str) -> None:
    """``examples/<name>`` in this process, with ``JACMEM_QUICK=1``."""
    monkeypatch.setenv("JACMEM_QUICK", "1")
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_plot_dp_cnn_quick(monkeypatch, capsys):
    """Two epochs of DP-SGD on the seed CNN: ε grows, the figure is written."""
    _run_quick(monkeypatch, "plot_dp_cnn.py")
    out = capsys.readouterr().out
    eps = [float(e) for e in re.findall(r"ε = ([\d.]+) at δ = 1e-05", out)]
    assert len(eps) == 2 and 0 < eps[0] < eps[1], out
    assert (ROOT / "out" / "plot_dp_cnn.png").stat().st_size > 10_000


def test_plot_dp_gpt2_finetune_quick(monkeypatch, capsys):
    """A tiny GPT-2, most weights frozen: two epochs, then HF's generate on the same object."""
    _run_quick(monkeypatch, "plot_dp_gpt2_finetune.py")
    out = capsys.readouterr().out
    assert "12,768 of 26,880 parameters trainable" in out, out
    eps = [float(e) for e in re.findall(r"ε = ([\d.]+) at δ = 1e-05", out)]
    assert len(eps) == 2 and 0 < eps[0] < eps[1], out
    assert re.search(r"prompt \[3, 5, 7\] -> generated \[(\d+, ){5}\d+\]", out), out


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


@pytest.mark.heavy
def test_plot_laplace_resnet_quick(tmp_path, capsys, monkeypatch):
    """``JACMEM_QUICK=1`` end to end, in this process: both Laplace fits run through
    jacmem, the figure is saved, and the claim the plot illustrates holds: under the
    strongest shift, each Laplace is less confident than the MAP network."""
    pytest.importorskip("laplace")
    monkeypatch.setenv("JACMEM_QUICK", "1")
    spec = importlib.util.spec_from_file_location("plot_laplace_resnet", EXAMPLES / "plot_laplace_resnet.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--out", str(tmp_path)])
    assert (tmp_path / "plot_laplace_resnet.png").stat().st_size > 0
    assert list(results) == ["MAP", "diag Laplace", "kron Laplace"]
    for rows in results.values():
        assert len(rows) == len(example.SHIFTS)
        assert all(1 / example.CLASSES <= c <= 1 and 0 <= a <= 1 for c, a in rows)
    for name in ("diag Laplace", "kron Laplace"):
        assert results[name][-1][0] < results["MAP"][-1][0], results
    out = capsys.readouterr().out
    assert "diag Laplace: prior precision" in out and "kron Laplace: prior precision" in out


def test_plot_first_steps_norms_are_each_samples_own():
    """The start-here example's per-sample gradient norms, against a loop of one backward
    per sample on the same model; and what its text claims: the mislabelled samples are
    among the largest."""
    example = runpy.run_path(str(EXAMPLES / "plot_first_steps.py"), run_name="__main__")
    model, X, y, norms = example["model"], example["X"], example["y"], example["norms"]
    loop = []
    for x_n, y_n in zip(X, y):
        grads = torch.autograd.grad(example["lossfunc"](model(x_n[None]), y_n[None]), list(model.parameters()))
        loop.append(sum(g.square().sum() for g in grads).sqrt())
    torch.testing.assert_close(norms, torch.stack(loop), rtol=1e-4, atol=1e-6)
    top = set(norms.argsort(descending=True)[: example["WRONG"]].tolist())
    assert len(top & set(example["wrong"].tolist())) >= example["WRONG"] - 1


def test_benchmark_child_peak_is_its_own_not_its_spawners():
    """The gallery's benchmark examples run children from the docs build, a process of
    hundreds of MiB: a child's peak after its reset must not start at that size."""
    import subprocess
    import sys

    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # resident, page by page
    code = "from benchmarks import child; child._reset_peak(); print(child._peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert int(out) < 200 * 2**20, f"the child's peak {int(out) / 2**20:.0f} MiB includes its spawner's"
    del ballast
