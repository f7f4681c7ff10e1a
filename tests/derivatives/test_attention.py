"""nn.MultiheadAttention against a per-sample autograd loop, float64.

Every case runs every strategy the registry offers (enumerated; the model tests run
``"auto"``): each of
BatchGrad, BatchL2Grad, SumGradSquared and Variance alone, then all four together in
both flows (forward inside ``jacmem.extend``; ``jacmem.track`` before the block) and
with ``chunk_bytes=1`` (one sample per chunk).

The cases cover: packed and separate (``kdim``/``vdim``) in-projections, ``bias=False``,
``add_bias_kv``, ``add_zero_attn``, ``batch_first`` both ways, ``key_padding_mask`` (bool
and float), ``attn_mask`` 2-D (shared) and 3-D (per sample and head), ``is_causal``,
``need_weights`` False, the attention weights used by the loss (averaged and per head),
and frozen in-projections (only ``out_proj`` trainable). ``out_proj.weight`` and
``out_proj.bias`` are parameters of the submodule ``out_proj``, which MultiheadAttention
calls functionally: the checks cover them as every other parameter.

BackPACK 1.7.1 has no MultiheadAttention (its ``extend`` leaves the module without
first-order support, and its extensions raise or skip it), so there is no BackPACK
comparison here; ``test_backpack_cannot_answer`` shows it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.support.reference import (
    FIRST_ORDER,
    FIRST_ORDER_RUNS,
    FLOWS,
    check_against,
    check_dropout_raises_then_eval_works,
    mse,
    per_sample_grads,
    run_jacmem,
)
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY

N, L, S, E, HEADS = 3, 4, 5, 6, 2


class Attend(nn.Module):
    """x [N, L+S, E] (batch first) -> [N, 2]. Queries are the first L steps; keys and
    values come from the last S through Linears (to ``kdim``/``vdim``). Masks are
    functions of x, so that each sample alone gets its own mask."""

    def __init__(self, mha: nn.MultiheadAttention, mask: str = "", use_weights: bool = False, frozen_in: bool = False):
        super().__init__()
        self.mha, self.mask, self.use_weights = mha, mask, use_weights
        self.key = nn.Linear(E, mha.kdim)
        self.value = nn.Linear(E, mha.vdim)
        self.head = nn.Linear(E, 2)
        if frozen_in:
            for name, p in mha.named_parameters():
                p.requires_grad_(name.startswith("out_proj"))

    def masks(self, x) -> dict:
        q, kv = x[:, :L], x[:, L:]
        out = {}
        if "kpm" in self.mask:
            kpm = kv[..., 0] > 0.3
            kpm[:, 0] = False  # never every key
            out["key_padding_mask"] = kpm if "bool" in self.mask else kpm.double() * -2.0
        if "2d" in self.mask:
            out["attn_mask"] = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=2)
        if "3d" in self.mask:  # [N·H, L, S], per sample and head
            m = torch.einsum("nle,nse->nls", q, kv).tanh()
            out["attn_mask"] = torch.stack([m, -m], 1).flatten(0, 1)
        if "causal" in self.mask:
            out["attn_mask"] = torch.full((L, S), float("-inf"), dtype=torch.float64).triu(1)
            out["is_causal"] = True
        return out

    def forward(self, x):
        q, k, v = x[:, :L], self.key(x[:, L:]), self.value(x[:, L:])
        if not self.mha.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out, weights = self.mha(q, k, v, need_weights=self.use_weights != "none", **self.masks(x), **self._avg())
        out = out if self.mha.batch_first else out.transpose(0, 1)
        y = self.head(torch.tanh(out + x[:, :L]).mean(1))  # a residual connection
        if self.use_weights in ("avg", "heads"):
            y = y + weights.flatten(1)[:, :2] * 3
        return y

    def _avg(self):
        return {"average_attn_weights": False} if self.use_weights == "heads" else {}


#: id -> (MultiheadAttention keyword arguments, mask, use of the weights, frozen in-projection)
CASES: dict[str, tuple] = {
    "packed-bf": (dict(batch_first=True), "", "unused", False),
    "packed-sf-nobias-no-weights": (dict(bias=False), "", "none", False),
    "kvdim-bf-bias-kv": (dict(kdim=4, vdim=3, batch_first=True, add_bias_kv=True), "kpm-bool", "avg", False),
    "kvdim-sf-zero-attn": (dict(kdim=5, vdim=7, add_zero_attn=True), "2d", "heads", False),
    "packed-bf-kpm-float-3d": (
        dict(batch_first=True, add_bias_kv=True, add_zero_attn=True),
        "kpm-float 3d",
        "avg",
        False,
    ),
    "packed-sf-causal": (dict(), "causal", "none", False),
    "packed-bf-3d-heads": (dict(batch_first=True), "3d", "heads", False),
    "out-proj-only": (dict(batch_first=True, kdim=4, vdim=4), "kpm-bool", "avg", True),
}

_CACHE: dict = {}


def case(case_id: str):
    if case_id not in _CACHE:
        torch.manual_seed(sum(map(ord, case_id)))
        kwargs, mask, use, frozen = CASES[case_id]
        model = Attend(nn.MultiheadAttention(E, HEADS, **kwargs), mask, use, frozen).double()
        X = torch.randn(N, L + S, E, dtype=torch.float64)
        y = torch.randn(N, 2, dtype=torch.float64)
        reduction = ("mean", "sum")[len(case_id) % 2]
        _CACHE[case_id] = (model, X, y, reduction, per_sample_grads(model, X, y, mse, reduction))
    return _CACHE[case_id]


STRATEGIES = sorted(REGISTRY[nn.MultiheadAttention].names())
GRID = [(c, s) for c in CASES for s in STRATEGIES]


@pytest.mark.parametrize("case_id,strategy", GRID, ids=[f"{c}-{s}" for c, s in GRID])
def test_attention(case_id, strategy):
    model, X, y, reduction, reference = case(case_id)
    assert any(n.startswith("mha.out_proj") for p in reference for n, q in model.named_parameters() if q is p)
    for fields, flow, kwargs in FIRST_ORDER_RUNS:
        ctx = run_jacmem(
            model,
            X,
            y,
            mse,
            reduction,
            [FIRST_ORDER[f]() for f in fields],
            flow,
            strategy=strategy,
            strict=True,
            **kwargs,
        )
        check_against(model, reference, fields, f"[{case_id} {strategy} {'+'.join(fields)} {flow} {kwargs}]")
        mha = [d for d in ctx.plan.decisions.values() if d.module == "mha"]
        assert {d.param for d in mha} >= {"out_proj.weight"} and all(d.chosen == strategy for d in mha), ctx.explain()


def test_dropout_in_training_mode_raises_and_eval_works():
    torch.manual_seed(5)
    model = Attend(nn.MultiheadAttention(E, HEADS, dropout=0.3, batch_first=True)).double()
    X, y = torch.randn(N, L + S, E, dtype=torch.float64), torch.randn(N, 2, dtype=torch.float64)
    check_dropout_raises_then_eval_works(model, X, y, r"'mha'.*dropout=0.3.*eval")


class Block(nn.Module):
    """A small transformer-style block between a Conv1d and a Linear: x [N, C, T] -> [N, 2]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, E, 3, padding=1)
        self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(E, 8), nn.GELU(), nn.Linear(8, E))
        self.head = nn.Linear(E, 2)

    def forward(self, x):
        z = self.conv(x).transpose(1, 2)  # [N, T, E]
        z = z + self.mha(z, z, z, need_weights=False)[0]
        z = z + self.mlp(z)
        return self.head(z.mean(1))


