"""Lean transformer layers against the stock ones, in float64: LayerNorm and RMSNorm
(keeping their output where the next layer keeps it), GELU/SiLU feeding a Linear (the
Linear keeps the activation's input, not its output), frozen Linear and Embedding, a
LoRA adapter, and attention keeping q, k, v, the row log-sum-exp and a seed."""

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from jacmem.memory import lean, report, unlean
from jacmem.memory.transformer import AttentionFunction

pytestmark = pytest.mark.usefixtures("float64_default")

RTOL, ATOL = 1e-10, 1e-12


def _saved(fn, *inputs):
    return report(fn, *inputs).saved_bytes


def _run(model, x, names):
    """Output and gradients of ``sum(out * w)``, with ``names`` (parameter names and
    "input") requiring a gradient."""
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
        p.grad = None
    x = x.clone().requires_grad_("input" in names)
    out = model(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    grads = {"input": x.grad} if "input" in names else {}
    grads.update({n: p.grad for n, p in model.named_parameters() if n in names})
    return out.detach(), grads


def _compare_every_pattern(stock, x, rounds=2):
    """lean(copy) against ``stock`` for every non-empty set of {input, parameters}
    requiring a gradient, each twice (lean layers learn their readers in the first pass)."""
    leaned = lean(copy.deepcopy(stock))
    names = ["input"] + [n for n, _ in stock.named_parameters()]
    for r in range(1, len(names) + 1):
        for pattern in itertools.combinations(names, r):
            for _ in range(rounds):
                out_s, grads_s = _run(stock, x, pattern)
                out_l, grads_l = _run(leaned, x, pattern)
                torch.testing.assert_close(out_l, out_s, rtol=0, atol=0)
                assert grads_l.keys() == grads_s.keys()
                for n in grads_s:
                    torch.testing.assert_close(grads_l[n], grads_s[n], rtol=RTOL, atol=ATOL, msg=f"{pattern} {n}")
    return leaned


def _randomised(norm):
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5) if p.dim() and p is norm.weight else p.uniform_(-0.5, 0.5)
    return norm


NORMS = [
    ("ln", lambda: nn.LayerNorm(6), (3, 4, 6)),
    ("ln 2d", lambda: nn.LayerNorm((3, 4)), (2, 3, 4)),
    ("ln no bias", lambda: nn.LayerNorm(6, bias=False), (5, 6)),
    ("ln no affine", lambda: nn.LayerNorm(6, elementwise_affine=False), (3, 4, 6)),
    ("rms", lambda: nn.RMSNorm(6), (3, 4, 6)),
    ("rms eps", lambda: nn.RMSNorm((3, 4), eps=1e-3), (2, 3, 4)),
    ("rms no affine", lambda: nn.RMSNorm(6, elementwise_affine=False), (3, 4, 6)),
]


class NormThen(nn.Module):
    """norm -> Linear, and the norm's output also on a residual path (post-norm style)."""

    def __init__(self, norm, d):
        super().__init__()
        self.norm, self.fc = norm, nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x * 1)
        return self.fc(h) + h


@pytest.mark.parametrize("make,shape", [n[1:] for n in NORMS], ids=[n[0] for n in NORMS])
def test_norms_match_stock_every_pattern(make, shape):
    norm = _randomised(make())
    flat = nn.Flatten(-len(norm.normalized_shape)) if len(norm.normalized_shape) > 1 else nn.Identity()
    d = shape[-1] if len(norm.normalized_shape) == 1 else shape[-1] * shape[-2]
    stock = nn.Sequential(norm, flat, nn.Linear(d, d)) if len(norm.normalized_shape) > 1 else NormThen(norm, d)
    _compare_every_pattern(stock, torch.randn(shape))


