"""Curvature: the GGN diagonal and KFAC
=====================================

The second-order extensions fill BackPACK's attributes in the same backward pass:
``DiagGGNExact`` gives the diagonal of the generalized Gauss-Newton matrix
``G = Σ_n J_nᵀ H_n J_n`` (``J_n`` the Jacobian of sample ``n``'s output with respect to
the parameters, ``H_n`` the loss's Hessian with respect to that output) as
``param.diag_ggn_exact``; ``KFLR`` (exact factors) and ``KFAC`` (Monte-Carlo factors)
give ``param.kflr`` / ``param.kfac`` = ``[G, A]``, whose Kronecker product ``G ⊗ A``
approximates the GGN's block of a weight (``vec`` row-major).

This example computes them on a small MLP in float64, builds the exact GGN with
``torch.func`` (one Jacobian per sample), and compares: the diagonal is exact; the
Kronecker factors are an approximation, whose error the example prints per layer.

Run: ``python examples/plot_curvature.py`` (``JACMEM_QUICK=1`` for a small run).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

import jacmem

QUICK = os.environ.get("JACMEM_QUICK") == "1"
N = 16 if QUICK else 64
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 4)).double()
lossfunc = nn.CrossEntropyLoss()
X, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 4, (N,))

# %%
# One backward pass gives all three (each extension's results, under its own name).

with jacmem.extend(jacmem.DiagGGNExact(), jacmem.KFLR(), jacmem.KFAC(mc_samples=16)):
    lossfunc(model(X), y).backward()
for name, p in model.named_parameters():
    shapes = ", ".join(str(tuple(f.shape)) for f in p.kflr)
    print(f"{name:<9} diag_ggn_exact {tuple(p.diag_ggn_exact.shape)}, kflr [{shapes}]")

# %%
# The exact GGN, independently: ``J_n`` by ``torch.func.jacrev`` per sample, ``H_n`` by
# ``torch.func.hessian`` of the loss (with the batch mean's ``1/N``).

params = {n: p.detach() for n, p in model.named_parameters()}
sizes = [p.numel() for p in params.values()]


def output(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One sample's logits as a function of all parameters, flattened: [P] -> [4]."""
    chunks = dict(zip(params, (c.view_as(p) for c, p in zip(flat.split(sizes), params.values()))))
    return functional_call(model, chunks, (x[None],))[0]


flat = torch.cat([p.flatten() for p in params.values()])
ggn = torch.zeros(len(flat), len(flat), dtype=torch.float64)
for x_n, y_n in zip(X, y):
    J = jacrev(output)(flat, x_n)  # [4, P]
    H = hessian(lambda z: lossfunc(z[None], y_n[None]) / N)(output(flat, x_n))  # [4, 4]
    ggn += J.T @ H @ J
blocks = dict(zip(params, (b for b in ggn.diagonal().split(sizes))))
for name, p in model.named_parameters():
    torch.testing.assert_close(p.diag_ggn_exact, blocks[name].view_as(p))
print("diag_ggn_exact equals the diagonal of the GGN built with torch.func")

# %%
# How close is ``G ⊗ A`` to the exact block of each weight? (relative Frobenius error)

start = 0
errors = {}
for name, p in model.named_parameters():
    stop = start + p.numel()
    exact = ggn[start:stop, start:stop]
    if p.dim() == 2:
        for field in ("kflr", "kfac"):
            G, A = getattr(p, field)
            errors[(name, field)] = float((torch.kron(G, A) - exact).norm() / exact.norm())
        print(f"{name:<9} KFLR {errors[(name, 'kflr')]:.3f}, KFAC (16 samples) {errors[(name, 'kfac')]:.3f}")
    start = stop

# %%
# The block of the middle layer's weight: exact, KFLR and KFAC, and the diagonal of
# every parameter, jacmem's against torch.func's.

from matplotlib import pyplot as plt  # noqa: E402

offset = sizes[0] + sizes[1]
weight = model[2].weight
exact = ggn[offset : offset + weight.numel(), offset : offset + weight.numel()]
panels = {"exact GGN block": exact, "KFLR: G ⊗ A": torch.kron(*weight.kflr), "KFAC: G ⊗ A": torch.kron(*weight.kfac)}
fig, axes = plt.subplots(1, 3, figsize=(12, 4.2), sharey=True, layout="constrained")
scale = float(exact.abs().max())
for ax, (title, block) in zip(axes, panels.items()):
    image = ax.imshow(block, cmap="RdBu_r", vmin=-scale, vmax=scale)
    ax.set(title=title, xlabel="parameter index")
axes[0].set_ylabel("parameter index")
fig.colorbar(image, ax=axes, shrink=0.8)
fig.suptitle(f"the GGN block of 2.weight ({weight.numel()} parameters)")

fig, ax = plt.subplots(figsize=(5.5, 4.5), layout="constrained")
for name, p in model.named_parameters():
    ax.loglog(blocks[name], p.diag_ggn_exact.flatten().detach(), ".", label=name)
ax.axline((1e-6, 1e-6), (1.0, 1.0), color="k", lw=0.5)
ax.set(title="diagonal of the GGN", xlabel="torch.func", ylabel="jacmem: diag_ggn_exact")
ax.legend(fontsize=8)
