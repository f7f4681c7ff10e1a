"""jacmem.memory.report: what autograd keeps, by module and op, counted per storage.

Expected byte counts are worked out by hand from the shapes and from what PyTorch's
derivative formulas save (documented in tools/autograd/derivatives.yaml), not from
the report's own output.
"""

import json

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from jacmem.memory import report

#: every test here in float64 (conftest.py restores the default after each)
pytestmark = pytest.mark.usefixtures("float64_default")


def test_views_and_inplace_outputs_count_once():
    x = torch.randn(10, 20, requires_grad=True)

    def fn(x):
        y = x * 2  # saves nothing (a Python scalar)
        y.relu_()  # saves its result: y, in place
        a = y.view(-1).sin()  # saves a view of y
        b = y.cos()  # saves y
        return (a.sum() + b.sum()).reshape(1)

    r = report(fn, x)
    assert r.saved_bytes == 10 * 20 * 8
    ops = {(t.op, t.slot) for t in r.tensors}
    assert ops == {("ReluBackward0", "result"), ("SinBackward0", "self"), ("CosBackward0", "self")}
    assert len({t.storage for t in r.tensors}) == 1


def test_by_module_and_op_with_parameters_by_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    x = torch.randn(4, 5)
    r = report(model, x)
    rows = {m.name: m for m in r.modules}
    # Linear 0: x (an input) and weight.t() (a parameter): no new memory
    assert rows["0"].bytes == 0 and rows["0"].tensors == 1  # x needs no grad: only mat1 for the weight
    # ReLU keeps its output [4, 7]; Linear 2 keeps the same storage for its weight's gradient
    assert rows["1"].bytes == 4 * 7 * 8 and rows["1"].exclusive == 0
    assert rows["2"].bytes == 0
    mat1 = [t for t in r.tensors if t.module == "2" and t.slot == "mat1"]
    assert len(mat1) == 1 and mat1[0].op == "AddmmBackward0" and mat1[0].needed_for == ("2.weight",)
    mat2 = [t for t in r.tensors if t.module == "2" and t.slot == "mat2"]
    assert mat2[0].kind == "parameter" and mat2[0].needed_for == ("input",)
    assert r.saved_bytes == 4 * 7 * 8
    assert r.parameter_bytes == r.trainable_bytes == (5 * 7 + 7 + 7 * 3 + 3) * 8
    assert r.output_bytes == 4 * 3 * 8 and r.input_bytes == 4 * 5 * 8


def test_frozen_conv_and_eval_batchnorm_inputs_are_wasted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    r = report(model, x)
    conv_out = 2 * 4 * 4 * 4 * 8
    wasted = {(t.module, t.op, t.slot) for t in r.tensors if t.wasted}
    assert wasted == {
        ("0", "ConvolutionBackward0", "input"),  # x: kept needlessly, but the caller holds it anyway
        ("1", "NativeBatchNormBackward0", "input"),
        ("2", "ConvolutionBackward0", "input"),
    }
    assert r.wasted_bytes == r.saved_bytes == 2 * conv_out  # conv 0's output, BN's output
    why = next(t.why for t in r.tensors if t.module == "2" and t.wasted)
    assert "2.weight" in why
    text = str(r)
    assert "jacmem.memory.lean(model)" in text and "Kept for no computed gradient" in text

    model[2].weight.requires_grad_(True)  # now conv 2 needs its input
    r = report(model, x)
    assert {(t.module, t.slot) for t in r.tensors if t.wasted} == {("0", "input"), ("1", "input")}
    assert r.saved_bytes == 2 * conv_out and r.wasted_bytes == conv_out  # BN's input only


def test_conv_bn_relu_train_totals_and_fuse_suggestion():
    """Train mode: conv keeps its input (the caller's x: no new memory), BN its input
    and batch mean and invstd, ReLU its output (the model's output)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 5, 5)
    r = report(model, x)
    act = 2 * 4 * 5 * 5 * 8
    assert r.saved_bytes == act + 2 * 4 * 8
    assert r.output_bytes == act
    assert [t.kind for t in r.tensors if t.op == "ReluBackward0"] == ["output"]
    assert any("BatchNormAct" in s for s in r.suggestions)


class Chain(nn.Module):
    """Several elementwise ops, each saving a tensor the size of its input."""

    def forward(self, x):
        return x.exp().sin().cos().tanh()


def test_loop_calls_and_checkpoint_suggestion():
    cell = Chain()
    model = nn.ModuleDict({"cell": cell})

    def run(h):
        for _ in range(3):
            h = model["cell"](h)
        return h

    h = torch.randn(8, 16, requires_grad=True)
    r = report(run, h)
    row = {m.name: m for m in r.modules}["Chain@0"]  # a plain callable: modules named by type
    assert row.calls == 3 and row.tensors == 3 * 4
    # per call: exp's result (which sin saves too), cos's input, tanh's result; the last
    # call's tanh result is the output
    assert r.saved_bytes == (3 * 2 + 2) * 8 * 16 * 8
    assert any("torch.utils.checkpoint" in s and "Chain@0" in s for s in r.suggestions)
    assert not any("save_on_cpu(" in s for s in r.suggestions)  # offloading is for accelerators


def test_bound_method_names_modules():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    r = report(model.forward, torch.randn(2, 3))
    assert {m.name for m in r.modules} == {"0", "1"}


def test_relu_and_dropout_suggestions():
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2)).train()
    for p in model[3].parameters():
        p.requires_grad_(False)  # nothing after the dropout keeps its output
    r = report(model, torch.randn(16, 4))
    joined = "\n".join(r.suggestions)
    assert "1-bit mask" in joined and "RNG seed" in joined


def test_to_dict_is_plain_and_complete():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    r = report(model, torch.randn(1, 1, 4, 4))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["totals"]["saved_bytes"] == r.saved_bytes
    assert {m["name"] for m in d["modules"]} == {"0", "1"}
    assert sum(o["tensors"] for o in d["ops"]) == len(d["tensors"]) == len(r.tensors)


def test_hooks_removed_even_on_error():
    pre = len(module_hooks._global_forward_pre_hooks)
    post = len(module_hooks._global_forward_hooks)

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        report(Boom(), torch.randn(2))
    report(nn.Linear(2, 2), torch.randn(1, 2))
    assert len(module_hooks._global_forward_pre_hooks) == pre
    assert len(module_hooks._global_forward_hooks) == post


def test_trainable_leaf_tensors_count_as_parameters_not_inputs():
    """A callable with a trainable tensor of its own (functional style): saved by
    reference, like a parameter; the input requiring grad stays an input."""
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    r = report(lambda t: torch.tanh(t @ w), x)
    kinds = {t.slot: t.kind for t in r.tensors if t.op == "MmBackward0"}
    assert kinds == {"self": "input", "mat2": "parameter"}
    assert r.parameter_bytes == r.trainable_bytes == 6 * 4 * 8
    assert r.saved_bytes == 0  # tanh keeps its result: the output
