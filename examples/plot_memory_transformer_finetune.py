"""Lean layers on a BERT encoder
=============================

Fine-tuning only the LayerNorms of an HF BERT encoder: what autograd keeps, and what
:func:`jacmem.memory.lean` keeps instead.

memsave's poster found that on transformers (T5, Mistral) selective differentiation
saved least: 0.88x and 0.94x of stock's saved activations. With only the norms
trainable, a stock BERT layer still keeps, for the input gradients that reach the
first norm, the GELU's input, every LayerNorm's input, the dropout masks, and, since
the sdpa path with dropout runs the math backend on CPU, the softmax, its dropout
mask and the dropped softmax. The report names them by module and says what a lean
copy keeps; ``lean`` keeps dropout seeds and, in the attention, q, k, v, a
log-sum-exp and a seed.

The figures count the bytes autograd keeps, exactly, at any size. The peak resident
memory is measured only at full size: with ``--quick`` (or ``JACMEM_QUICK=1``, as the
docs build runs it) the tensors are too small to show in the resident set, and the
peak lines read n/a.

``python examples/plot_memory_transformer_finetune.py [--quick]``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from jacmem.memory import lean, peak_memory, report
from jacmem.memory.report import fmt_bytes

# sphinx-gallery runs an example without __file__, in the example's folder
sys.path.insert(0, str(Path(globals().get("__file__", "plot_memory_transformer_finetune.py")).resolve().parent))
from _plotting import saved_by_module, small_run  # noqa: E402


def main(argv=None):
    small = small_run(argv, __doc__)
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    size = (
        dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2)
        if small
        else dict(num_hidden_layers=2)  # BERT-base's layer shape
    )
    n, t = (2, 16) if small else (8, 128)
    model = BertModel(BertConfig(**size), add_pooling_layer=False).train()
    for name, p in model.named_parameters():
        p.requires_grad_("LayerNorm" in name)
    x = torch.randn(n, t, model.config.hidden_size)

    def loss(net):
        return net(inputs_embeds=x).last_hidden_state.square().mean()

    def measure(net):
        loss(net).backward()  # warm-up (lean layers learn which layers read their outputs)
        # --quick: tensors too small to show in the resident set, and measuring tunes malloc process-wide
        return None if small else peak_memory(lambda: loss(net).backward())

    print(f"HF BERT, {size['num_hidden_layers']} layers, LayerNorm-only fine-tuning, batch {n}x{t}\n")
    before = report(model, inputs_embeds=x)
    print(before)
    peak_before = measure(model)

    print("\nApplying jacmem.memory.lean(model):\n")
    lean(model)
    after = report(model, inputs_embeds=x, lean=False)
    print(after.table(top=6))
    peak_after = measure(model)
    print("\nMeasured:")
    print(
        f"  saved for backward (report): stock {fmt_bytes(before.saved_bytes)}, lean {fmt_bytes(after.saved_bytes)} "
        f"({after.saved_bytes / before.saved_bytes:.2f}x; memsave on T5: 0.88x)"
    )
    print(f"  forward + backward, peak RSS: stock {fmt_bytes(peak_before)}, lean {fmt_bytes(peak_after)}")
    saved_by_module({"stock": before, "lean": after}, "BERT, LayerNorms trainable: saved tensors")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
