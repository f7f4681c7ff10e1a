"""The three memory examples, run with --quick: each prints a report, applies the fix
it suggests, and measures before and after. The expected byte counts are worked out
by hand from the shapes (float32) and from what each op saves."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str, capsys):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick"])
    return result, capsys.readouterr().out


def test_nngp_kernel(capsys):
    result, out = _run("plot_memory_nngp_kernel", capsys)
    n, size, depth = result["shape"]
    before, after = result["before"], result["after"]
    suggested = [s for s in before.suggestions if "torch.utils.checkpoint.checkpoint" in s]
    assert {s.split(" ")[0] for s in suggested} == {f"layers.{2 * i + 1}" for i in range(depth)}  # the ReLU layers
    # a checkpointed ReLU layer keeps only its inputs: xy [N, N, H, W], xx [N, 1, H, W], yy [1, N, H, W]
    rows = {m.name: m for m in after.modules}
    for i in range(depth):
        assert rows[f"layers.{2 * i + 1}"].bytes == (n * n + 2 * n) * size * size * 4
    assert after.saved_bytes < before.saved_bytes / 3
    assert result["grad_diff"] == 0.0  # recomputation gives the same gradients
    assert "Measured:" in out and "peak RSS" in out


def test_rnn_cell(capsys):
    result, out = _run("plot_memory_rnn_cell", capsys)
    steps, batch, inputs, hidden = result["shape"]
    before, after = result["before"], result["after"]
    cell = {m.name: m for m in before.modules}["cell"]
    assert cell.calls == steps
    assert any("checkpoint" in s and s.startswith("cell ") for s in before.suggestions)
    # checkpointed: the hidden state entering each step but the first (h0 is an input; x_t views the input)
    assert after.saved_bytes == (steps - 1) * batch * hidden * 4
    assert result["grad_diff"] == 0.0
    assert "nn.GRU" in out


def test_conv_bn_relu(capsys):
    result, out = _run("plot_memory_conv_bn_relu", capsys)
    depth, width, n, size = result["shape"]
    act, stats, head_input = n * width * size * size * 4, width * 4, n * width * 4
    before, fused = result["training"]
    # per block: BN's input, its batch mean and invstd, ReLU's output (kept by the next conv too)
    assert before.saved_bytes == depth * (2 * act + 2 * stats) + head_input
    assert any("BatchNormAct" in s for s in before.suggestions)
    assert fused.saved_bytes == depth * (act + stats) + head_input  # BatchNormAct: its output and invstd
    before, leaned = result["tuning"]
    assert before.wasted_bytes == depth * act  # eval BN's inputs (ReLU's outputs are needed by ReLU)
    assert any("jacmem.memory.lean(model)" in s for s in before.suggestions)
    assert leaned.saved_bytes == depth * -(-act // 4 // 8) + head_input  # 1 bit per element
    assert result["grad_diff"] < 1e-5
    assert out.count("peak RSS: before n/a, after n/a") == 2  # --quick measures no RSS


def test_transformer_finetune(capsys):
    import pytest

    pytest.importorskip("transformers")
    result, out = _run("plot_memory_transformer_finetune", capsys)
    before, after = result["before"], result["after"]
    assert after.saved_bytes == before.lean_saved_bytes  # the report's forecast is what lean keeps
    assert after.saved_bytes < 0.6 * before.saved_bytes
    assert "Largest savers" in out and "encoder.layer.0" in out and "memsave on T5" in out
