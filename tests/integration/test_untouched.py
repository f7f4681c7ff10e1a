"""Touch nothing you were not asked to: importing jacmem and reporting memory leave
torch's random state, the model's parameters, buffers (BatchNorm statistics) and
training flags as they were."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import jacmem

IMPORT_SCRIPT = textwrap.dedent(
    """
    import torch
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.manual_seed_all(0)
    {imports}
    print(torch.rand(4).tolist(), torch.rand(4, device="cuda").tolist() if cuda else None)
    """
)


def _draw(imports: str) -> str:
    script = IMPORT_SCRIPT.format(imports=imports)
    return subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout


def test_import_leaves_random_state():
    """A script that seeds and then imports jacmem draws what it draws without it
    (the RNN family's example modules were built with random weights at import)."""
    plain = _draw("")
    assert _draw("import jacmem, jacmem.laplace, jacmem.privacy, jacmem.memory") == plain


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 2),
        nn.BatchNorm1d(2),
    )


def _state(model: nn.Module):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [m.training for m in model.modules()],
        torch.random.get_rng_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    )


def _assert_same(before, after):
    assert before[0].keys() == after[0].keys()
    changed = [k for k in before[0] if not torch.equal(before[0][k], after[0][k])]
    assert not changed, f"report changed {changed}"
    assert before[1] == after[1], "report changed a training flag"
    assert torch.equal(before[2], after[2]), "report moved torch's CPU random state"
    if before[3] is not None:
        assert all(torch.equal(a, b) for a, b in zip(before[3], after[3])), "report moved a CUDA random state"


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("call", ["model", "function"])
def test_report_leaves_model_and_random_state(lean, call):
    """A train-mode BatchNorm's running statistics and num_batches_tracked, the Dropout's
    draw and the parameters are as before the report."""
    model, X = _model(), torch.randn(5, 3, 8, 8)
    before = _state(model)
    if call == "model":
        r = jacmem.memory.report(model, X, lean=lean)
    else:
        r = jacmem.memory.report(lambda x: model(x).sum(), X, lean=lean and None)
    assert r.saved_bytes > 0
    _assert_same(before, _state(model))


def test_report_restores_when_the_forward_raises():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()

        def forward(self, x):
            self.body(x)
            self.body.eval()
            raise RuntimeError("boom")

    model, X = Fails(), torch.randn(5, 3, 8, 8)
    before = _state(model)
    with pytest.raises(RuntimeError, match="boom"):
        jacmem.memory.report(model, X)
    _assert_same(before, _state(model))


def test_report_restores_a_buffer_the_forward_replaced():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen = self.seen + len(x)  # a new tensor, not an in-place update
            return self.lin(x)

    model = Counts()
    buffer = model.seen
    jacmem.memory.report(model, torch.randn(4, 3))
    assert model.seen is buffer and model.seen.item() == 0