def test_model_with_conv_linear_and_residual():
    torch.manual_seed(6)
    model = Block().double()
    X, y = torch.randn(4, 3, 5, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse, "mean")
    for flow in FLOWS:
        run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], flow, strict=True)
        check_against(model, reference, FIRST_ORDER, f"[block {flow}]")


class Encoder(nn.Module):
    """Two stock TransformerEncoderLayers (batch first: jacmem's Linear and LayerNorm take
    axis 0 as the batch), a causal mask, a float key padding mask: x [N, T, E] -> [N, 2]."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 2)

    def forward(self, x):
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        padding = (x[..., 0] > 1.0).to(x.dtype) * -1e9
        padding[:, 0] = 0.0
        return self.head(self.encoder(x, mask=causal, src_key_padding_mask=padding, is_causal=True).mean(1))


def test_transformer_encoder():
    torch.manual_seed(7)
    model = Encoder().double()
    X, y = torch.randn(4, 5, E, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse, "mean")
    for flow in FLOWS:
        run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], flow, strict=True)
        check_against(model, reference, FIRST_ORDER, f"[encoder {flow}]")


class Tied(nn.Module):
    """out_proj's weight is also a Linear's: two records contribute to one parameter."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.proj = nn.Linear(E, E)
        self.proj.weight = self.mha.out_proj.weight

    def forward(self, x):
        return self.proj(self.mha(x, x, x)[0]).mean(1)


def test_out_proj_weight_tied_to_a_linear():
    torch.manual_seed(8)
    model = Tied().double()
    X, y = torch.randn(4, L, E, dtype=torch.float64), torch.randn(4, E, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse, "mean")
    for flow in FLOWS:
        run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], flow, strict=True)
        check_against(model, reference, FIRST_ORDER, f"[tied {flow}]")


def test_unbatched_input_raises():
    mha = nn.MultiheadAttention(E, HEADS).double()
    q = torch.randn(L, E, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"MultiheadAttention.*unbatched"):
        with jacmem.extend(jacmem.BatchGrad()):
            mha(q, q, q)[0].sum().backward()


def test_backpack_cannot_answer():
    """BackPACK 1.7.1 has no derivative for MultiheadAttention: with its extension active,
    its parameters get no grad_batch (it warns, or raises in strict mode)."""
    from backpack import backpack, extend, extensions

    mha = extend(nn.MultiheadAttention(E, HEADS, batch_first=True).double())
    q = torch.randn(N, L, E, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with backpack(extensions.BatchGrad()):
                mha(q, q, q)[0].sum().backward()
        except NotImplementedError:
            return
    assert not any(hasattr(p, "grad_batch") for p in mha.parameters())