@pytest.mark.parametrize("rms", [False, True])
def test_norm_keeps_output_where_the_linear_keeps_it(rms):
    """Trainable Linear after the norm: lean keeps the norm's output once (the Linear's
    input) and a rstd per row; stock keeps the input too (RMSNorm: and x̂)."""
    d, rows = 16, 12
    stock = NormThen(_randomised(nn.RMSNorm(d) if rms else nn.LayerNorm(d)), d)
    leaned = lean(copy.deepcopy(stock))
    x = torch.randn(3, 4, d, requires_grad=True)
    fn_s, fn_l = (lambda t: stock(t).tanh()), (lambda t: leaned(t).tanh())
    fn_l(x)  # the first pass learns the readers
    act = rows * d * 8
    # tanh's result is the output (kept anyway); the norm's input is x * 1
    assert _saved(fn_s, x) == (3 if rms else 2) * act + (1 if rms else 2) * rows * 8
    assert _saved(fn_l, x) == act + rows * 8
    leaned.fc.weight.requires_grad_(False)  # nobody keeps the output: keep the input (and rstd)
    assert _saved(fn_l, x) == act + rows * 8 * (1 if rms else 2)
    assert type(unlean(leaned).norm) in (nn.LayerNorm, nn.RMSNorm)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_with_a_zero_weight_keeps_its_input(rms):
    """x̂ cannot be rebuilt from the output where a weight entry is 0: the input is kept
    (LayerNorm: the stock op), and the gradients are stock's."""
    stock = NormThen(_randomised(nn.RMSNorm(6) if rms else nn.LayerNorm(6)), 6)
    with torch.no_grad():
        stock.norm.weight[2] = 0
    leaned = _compare_every_pattern(stock, torch.randn(4, 6))
    x = torch.randn(4, 6, requires_grad=True)
    slots = {(t.op, t.slot) for t in report(leaned, x, lean=False).tensors}
    if rms:
        assert ("NormFunctionBackward", "saved_tensors[0]") in slots  # keep="input": x * 1
    else:
        assert ("NativeLayerNormBackward0", "input") in slots


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU("tanh"), nn.SiLU()], ids=["gelu", "gelu-tanh", "silu"])
def test_activation_then_linear(act):
    """GELU/SiLU -> Linear: outputs and gradients as stock's; with the Linear trainable,
    the activation's output is not kept (the Linear recomputes it from the input that
    the activation keeps)."""
    stock = nn.Sequential(nn.Linear(5, 8), act, nn.Linear(8, 3))
    x = torch.randn(2, 4, 5)
    leaned = _compare_every_pattern(stock, x)
    for m in (stock, leaned):
        m.requires_grad_(True)
    xs = x.clone().requires_grad_()
    hidden = 2 * 4 * 8 * 8
    assert _saved(lambda t: stock(t).exp(), xs) == 2 * hidden  # exp's result: the output, kept anyway
    assert _saved(lambda t: leaned(t).exp(), xs) == hidden


def test_activation_changed_in_place_is_not_recomputed():
    """An activation output changed in place before the Linear reads it: the Linear keeps
    its input as stock does (recomputing would give the old values)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.act, self.fc = nn.GELU(), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.act(x * 1).mul_(2))

    stock = M()
    _compare_every_pattern(stock, torch.randn(3, 4), rounds=1)


def test_frozen_linear_and_embedding_keep_no_input():
    """With a frozen weight, stock Linear and Embedding already keep nothing of their
    input (Linear: its weight, by reference); lean keeps it so."""
    emb, fc = nn.Embedding(10, 6).requires_grad_(False), nn.Linear(6, 6).requires_grad_(False)
    ids = torch.randint(0, 10, (3, 5))
    for model in (nn.Sequential(emb, fc), lean(nn.Sequential(copy.deepcopy(emb), copy.deepcopy(fc)))):
        x = torch.randn(3, 5, 6, requires_grad=True)
        assert _saved(lambda t: model[1](t * 1).exp().sum(), x) == 3 * 5 * 6 * 8  # exp's result only
        assert report(lambda i: model(i), ids).saved_bytes == 0


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank pair: ``base(x) + B(A(x)) · scale``."""

    def __init__(self, d_in, d_out, rank):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.A, self.B = nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.B.weight)
        self.scale = 0.5

    def forward(self, x):
        return self.base(x) + self.B(self.A(x)) * self.scale


class LoRABlock(nn.Module):
    """Pre-norm: x + LoRA(LN(x)), frozen norm."""

    def __init__(self, d, rank):
        super().__init__()
        self.norm, self.lora = _randomised(nn.LayerNorm(d)).requires_grad_(False), LoRALinear(d, d, rank)

    def forward(self, x):
        return x + self.lora(self.norm(x))


def test_lora_keeps_only_the_low_rank_path():
    d, r, rows = 16, 2, 12
    stock = LoRABlock(d, r)
    x = torch.randn(3, 4, d)
    _compare_every_pattern(stock, x)
    leaned = lean(copy.deepcopy(stock))
    for m in (stock, leaned):
        m.requires_grad_(False)
        m.lora.A.requires_grad_(True)
        m.lora.B.requires_grad_(True)
    xs = x.clone().requires_grad_()
    fn_s, fn_l = (lambda t: stock(t * 1).sum()), (lambda t: leaned(t * 1).sum())
    fn_l(xs)
    # stock: the norm's input (x * 1), mean and rstd, its output (A's input), A's output (B's input)
    assert _saved(fn_s, xs) == 2 * rows * d * 8 + 2 * rows * 8 + rows * r * 8
    # lean: the norm's output (A's input) and rstd, A's output
    assert _saved(fn_l, xs) == rows * d * 8 + rows * 8 + rows * r * 8


# -- attention -----------------------------------------------------------------------------


def _qkv(b=2, h=3, t=5, s=6, e=4, ev=4):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(b, h, t, e, generator=g),
        torch.randn(b, h, s, e, generator=g),
        torch.randn(b, h, s, ev, generator=g),
    )


MASKS = {
    "none": lambda t, s: None,
    "bool": lambda t, s: torch.rand(t, s, generator=torch.Generator().manual_seed(2)) > 0.3,
    "float": lambda t, s: torch.randn(2, 1, t, s, generator=torch.Generator().manual_seed(3)),
    "row masked": lambda t, s: torch.arange(t).view(t, 1).expand(t, s) > 0,  # row 0 attends nowhere
}


