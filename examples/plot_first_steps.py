"""First steps: per-sample gradients find mislabelled samples
==========================================================

Start here. One ``loss.backward()`` inside ``jacmem.extend`` gives, beside ``.grad``,
each sample's gradient (``BatchGrad``: ``grad_batch [N, *param.shape]``) and its
squared norm (``BatchL2Grad``: ``batch_l2 [N]``).

A small CNN learns ten classes of noisy 14×14 images, six of whose 64 training labels
are wrong. After a few steps of training the model fits the clean samples, and the
mislabelled ones still pull hard: their gradients are among the largest. The
per-sample gradient norms point to them, from one backward pass over the whole batch.

Run: ``python examples/plot_first_steps.py`` (seconds, at any setting).
"""

from __future__ import annotations

import torch
from torch import nn

import jacmem

N, CLASSES, WRONG, STEPS = 64, 10, 6, 40

torch.manual_seed(0)
templates = torch.randn(CLASSES, 1, 14, 14)
labels = torch.arange(N) % CLASSES
X = templates[labels] + 0.8 * torch.randn(N, 1, 14, 14)
y = labels.clone()
wrong = torch.arange(WRONG) * (N // WRONG)  # spread over the batch
y[wrong] = (labels[wrong] + 1 + torch.randint(0, CLASSES - 1, (WRONG,))) % CLASSES

model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 6 * 6, CLASSES))
lossfunc = nn.CrossEntropyLoss()

# %%
# Train as usual: jacmem is not involved, and the model needs no change.

optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for _ in range(STEPS):
    optimizer.zero_grad()
    lossfunc(model(X), y).backward()
    optimizer.step()

# %%
# One backward pass inside the block. Each parameter gets ``grad_batch`` and
# ``batch_l2`` beside its ``.grad``; the per-sample gradients are scaled as the loss
# is (a mean here), so that they sum to ``.grad``.

model.zero_grad()
with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad()) as ctx:
    lossfunc(model(X), y).backward()

for name, p in model.named_parameters():
    torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
    torch.testing.assert_close(p.batch_l2, p.grad_batch.flatten(1).square().sum(1))
    print(f"{name:>9}: grad_batch {list(p.grad_batch.shape)}, batch_l2 {list(p.batch_l2.shape)}")
print("each grad_batch sums to .grad, and batch_l2 is its squared norm")
print(ctx.explain())

# %%
# A sample's squared gradient norm over the whole model is the sum of its
# ``batch_l2`` over the parameters. Sorted, the mislabelled samples come first.

norms = sum(p.batch_l2 for p in model.parameters()).sqrt() * N  # per sample, of its own loss
order = norms.argsort(descending=True)
is_wrong = torch.zeros(N, dtype=torch.bool)
is_wrong[wrong] = True
print(f"mislabelled samples among the {WRONG} largest gradient norms: {int(is_wrong[order[:WRONG]].sum())} of {WRONG}")

from matplotlib import pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

fig, ax = plt.subplots(figsize=(8, 3.5), layout="constrained")
colors = ["tab:red" if is_wrong[i] else "tab:blue" for i in order]
ax.bar(range(N), norms[order], color=colors)
ax.set(xlabel="samples, by gradient norm", ylabel="‖per-sample gradient‖", title=f"{N} samples after {STEPS} steps")
ax.legend(handles=[Patch(color="tab:red", label="mislabelled"), Patch(color="tab:blue", label="labelled right")])
