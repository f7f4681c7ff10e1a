"""The memory report on a hand-written RNN cell
============================================

A hand-written GRU cell in a Python loop: what autograd keeps per step, and the fix
:func:`jacmem.memory.report` suggests.

A user on the PyTorch forum wrote a GRU-like cell with ``torch.mm`` in a Python loop
and found it needs about twice the memory of the built-in recurrent layers. Each
step's elementwise ops (sigmoid, tanh, the products of the gates) save their own
tensors of the hidden state's size. The report charges them to the cell, called
once per step, and suggests checkpointing each call: it keeps only the step's
inputs (the hidden state; ``x_t`` is a view of the input) and recomputes the gates
during backward, one more cell forward per step.

The cell is exactly ``nn.GRU(bias=False)``: the script checks that both give the
same outputs, and shows nn.GRU's report beside it.

The figures count the bytes autograd keeps, exactly, at any size. The peak resident
memory is measured only at full size: with ``--quick`` (or ``JACMEM_QUICK=1``, as the
docs build runs it) the tensors are too small to show in the resident set, and the
peak lines read n/a.

``python examples/plot_memory_rnn_cell.py [--quick]``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from jacmem.memory import peak_memory, report
from jacmem.memory.report import fmt_bytes

# sphinx-gallery runs an example without __file__, in the example's folder
sys.path.insert(0, str(Path(globals().get("__file__", "plot_memory_rnn_cell.py")).resolve().parent))
from _plotting import saved_totals, small_run  # noqa: E402


class Cell(nn.Module):
    """One GRU step by hand: x [N, I], h [N, H] -> h' [N, H]."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.weight_ih = nn.Parameter(torch.randn(input_size, 3 * hidden_size) / input_size**0.5)
        self.weight_hh = nn.Parameter(torch.randn(hidden_size, 3 * hidden_size) / hidden_size**0.5)

    def forward(self, x, h):
        r, z, n = torch.mm(x, self.weight_ih).chunk(3, 1)
        h_r, h_z, h_n = torch.mm(h, self.weight_hh).chunk(3, 1)
        r = torch.sigmoid(r + h_r)
        z = torch.sigmoid(z + h_z)
        n = torch.tanh(n + r * h_n)
        return n + z * (h - n)


class HandGRU(nn.Module):
    """The cell over a sequence: x [T, N, I], h [N, H] -> outputs [T, N, H], last h [N, H].
    ``checkpointed``: each step under torch.utils.checkpoint."""

    def __init__(self, input_size: int, hidden_size: int, checkpointed: bool = False):
        super().__init__()
        self.cell = Cell(input_size, hidden_size)
        self.checkpointed = checkpointed

    def forward(self, seq, h):
        outputs = []
        for x in seq.unbind(0):
            h = checkpoint(self.cell, x, h, use_reentrant=False) if self.checkpointed else self.cell(x, h)
            outputs.append(h)
        return torch.stack(outputs), h

    def as_gru(self) -> nn.GRU:
        """nn.GRU(bias=False) with the same weights."""
        gru = nn.GRU(self.cell.weight_ih.shape[0], self.cell.weight_hh.shape[0], bias=False)
        with torch.no_grad():
            gru.weight_ih_l0.copy_(self.cell.weight_ih.T)
            gru.weight_hh_l0.copy_(self.cell.weight_hh.T)
        return gru


def main(argv=None):
    small = small_run(argv, __doc__)
    torch.manual_seed(0)
    steps, batch, inputs, hidden = (12, 8, 16, 32) if small else (200, 32, 64, 256)
    seq, h0 = torch.randn(steps, batch, inputs), torch.zeros(batch, hidden)
    model = HandGRU(inputs, hidden)
    gru = model.as_gru()

    def train_step(net, h):
        net.zero_grad(set_to_none=True)
        out, _ = net(seq, h)
        out.square().mean().backward()

    def measure(net, h=h0):
        train_step(net, h)  # warm-up
        # --quick: tensors too small to show in the resident set, and measuring tunes malloc process-wide
        return None if small else peak_memory(lambda: train_step(net, h))

    print(f"A hand-written GRU cell over {steps} steps, batch {batch}, {inputs} -> {hidden}\n")
    with torch.no_grad():
        assert torch.allclose(model(seq, h0)[0], gru(seq, h0[None])[0], atol=1e-5), "the cell is not nn.GRU"
    before = report(model, seq, h0)
    print(before)
    peak_before = measure(model)
    grads = [p.grad.clone() for p in model.parameters()]

    print("\nApplying the suggestion: torch.utils.checkpoint around each call of the cell.\n")
    model.checkpointed = True
    after = report(model, seq, h0)
    print(after)
    peak_after = measure(model)
    diff = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), grads))

    reference = report(gru, seq, h0[None])
    peak_gru = measure(gru, h0[None])
    print("\nMeasured:")
    print(
        f"  saved for backward (report): hand-written {fmt_bytes(before.saved_bytes)}, checkpointed "
        f"{fmt_bytes(after.saved_bytes)} ({before.saved_bytes / max(after.saved_bytes, 1):.1f}x less), "
        f"nn.GRU {fmt_bytes(reference.saved_bytes)}"
    )
    print(
        f"  forward + backward, peak RSS: hand-written {fmt_bytes(peak_before)}, checkpointed "
        f"{fmt_bytes(peak_after)}, nn.GRU {fmt_bytes(peak_gru)}"
    )
    print(f"  largest difference of the weight gradients, checkpointed vs not: {diff:.2e}")
    reports = {"hand-written": before, "checkpointed": after, "nn.GRU": reference}
    saved_totals(reports, f"GRU over {steps} steps, batch {batch}: saved tensors")
    return {
        "before": before,
        "after": after,
        "gru": reference,
        "grad_diff": diff,
        "shape": (steps, batch, inputs, hidden),
    }


if __name__ == "__main__":
    main()
