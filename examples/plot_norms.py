"""Norms: ghost against materialised
===================================

``BatchL2Grad`` gives each sample's squared gradient norm, ``batch_l2 [N]``, which is
what clipping in private training needs. There are two ways to get it:

* **materialised**: form each sample's gradient (``outer`` for a Linear, ``unfold``
  for a convolution), then square and sum it. Its buffer has the per-sample gradients'
  size, ``N · O · I`` for a Linear.
* **ghost** (Goodfellow, 2015; Li et al., 2022): ``‖Gᵀ X‖² = ⟨X Xᵀ, G Gᵀ⟩`` per sample,
  from the layer's input ``X [T, I]`` and output gradient ``G [T, O]``, never forming
  the gradient: ``N · T²`` numbers instead of ``N · O · I``. It wins while ``T² < O · I``.

``auto`` chooses per layer from its cost model, and ``ctx.explain()`` says which it
chose and why. The model here is a stack of Linear layers on sequences (``[N, T, 512]``,
as in a transformer's MLP), with a convolution in front; every setting runs in this
process, and its results are checked against the others.

Run: ``python examples/plot_norms.py`` (``JACMEM_QUICK=1``, as the docs build runs it: batch
64 instead of 128, five rounds instead of seven).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

import jacmem
from jacmem.memory import peak_memory

MiB = 2**20
QUICK = os.environ.get("JACMEM_QUICK") == "1"
# quick: the smallest sizes at which the strategies' costs, not Python's overhead, set the time
N, T, WIDTH, REPEATS = (64, 16, 512, 5) if QUICK else (128, 16, 512, 7)
SETTINGS = {
    "materialised": {nn.Linear: "outer", nn.Conv1d: "unfold"},
    "ghost": {nn.Linear: "ghost", nn.Conv1d: "ghost"},
    "auto": "auto",
}


class Tokens(nn.Module):
    """``[N, C, T] -> [N, T, C]``"""

    def forward(self, x):
        return x.transpose(1, 2)


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A Conv1d, then three Linear layers on ``[N, T, WIDTH]``; inputs and targets."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(8, WIDTH, 3, padding=1),
        Tokens(),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, 10),
    )
    return model, torch.randn(N, 8, T), torch.randint(0, 10, (N, T))


def step(model, X, y, strategy):
    """One forward+backward computing ``batch_l2`` under ``strategy``: its context."""
    model.zero_grad(set_to_none=True)
    with jacmem.extend(jacmem.BatchL2Grad(), strategy=strategy) as ctx:
        logits = model(X)
        nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    return ctx


# %%
# Run each setting, time it, and measure its peak memory. The settings take turns, one
# step each per round, so that whatever else the machine does slows them alike. Each
# setting's ``batch_l2`` must equal the others'.

model, X, y = build()
results, norms, times = {}, {}, {name: [] for name in SETTINGS}
for name, strategy in SETTINGS.items():
    ctx = step(model, X, y, strategy)  # warm-up
    peak = peak_memory(lambda: step(model, X, y, strategy))
    norms[name] = {n: p.batch_l2.clone() for n, p in model.named_parameters()}
    results[name] = dict(peak=peak / MiB, explain=ctx.explain())
for _ in range(REPEATS):
    for name, strategy in SETTINGS.items():
        start = time.perf_counter()
        step(model, X, y, strategy)
        times[name].append(time.perf_counter() - start)
for name in SETTINGS:
    results[name]["time"] = statistics.median(times[name])

for name in SETTINGS:
    for param, value in norms[name].items():
        torch.testing.assert_close(value, norms["materialised"][param], rtol=1e-4, atol=1e-6)
grad_bytes = N * sum(p.numel() for p in model.parameters()) * 4
print(f"N={N}, T={T}, width {WIDTH}; the per-sample gradients would take {grad_bytes / MiB:.1f} MiB")
print(f"{'setting':<14}{'time (ms)':>10}{'peak (MiB)':>12}")
for name, r in results.items():
    print(f"{name:<14}{r['time'] * 1e3:>10.1f}{r['peak']:>12.1f}")
print("every setting gives the same batch_l2")

# %%
# What ``auto`` chose, and why: for each parameter, the strategy and the cost model's
# estimates of the candidates.

print(results["auto"]["explain"])

# %%
# And under ``ghost``, where the convolution and the Linear layers take the ghost norm.

print(results["ghost"]["explain"])

# %%
# Time and peak memory per setting. Memory is the peak above what was in use before
# the step (:func:`jacmem.memory.peak_memory`), in this process.

from matplotlib import pyplot as plt  # noqa: E402

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
names = list(results)
left.bar(names, [results[n]["time"] * 1e3 for n in names], color=["C0", "C2", "C3"])
left.set(xlabel="strategy", ylabel="forward + backward (ms, median)", title="time")
right.bar(names, [results[n]["peak"] for n in names], color=["C0", "C2", "C3"])
right.axhline(grad_bytes / MiB, color="k", ls="--", lw=1, label="size of the per-sample gradients")
right.set_ylim(0, 1.35 * max(grad_bytes / MiB, *(results[n]["peak"] for n in names)))
right.set(xlabel="strategy", ylabel="peak memory of the step (MiB)", title="memory")
right.legend(loc="upper left", fontsize=8)
fig.suptitle(f"BatchL2Grad, batch {N}, sequences of {T}")
fig.tight_layout()