@pytest.mark.parametrize(
    "mask, causal",
    [(m, False) for m in MASKS] + [("none", True)],  # SDPA takes a mask or is_causal
)
def test_attention_matches_sdpa(mask, causal):
    q, k, v = _qkv()
    m = MASKS[mask](5, 6)
    for names in itertools.chain.from_iterable(itertools.combinations("qkv", r) for r in (1, 2, 3)):
        ins = [t.clone().requires_grad_(n in names) for n, t in zip("qkv", (q, k, v))]
        ref = [t.clone().requires_grad_(n in names) for n, t in zip("qkv", (q, k, v))]
        out = AttentionFunction.apply(*ins, m, 0.0, 0.7, causal)
        exp = F.scaled_dot_product_attention(*ref, attn_mask=m, is_causal=causal, scale=0.7)
        if mask == "row masked":  # stock's math path gives NaN there; this gives 0
            exp = torch.nan_to_num(exp)
        torch.testing.assert_close(out, exp, rtol=RTOL, atol=ATOL)
        g = torch.randn(out.shape)
        (out * g).sum().backward()
        (exp * g).sum().backward()
        for a, b in zip(ins, ref):
            if b.requires_grad:
                torch.testing.assert_close(a.grad, torch.nan_to_num(b.grad), rtol=RTOL, atol=ATOL)


def test_attention_dropout_gradient_and_memory():
    """With dropout, the mask is drawn again from its seed: the gradient equals the
    autograd gradient of the same computation with that mask (read off the output with
    v = identity), and only q, k, v and the row log-sum-exp are kept."""
    torch.manual_seed(5)
    q, k, _ = _qkv(t=6, s=6)
    v = torch.eye(6).expand(2, 3, 6, 6).clone()
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out = AttentionFunction.apply(q, k, v, None, 0.4, 0.5, False)
    dropped = out.detach()  # P · D / (1 - p), since v = I
    keep = (dropped != 0).double() / 0.6
    assert 0.4 < (dropped != 0).double().mean() < 0.8
    g = torch.randn(out.shape)
    (out * g).sum().backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    probs = torch.softmax(qr @ kr.transpose(-1, -2) * 0.5, -1)
    torch.testing.assert_close(probs.detach() * keep, dropped, rtol=RTOL, atol=ATOL)
    ((probs * keep) @ vr * g).sum().backward()
    for a, b in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)
    qkv_bytes = 3 * 2 * 3 * 6 * 6 * 8
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    kept = _saved(lambda t: AttentionFunction.apply(t * 1, t * 2, t * 3, None, 0.4, 0.5, False).sum(), x)
    assert kept == qkv_bytes + 2 * 3 * 6 * 8


def test_hf_bert_lean_matches_stock():
    """A tiny HF BERT in train mode without dropout, lean against stock, all trainable and
    norms only: same outputs and gradients; lean switches the attention and back."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    stock = transformers.BertModel(cfg).double().train()
    leaned = lean(copy.deepcopy(stock))
    assert leaned.config._attn_implementation == "jacmem_lean"
    ids = torch.randint(0, 50, (2, 7))
    for setting in ("all", "norm"):
        grads = []
        for model in (stock, leaned):
            for _ in range(2):
                for n, p in model.named_parameters():
                    p.requires_grad_(setting == "all" or "LayerNorm" in n)
                    p.grad = None
                out = model(ids).last_hidden_state
                (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        for n in grads[0]:
            torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-9, atol=1e-12, msg=n)
    assert unlean(leaned).config._attn_implementation == "sdpa"


def test_hf_bert_lean_with_dropout_runs_attention_function():
    """Train mode with dropout: the attention runs AttentionFunction (its node is in the
    graph), backward gives finite gradients for every parameter, and the attention
    modules keep less than stock's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    stock = transformers.BertModel(cfg, add_pooling_layer=False).double().train()
    leaned = lean(copy.deepcopy(stock))
    ids = torch.randint(0, 50, (2, 7))
    leaned(ids)
    r = report(leaned, ids, lean=False)
    assert any(t.op == "AttentionFunctionBackward" for t in r.tensors)
    leaned(ids).last_hidden_state.pow(2).sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in leaned.encoder.parameters())
    name = "encoder.layer.0.attention.self"
    kept = {m.name: m.bytes for m in r.modules}[name]
    assert kept < {m.name: m.bytes for m in report(stock, ids, lean=False).modules}[name]


def test_extend_batch_grad_through_lean_norm_and_activation_linear():
    """jacmem.extend(BatchGrad()) on lean LayerNorm -> Linear -> GELU -> Linear equals it
    on the stock model (the Linear after the GELU keeps the GELU's input, not its output)."""
    import jacmem

    torch.manual_seed(0)
    stock = nn.Sequential(_randomised(nn.LayerNorm(6)), nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    leaned = lean(copy.deepcopy(stock))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    grads = []
    for model in (stock, leaned):
        for _ in range(2):  # the second pass: lean layers know their readers
            for p in model.parameters():
                p.grad = None
            with jacmem.extend(jacmem.BatchGrad()):
                F.cross_entropy(model(x), y).backward()
        grads.append({n: p.grad_batch for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-9, atol=1e-12, msg=n)
