"""The examples run, check what they claim, and the README's quick start runs as written."""

from __future__ import annotations

import importlib.util
import re
import runpy
from pathlib import Path

import pytest
import torch

from jacmem.derivatives import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load_demo():
    spec = importlib.util.spec_from_file_location("plot_save_memory", EXAMPLES / "plot_save_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_save_memory_quick(tmp_path, capsys, monkeypatch):
    """``--quick`` end to end: the check of every method in this process, then the
    memory of plain and jacmem's ``auto`` each in a process of its own, as in the demo
    (the other methods' processes are left out to keep it to seconds: each imports
    torch). Quick mode measures memory only, so the table has no time columns."""
    demo = _load_demo()
    spawn = demo.measure

    def measure(method, batch, repeats, quick):
        if method in ("plain", "jacmem:BatchGrad:auto"):
            return spawn(method, batch, repeats, quick)
        return dict(extra_bytes=2**30)

    monkeypatch.setattr(demo, "measure", measure)
    demo.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert (tmp_path / "plot_save_memory.png").stat().st_size > 0
    assert {"BackPACK unfold", "BackPACK save_memory", "jacmem unfold", "jacmem save_memory"} <= set(demo.METHODS)
    for label in demo.METHODS:  # one table row each: the label, then the peak alone
        assert re.search(rf"^{label}\s+\d+$", out, re.M), f"no table row for {label}:\n{out}"
    assert out.count("| True") == 2 * 10, out  # 10 parameters: same grad_batch, and sums to .grad
    per_sample = re.search(r"(\d+\.\d+) MiB per sample.* all 64 samples \((\d+\.\d+) MiB\), jacmem's for (\d+)", out)
    assert per_sample, out
    assert float(per_sample.group(2)) == pytest.approx(64 * float(per_sample.group(1)), abs=0.5)
    assert 1 <= int(per_sample.group(3)) < 64  # jacmem's unfold holds a chunk of the batch, not all of it


def test_plot_save_memory_time_columns_agree(capsys):
    """The table's ``× plain`` is its own ``time s`` over plain's, nothing else."""
    demo = _load_demo()
    results = {
        "plain": dict(extra_bytes=100 * 2**20, time_s=0.660),
        "jacmem save_memory": dict(extra_bytes=300 * 2**20, time_s=0.528),
    }
    rows = demo.table(results, 113 * 2**20)
    assert rows[1]["ratio"] == pytest.approx(0.528 / 0.660)
    out = capsys.readouterr().out
    assert re.search(r"^jacmem save_memory\s+300\s+0\.528\s+0\.80$", out, re.M), out


def test_plot_save_memory_check_raises_on_disagreement():
    """The demo's own check must catch methods that disagree, or a wrong sum."""
    demo = _load_demo()
    torch.manual_seed(0)
    grad_batch = {"w": torch.randn(4, 3, 2), "b": torch.randn(4, 3)}
    plain = {k: v.sum(0) for k, v in grad_batch.items()}
    demo.check({"plain": plain, "a": grad_batch, "b": grad_batch}, 4)

    off = {k: v.clone() for k, v in grad_batch.items()}
    off["w"][1, 0, 0] += 1e-2
    off["w"][2, 0, 0] -= 1e-2  # same sum: only the per-sample comparison can catch it
    with pytest.raises(ValueError, match=r"\['w'\]"):
        demo.check({"plain": plain, "a": grad_batch, "b": off}, 4)

    wrong = {"w": plain["w"] * 2, "b": plain["b"]}
    with pytest.raises(ValueError, match=r"\['w'\]"):
        demo.check({"plain": wrong, "a": grad_batch, "b": grad_batch}, 4)


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


def test_plot_attribution_lm_quick(monkeypatch, capsys):
    """A tiny GPT-2's training sequences scored against a count by 2 from 13: its twin in
    the training set lowers its loss most, the corrupted sequence with the same first six
    tokens raises it most, and counts by 2 score above counts by 3 on average."""
    pytest.importorskip("jacmem.attribution")
    _run_quick(monkeypatch, "plot_attribution_lm.py")
    out = capsys.readouterr().out
    twin = "[13, 15, 17, 19, 21, 23, 1, 3, 5, 7, 9, 11]"
    lower = out[out.index("lower its loss most:") :].splitlines()[1]
    assert re.fullmatch(r"\s+\+[\d.e+]+\s+counts by 2\s+" + re.escape(twin), lower), out
    raise_ = out[out.index("raise its loss most:") :].splitlines()[1]
    assert re.search(r"^\s+-[\d.e+]+\s+corrupted: by 2, then \+5\s+\[13, 15, 17, 19, 21, 23, 4,", raise_), out
    means = dict(re.findall(r"mean score, (counts by \d): ([-+][\d.e+-]+)", out))
    assert float(means["counts by 2"]) > float(means["counts by 3"]), out


@pytest.mark.slow
def test_plot_private_fsdp_quick(monkeypatch, capsys):
    """GPT-2 under FSDP2, two ranks started by torchrun: without noise, the loss curve is
    one process's on the same global batches (the example asserts it); with noise, ε."""
    _run_quick(monkeypatch, "plot_private_fsdp.py")
    out = capsys.readouterr().out
    assert re.search(r"σ = 0.8: final loss [\d.]+, ε = [\d.]+ at δ = 1e-05", out), out


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


@pytest.mark.heavy
def test_plot_bayesian_lora_quick(monkeypatch, capsys):
    """``JACMEM_QUICK=1`` end to end, in this process: the adapters' Kronecker factors
    match curvlinops' (the example asserts it), the figure is saved, and the Laplace is
    less confident than MAP on prompts with no right answer."""
    pytest.importorskip("laplace")
    pytest.importorskip("peft")
    monkeypatch.setenv("JACMEM_QUICK", "1")
    example = runpy.run_path(str(EXAMPLES / "plot_bayesian_lora.py"), run_name="__main__")
    results = example["results"]
    assert list(results) == ["MAP", "Laplace"]
    for r in results.values():
        assert 1 / example["K"] <= r["no marker (OOD)"]["confidence"] <= 1
        assert 0 <= r["held-out prompts"]["accuracy"] <= 1 and r["held-out prompts"]["nll"] > 0
    assert results["Laplace"]["no marker (OOD)"]["confidence"] < results["MAP"]["no marker (OOD)"]["confidence"]
    out = capsys.readouterr().out
    assert "2,048 of 4,180,288 parameters trainable" in out, out  # the adapters alone
    assert re.search(r"jacmem's equal curvlinops' within [\d.e+-]+ \(relative\)", out), out
    assert (ROOT / "out" / "plot_bayesian_lora.png").stat().st_size > 10_000


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
