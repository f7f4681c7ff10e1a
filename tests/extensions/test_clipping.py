"""ClipGrad: ``.grad`` after one backward pass is the sum of the clipped per-sample
gradients, against a per-sample autograd loop (``reference.per_sample_grads``), in float64.

The reference's per-sample gradients sum to the batch loss's gradient, so with
``reduction="mean"`` they carry the mean's ``1/N``: the gradient of sample ``n``'s own
loss term is ``N`` times theirs (as Opacus defines it). :func:`expected` clips them with
the formulas of the ClipGrad docstring, written out here again.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.support.clipping import assert_grads, expected, median_norm, norms, per_sample
from tests.support.distributed import needs_gloo, run_ranks
from tests.support.host_reads import backward_reads
from tests.support.privacy import loader, private
from tests.support.reference import cross_entropy, trainable
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import jacmem
import jacmem.engine.clipping
from jacmem.extensions.clipping import check
from jacmem.privacy import PrivacyEngine

DT = torch.float64
N = 5


def run(model, X, y, loss, ext, reduction="mean", flow="inside"):
    """One backward pass inside a ClipGrad block."""
    if flow == "track":
        jacmem.track(model)
        try:
            value = loss(model(X), y, reduction)
            with jacmem.extend(ext):
                value.backward()
        finally:
            jacmem.untrack(model)
        return
    with jacmem.extend(ext):
        loss(model(X), y, reduction).backward()


# -- layer families ------------------------------------------------------------------


class Attention(nn.Module):
    """Self-attention, [N, T, D] -> [N, T, D]."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Recurrent(nn.Module):
    """[N, T, F] -> [N, T, H], the output sequence of an RNN or LSTM."""

    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(4, 3, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class Bilinear(nn.Module):
    """A module no derivative is registered for: the generic (vmap) fallback."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.tanh(x @ self.w) * x


def seq(*layers):
    return nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(3))


FAMILIES = {
    "linear_sequence": (lambda: seq(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)), (N, 3, 4)),
    "conv1d": (lambda: seq(nn.Conv1d(2, 3, 3), nn.ReLU()), (N, 2, 7)),
    "conv2d": (lambda: seq(nn.Conv2d(2, 3, 3, stride=2), nn.ReLU()), (N, 2, 6, 6)),
    "conv3d": (lambda: seq(nn.Conv3d(2, 2, 2)), (N, 2, 3, 3, 3)),
    "conv_transpose2d": (lambda: seq(nn.ConvTranspose2d(2, 2, 3, stride=2)), (N, 2, 3, 3)),
    "layernorm": (lambda: seq(nn.Linear(4, 6), nn.LayerNorm(6)), (N, 3, 4)),
    "groupnorm": (lambda: seq(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)), (N, 2, 5, 5)),
    "rmsnorm": (lambda: seq(nn.Linear(4, 6), nn.RMSNorm(6)), (N, 3, 4)),
    "attention": (lambda: seq(Attention()), (N, 3, 4)),
    "rnn": (lambda: seq(Recurrent(nn.RNN)), (N, 3, 4)),
    "lstm": (lambda: seq(Recurrent(nn.LSTM)), (N, 3, 4)),
    "generic_fallback": (lambda: seq(Bilinear(), nn.Linear(4, 2)), (N, 3, 4)),
    "embedding": (lambda: seq(nn.Embedding(11, 4), nn.Linear(4, 2)), None),
}


def family(name: str, seed: int = 0):
    torch.manual_seed(seed)
    make, shape = FAMILIES[name]
    model = make()
    X = torch.randint(0, 11, (N, 3)) if shape is None else torch.randn(shape)
    model(X)  # the lazy layer's shape
    model = model.to(DT)
    return model, (X if shape is None else X.to(DT)), torch.randint(0, 3, (N,))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_layer_family_gets_the_sum_of_clipped_per_sample_gradients(name, path):
    model, X, y = family(name)
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    ext = jacmem.ClipGrad(C)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the one warning a family may give: the generic fallback's (exact, but slow)
        warnings.filterwarnings("ignore", message=r".*recomputed one sample at a time")
        run(model, X, y, cross_entropy, ext)
    assert_grads(model, expected(grads, C), name)
    torch.testing.assert_close(ext.norms, norms(grads), rtol=1e-9, atol=0)
    assert ext.samples == N


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_clipping_styles_and_reductions(clipping, reduction, flow, path):
    model, X, y = family("conv2d")
    grads = per_sample(model, X, y, cross_entropy, reduction)
    if clipping == "per_layer":
        C = [g.flatten(1).norm(dim=1).median().item() for g in grads.values()]
    else:
        C = median_norm(grads)
    run(model, X, y, cross_entropy, jacmem.ClipGrad(C, clipping, reduction, stability=0.05), reduction, flow)
    assert_grads(model, expected(grads, C, clipping, stability=0.05), f"{clipping} {reduction} {flow}")


def test_a_tracked_model_called_inside_the_block():
    """The tracker's calls inside a block run through ComputeOnce, as the block's own do;
    a backward after the block gets autograd's gradients."""
    model, X, y = family("linear_sequence")
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    jacmem.track(model)
    try:
        with jacmem.extend(jacmem.ClipGrad(C)):
            out = model(X)
            assert type(out.grad_fn).__name__ == "ComputeOnceBackward"
            F.cross_entropy(out, y).backward()
            late = F.cross_entropy(model(X), y)
        assert_grads(model, expected(grads, C))
        model.zero_grad(set_to_none=True)
        with pytest.warns(UserWarning, match="after the block had closed.*unclipped"):
            late.backward()
    finally:
        jacmem.untrack(model)
    assert_grads(model, {p: g.sum(0) / N for p, g in grads.items()}, "after the block")


def test_per_layer_thresholds_as_a_dict():
    model, X, y = family("linear_sequence")
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = [g.flatten(1).norm(dim=1).median().item() for g in grads.values()]
    run(model, X, y, cross_entropy, jacmem.ClipGrad(dict(zip(grads, C)), "per_layer"))
    assert_grads(model, expected(grads, C, "per_layer"))


def test_per_layer_thresholds_must_match_the_parameters():
    model, X, y = family("linear_sequence")
    with pytest.raises(ValueError, match="one per trainable parameter"):
        run(model, X, y, cross_entropy, jacmem.ClipGrad([1.0, 2.0], "per_layer"))
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_two_backward_passes_accumulate_and_samples_count(path):
    """Virtual batches: each pass adds its clipped sum to what .grad held."""
    model, X, y = family("conv2d")
    model2, X2, y2 = family("conv2d", seed=1)
    grads, grads2 = per_sample(model, X, y, cross_entropy, "mean"), per_sample(model, X2, y2, cross_entropy, "mean")
    before = [torch.randn_like(p) for p in model.parameters()]
    for p, b in zip(model.parameters(), before):
        p.grad = b.clone()
    ext = jacmem.ClipGrad(0.5)
    with jacmem.extend(ext):
        F.cross_entropy(model(X), y).backward()
        F.cross_entropy(model(X2), y2).backward()
    one, two = expected(grads, 0.5), expected(grads2, 0.5)
    assert_grads(model, {p: b + one[p] + two[p] for p, b in zip(model.parameters(), before)})
    assert ext.samples == 2 * N
    torch.testing.assert_close(ext.norms, norms(grads2), rtol=1e-9, atol=0)
    ext.reset()
    assert ext.samples == 0


@pytest.mark.parametrize("name", ["linear_sequence", "conv2d", "embedding", "attention", "lstm"])
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_create_graph_writes_the_clipped_sum_as_a_constant(name, flow, path):
    """backward(create_graph=True): .grad gets the clipped sum, as without it, and holds no
    graph (Opacus's clipped .grad is a constant too: its per-sample gradients come from
    detached activations and output gradients); the input's gradient keeps its graph."""
    model, X, y = family(name)
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    X = X.requires_grad_() if X.is_floating_point() else X
    if flow == "track":
        jacmem.track(model)
    try:
        loss = cross_entropy(model(X), y, "mean") if flow == "track" else None
        with jacmem.extend(jacmem.ClipGrad(C)):
            loss = cross_entropy(model(X), y, "mean") if loss is None else loss
            loss.backward(create_graph=True)
    finally:
        jacmem.untrack(model)
    assert_grads(model, expected(grads, C), f"{name} {flow}")
    assert not any(p.grad.requires_grad for p in trainable(model))
    if X.is_floating_point():
        assert X.grad.requires_grad
    for p in model.parameters():
        p.grad = None  # (create_graph's reference cycle through X.grad)


def test_tied_and_frozen_parameters(path):
    """A weight used twice is clipped by the norm of its summed use; a frozen one gets nothing."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.mid = nn.Linear(4, 4)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(self.frozen(torch.tanh(self.mid(self.emb(ids))))).transpose(1, 2)

    torch.manual_seed(0)
    model = Tied().to(DT)
    X, y = torch.randint(0, 7, (N, 3)), torch.randint(0, 7, (N, 3))
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    run(model, X, y, cross_entropy, jacmem.ClipGrad(C))
    assert_grads(model, expected(grads, C))
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None


def test_empty_batch_adds_zeros(path):
    model, X, y = family("linear_sequence")
    ext = jacmem.ClipGrad(1.0)
    with jacmem.extend(ext):
        F.cross_entropy(model(X[:0]), y[:0]).backward()  # NaN: the mean of nothing
    for p in model.parameters():
        assert p.grad is not None and not p.grad.any()
    assert ext.samples == 0 and ext.norms.shape == (0,)


# -- real models ---------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")


class Logits(nn.Module):
    """GPT-2 as the loss sees it: ids [N, T] -> logits [N, V, T]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits.transpose(1, 2)


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=8, n_head=2, vocab_size=13, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = Logits(transformers.GPT2LMHeadModel(config)).to(DT).eval()
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    return model, torch.randint(0, 13, (3, 5)), torch.randint(0, 13, (3, 5))


def vit():
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=4, num_classes=3, depth=2,
        embed_dim=8, num_heads=2,
    ).to(DT).eval()  # fmt: skip
    return model, torch.randn(3, 3, 8, 8, dtype=DT), torch.randint(0, 3, (3,))


def bert():
    """BERT's attention key biases have gradients that are zero in exact arithmetic (softmax
    ignores a shift shared by every key): rounding alone, ~1e-23, whatever sums them."""
    from tests.support import hf_models

    return hf_models.build("bert")


@pytest.mark.parametrize("make", [gpt2, vit, bert], ids=["gpt2", "vit", "bert"])
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_real_models(make, flow, path):
    """GPT-2 with its default [1, T] position ids and tied embeddings; ViT with its
    cls_token and pos_embed, parameters of the model itself; BERT."""
    model, X, y = make()
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    run(model, X, y, cross_entropy, jacmem.ClipGrad(C), flow=flow)
    assert_grads(model, expected(grads, C), f"{make.__name__} {flow}")


def test_autocast_bfloat16_runs_with_float32_norms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    X, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    ext = jacmem.ClipGrad(0.1)
    with jacmem.extend(ext), torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(X), y).backward()
    assert ext.norms.dtype == torch.float32 and ext.norms.shape == (N,)
    for p in model.parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
        assert p.grad.norm() <= 0.1 * N * 1.001  # a sum of N gradients of norm at most 0.1
    ref = per_sample(model.double(), X.double(), y, cross_entropy, "mean")
    torch.testing.assert_close(ext.norms.double(), norms(ref), rtol=0.05, atol=0)  # bfloat16 inputs


@pytest.mark.parametrize("name", ["gpt2", "vit", "gpt2 LoRA with its embedding"])
def test_autocast_bfloat16_with_the_backward_inside_the_region_clips_the_per_sample_gradients(name):
    """The backward called inside the autocast region, as much training code does: the
    end of the pass ran under autocast too, where the check that autograd's gradient is
    the recorded calls' sum projected it in bfloat16, and refused every LayerNorm
    parameter of a transformer (its bfloat16 rounding against float32's tolerance). The
    check also took float32's tolerance for a call whose own ops autocast ran in bfloat16
    while its output is float32 (PEFT's ``lora.Embedding``, whose per-sample gradients
    jacmem recomputes in float32). The clipped sum equals the one formed from the same
    pass's per-sample gradients."""
    from tests.support import hf_models

    lora = name.endswith("embedding")
    model, X, y = hf_models.build_lora("gpt2", embedding=True) if lora else hf_models.build(name)
    model = model.float()
    X = X.float() if X.is_floating_point() else X
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with jacmem.extend(jacmem.BatchGrad()):
            cross_entropy(model(X).float(), y, "mean").backward()
        grads = {p: p.grad_batch.double() * len(X) for p in trainable(model)}  # as per_sample's: the mean undone
        C = median_norm(grads)
        model.zero_grad(set_to_none=True)
        with jacmem.extend(jacmem.ClipGrad(C)):
            cross_entropy(model(X).float(), y, "mean").backward()
    for i, (p, want) in enumerate(expected(grads, C).items()):
        torch.testing.assert_close(p.grad.double(), want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {i}: {m}")


# -- refusals ------------------------------------------------------------------------


def no_hooks(model: nn.Module) -> bool:
    return all(not p._backward_hooks for p in model.parameters() if p._backward_hooks is not None)


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_in_training_mode_is_refused_before_any_step(affine):
    """Refused by check and inside a block; without affine parameters the BatchNorm has no
    call of its own to refuse in, and the Conv below it was clipped silently, by norms of
    gradients that mix the samples: the block refuses it when its model's forward begins
    (or, for a tracked model, when the backward does)."""
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, affine=affine), nn.Flatten(), nn.Linear(36, 3)).to(DT)
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm2d\).*GroupNorm"):
        check(model)
    check(model.eval())  # running statistics: exact
    model.train()
    X, y = torch.randn(N, 2, 5, 5, dtype=DT), torch.randint(0, 3, (N,))
    for flow in ("inside", "track"):
        with pytest.raises(jacmem.UnsupportedModuleError, match=r"'1' \(BatchNorm2d\).*GroupNorm"):
            run(model, X, y, cross_entropy, jacmem.ClipGrad(1.0), flow=flow)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert no_hooks(model)


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_parameter_used_outside_every_recorded_call_is_refused(create_graph):
    """A parameter of the model that the loss reads directly: its clipped gradient is unknown
    (under create_graph=True too, where autograd computes its recorded calls' gradients)."""
    model, X, y = family("linear_sequence")
    extra = model[0].weight
    with pytest.raises(RuntimeError, match=r"outside every module call"):
        with jacmem.extend(jacmem.ClipGrad(1.0)):
            (F.cross_entropy(model(X), y) + model[2].weight.square().sum()).backward(create_graph=create_graph)
    assert extra.grad is None or not extra.grad.any()
    assert no_hooks(model)


def test_a_tracked_models_parameter_used_outside_its_calls_is_refused_by_its_name():
    """The forward ran before the block, tracked: the error names the parameter in its model."""
    model, X, y = family("linear_sequence")
    jacmem.track(model)
    try:
        loss = F.cross_entropy(model(X), y) + model[2].weight.square().sum()
        with pytest.raises(RuntimeError, match=r"parameter 'Sequential\.2\.weight' outside every module call"):
            with jacmem.extend(jacmem.ClipGrad(1.0)):
                loss.backward()
    finally:
        jacmem.untrack(model)


@pytest.mark.parametrize("where", ["free parameter", "model run before the block", "only a model run before"])
def test_a_parameter_in_no_model_the_block_saw_is_refused_not_leaked(where):
    """Parameters that no model of the block holds: a free ``nn.Parameter`` in a
    functional op, or a model whose forward ran before the block, untracked (beside a
    model run inside it, or alone). autograd would put their unclipped gradients in
    ``.grad``; the block guards them before the backward, so it raises, naming their
    shape, and ``.grad`` gets nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    free, other = nn.Parameter(torch.randn(4, 3, dtype=DT)), nn.Linear(4, 3).to(DT)
    X, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    outer = other(X)  # its forward, before the block
    with pytest.raises(
        RuntimeError, match=r"reaches parameter 'of shape \[[\d, ]+\], in no model the block ran or tracks'"
    ):
        with jacmem.extend(jacmem.ClipGrad(1.0)):
            if where == "only a model run before":
                F.cross_entropy(outer, y).backward()
            else:
                F.cross_entropy(model(X) + (X @ free if where == "free parameter" else outer), y).backward()
    assert all(p.grad is None for p in (free, *other.parameters()))
    assert no_hooks(model) and no_hooks(other) and not free._backward_hooks


class Checkpointed(nn.Module):
    """Two segments under ``torch.utils.checkpoint``, then a head: [N, 4] -> [N, 3]."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.second = nn.Sequential(nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, x):
        h = checkpoint(self.first, x, use_reentrant=self.reentrant)
        return self.head(checkpoint(self.second, h, use_reentrant=self.reentrant))


@pytest.mark.parametrize("head", ["trained", "frozen"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_segment_is_clipped_with_the_whole_norm(reentrant, head):
    """A reentrant checkpoint backpropagates through each segment with a backward of its
    own, inside the outer one; the segments' norms join the outer pass's, so every
    parameter is clipped by the whole per-sample norm (clipped by the norm of its own
    part, the sum's sensitivity exceeded the threshold). The per-sample gradients of the
    reference come from ``.backward()`` one sample at a time (a reentrant checkpoint gives
    ``torch.autograd.grad`` nothing). With the head frozen (LoRA's case: nothing of the
    outer backward is recorded before the nested one begins), the outer pass begins at
    the segment's recomputation."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant).to(DT)
    model.head.requires_grad_(head == "trained")
    X, y = torch.randn(N, 4, dtype=DT, requires_grad=True), torch.randint(0, 3, (N,))
    rows = []
    for n in range(N):
        model.zero_grad(set_to_none=True)
        cross_entropy(model(X[n : n + 1]), y[n : n + 1], "sum").backward()
        rows.append([p.grad.clone() for p in trainable(model)])
    grads = {p: torch.stack([row[i] for row in rows]) for i, p in enumerate(trainable(model))}
    C = median_norm(grads)
    ext = jacmem.ClipGrad(C)
    model.zero_grad(set_to_none=True)
    with jacmem.extend(ext):
        cross_entropy(model(X), y, "mean").backward()
    assert_grads(model, expected(grads, C), f"reentrant={reentrant}, head {head}")
    torch.testing.assert_close(ext.norms, norms(grads), rtol=1e-9, atol=0)


#: embedding settings ClipGrad refuses: (keywords, check()'s message, the backward's message)
REFUSED_EMBEDDINGS = {
    "sparse": (
        {"sparse": True},
        r"'0' .*sparse=True.*sparse=False",
        r"parameter '.*0.weight' got a sparse gradient.*sparse=False",
    ),
    "scale_grad_by_freq": (
        {"scale_grad_by_freq": True},
        r"'0' .*scale_grad_by_freq=True.*=False",
        r"ClipGrad: module '0' \(\w+\) has scale_grad_by_freq=True.*=False\.$",
    ),
}


@pytest.mark.parametrize("setting", list(REFUSED_EMBEDDINGS))
@pytest.mark.parametrize("layer", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_setting_is_refused_naming_the_fix(layer, setting):
    """Refused before any step and in the backward, naming the module and the fix;
    nothing is left behind.

    - ``sparse=True``: autograd's gradient is sparse, which the block's guard could not
      even take in (it crashed with "expand is unsupported for Sparse tensors"); the
      clipped sum is dense.
    - ``scale_grad_by_freq=True``: autograd divides row ``v``'s gradient by ``v``'s count
      in the whole batch, so a sample's share of ``.grad`` depends on the others: no
      sample has a gradient of its own, and clipping that share does not bound what one
      sample changes (ClipGrad clipped the shares silently)."""
    keywords, checked, in_backward = REFUSED_EMBEDDINGS[setting]
    torch.manual_seed(0)
    model = nn.Sequential(layer(11, 4, **keywords), nn.Flatten(), nn.LazyLinear(3)).to(DT)
    X, y = torch.randint(0, 11, (N, 2)), torch.randint(0, 3, (N,))
    X[:, 0] = 3  # a row every sample reads
    model(X)  # the lazy layer's shape
    with pytest.raises(jacmem.UnsupportedModuleError, match=checked):
        check(model)
    with pytest.raises(RuntimeError, match=in_backward):
        with jacmem.extend(jacmem.ClipGrad(1.0)):
            cross_entropy(model(X), y, "mean").backward()
    assert all(p.grad is None for p in model.parameters())
    assert no_hooks(model)


class SequenceFirstInside(nn.Module):
    """[N, T, 4] -> [N, 2]: its layers run on [T, N, ...] (a model written sequence-first
    inside, fed batch-first)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x.transpose(0, 1)))).mean(0)


def multiple_choice():
    """HF BertForMultipleChoice: [N, K, T] token ids -> [N, K] logits, through [N*K, T] inside."""
    from transformers import BertConfig, BertForMultipleChoice

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=8, hidden_dropout_prob=0, attention_probs_dropout_prob=0,
    )  # fmt: skip
    return BertForMultipleChoice(config).to(DT)


@pytest.mark.parametrize("model", ["multiple choice", "sequence-first inside"])
@pytest.mark.parametrize("flow", ["inside", "private"])
def test_a_model_that_moves_its_samples_off_the_batch_axis_is_refused(model, flow):
    """Every layer sees the same batch, which is not the samples': HF's multiple-choice
    head flattens [N, K, T] into [N*K, T] (each choice clipped on its own: a sample's
    sensitivity grows to sqrt(K) C), and a model whose layers run on [T, N, ...] clipped
    each position on its own. No layer disagrees with another, so this passed silently
    (Opacus clips the same rows); now the pass raises naming the fix, and .grad gets nothing."""
    if model == "multiple choice":
        net, X, y = multiple_choice(), torch.randint(0, 50, (3, 2, 6)), torch.tensor([0, 1, 1])
        rows, fix = 6, r"ForMultipleChoice"
    else:
        torch.manual_seed(0)
        net, X, y = SequenceFirstInside().to(DT), torch.randn(3, 7, 4, dtype=DT), torch.tensor([0, 1, 1])
        rows, fix = 7, r"batch_first=False"

    def loss():
        out = net(X)
        return cross_entropy(getattr(out, "logits", out), y, "mean")

    refused = pytest.raises(RuntimeError, match=rf"take {rows} rows on their batch axis.*offers 3 .*{fix}")
    if flow == "inside":
        with refused, jacmem.extend(jacmem.ClipGrad(1.0)):
            loss().backward()
    else:
        engine = PrivacyEngine()
        try:
            private(engine, net, 1.0, data_loader=loader(X, y, batch_size=3))
            with refused:
                loss().backward()
        finally:
            engine.detach()
    assert all(p.grad is None for p in net.parameters())
    assert no_hooks(net)


def test_layers_that_run_sequence_first_are_clipped_per_sample_under_batch_first_false():
    """The fix the refusal names: the same model with batch_first=False equals the loop."""
    torch.manual_seed(0)
    model, X, y = SequenceFirstInside().to(DT), torch.randn(3, 7, 4, dtype=DT), torch.tensor([0, 1, 1])
    grads = per_sample(model, X, y, cross_entropy, "sum")
    clip = 0.5 * median_norm(grads)
    with jacmem.extend(jacmem.ClipGrad(clip, loss_reduction="sum"), batch_first=False):
        cross_entropy(model(X), y, "sum").backward()
    assert_grads(model, expected(grads, clip))


class CentredOverTheBatch(nn.Module):
    """[N, 4] -> [N, 2]: a Linear, its output centred over the batch (the samples mix), a Linear."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = self.l1(x)
        return self.l2(h - h.mean(0, keepdim=True))


@pytest.mark.parametrize("model", ["T5, N = T", "centred over the batch"])
@pytest.mark.parametrize("flow", ["inside", "private"])
def test_a_call_behind_a_broadcast_over_the_batch_is_refused(model, flow):
    """A call whose output reaches the loss through a tensor broadcast over the batch gets
    the samples' gradients summed: T5's relative attention bias (an Embedding on [T, T]
    ids) was clipped per query position where N = T (the norms 5e-4 off the loop, with no
    error), and a Linear whose output is centred over the batch got rows that mix the
    samples. Now the backward raises naming the module, and .grad gets nothing."""
    from tests.support.hf_models import T5Classifier

    torch.manual_seed(0)
    if model == "T5, N = T":
        net, X, y = T5Classifier().to(DT), torch.randint(0, 50, (5, 5)), torch.tensor([0, 1, 2, 1, 0])
        name = r"'[\w.]*relative_attention_bias' \(Embedding\)"
    else:
        net, X, y = CentredOverTheBatch().to(DT), torch.randn(5, 4, dtype=DT), torch.tensor([0, 1, 1, 0, 1])
        name = r"'l1' \(Linear\)"
    refused = pytest.raises(
        RuntimeError, match=rf"module {name} reaches the model.s output \(or the loss\) through a tensor broadcast"
    )
    if flow == "inside":
        with refused, jacmem.extend(jacmem.ClipGrad(1.0)):
            cross_entropy(net(X), y, "mean").backward()
    else:
        engine = PrivacyEngine()
        try:
            private(engine, net, 1.0, data_loader=loader(X, y, batch_size=5))
            with refused:
                cross_entropy(net(X), y, "mean").backward()
        finally:
            engine.detach()
    assert all(p.grad is None for p in net.parameters())
    assert no_hooks(net)


def test_t5_with_its_relative_attention_bias_frozen_is_clipped_per_sample():
    """The fix the refusal names, on T5 with N = T: the relative attention bias frozen,
    the rest equals the per-sample loop."""
    from tests.support.hf_models import T5Classifier

    torch.manual_seed(0)
    model, X, y = T5Classifier().to(DT), torch.randint(0, 50, (5, 5)), torch.tensor([0, 1, 2, 1, 0])
    for name, p in model.named_parameters():
        p.requires_grad_("relative_attention_bias" not in name)
    grads = per_sample(model, X, y, cross_entropy, "sum")
    clip = median_norm(grads)
    with jacmem.extend(jacmem.ClipGrad(clip, loss_reduction="sum")):
        cross_entropy(model(X), y, "sum").backward()
    assert_grads(model, expected(grads, clip))


def tied_embedding():
    """An embedding tied to its Linear head, token ids [N, 3] -> logits [N, 11, 3]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11)).to(DT)
    model[1].weight = model[0].weight
    return model, torch.randint(0, 11, (N, 3)), torch.randint(0, 11, (N, 3))


def test_a_use_of_one_embedding_row_outside_every_recorded_call_is_refused():
    """A difference of rank one (the worst case for the check's random projections):
    one row of a tied embedding read by the loss, 1e-2 of the gradient's size."""
    model, X, y = tied_embedding()
    for row in range(11):
        with pytest.raises(RuntimeError, match=r"reaches parameter .* outside every module call"):
            with jacmem.extend(jacmem.ClipGrad(1.0)):
                (F.cross_entropy(model(X).transpose(1, 2), y) + 1e-2 * model[0].weight[row].sum()).backward()
    assert model[0].weight.grad is None
    assert no_hooks(model)


@pytest.mark.parametrize("layer, use", [(0, 1), (2, 2)], ids=["tied embedding", "linear"])
def test_autograd_grad_of_a_clipped_parameter_raises_and_accumulates_again_after_the_block(layer, use):
    """Inside the block, ``torch.autograd.grad`` w.r.t. a parameter the block clips
    raises, naming it (a use of it: the tied head's): it gave zeros where autograd
    differentiates the call (the tied embedding's) and torch's 'appears to not have been used in the graph' where
    ComputeOnce does (a Linear), and the pass wrote its clipped sum into ``.grad``.
    After the block, the hook on the gradient accumulator is gone and autograd
    accumulates again."""
    model, X, y = tied_embedding()
    model.append(nn.Linear(11, 11).to(DT))
    weight = model[layer].weight

    def loss():
        return F.cross_entropy(model(X).transpose(1, 2), y)

    with jacmem.extend(jacmem.ClipGrad(1.0)):
        with pytest.raises(RuntimeError, match=rf"autograd.grad asks for the gradient of parameter '{use}.weight'"):
            torch.autograd.grad(loss(), weight)
    assert all(p.grad is None for p in model.parameters())
    assert no_hooks(model)
    loss().backward()
    (want,) = torch.autograd.grad(loss(), weight)
    torch.testing.assert_close(weight.grad, want, rtol=0, atol=0)


def test_clipgrad_runs_alone_in_its_block():
    with pytest.raises(ValueError, match="runs alone"):
        jacmem.extend(jacmem.ClipGrad(1.0), jacmem.BatchGrad())


def test_bad_arguments():
    with pytest.raises(ValueError, match="clipping"):
        jacmem.ClipGrad(1.0, clipping="tight")
    with pytest.raises(ValueError, match="loss_reduction"):
        jacmem.ClipGrad(1.0, loss_reduction="none")
    with pytest.raises(TypeError, match="per_layer"):
        jacmem.ClipGrad(1.0, clipping="per_layer")


# -- DistributedDataParallel ---------------------------------------------------------

WORLD, PER_RANK = 2, 3


def _ddp_worker(rank: int) -> None:
    """Each rank clips its half of the batch; every rank's .grad is then the clipped sum
    over the whole batch, as one process computes it, and ``samples`` the global count;
    also where ``torch.compile`` wraps the DDP model."""
    torch.manual_seed(0)  # the same model and whole batch in every rank
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)).to(DT)
    X, y = torch.randn(WORLD * PER_RANK, 2, 5, 5, dtype=DT), torch.randint(0, 3, (WORLD * PER_RANK,))
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    ddp = nn.parallel.DistributedDataParallel(model)
    ext = jacmem.ClipGrad(C)
    with jacmem.extend(ext):
        backward_reads(F.cross_entropy(ddp(X[rows]), y[rows])).check("ClipGrad under DDP")  # the global count too
    assert_grads(model, expected(grads, C), f"rank {rank}")
    torch.testing.assert_close(ext.norms, norms(grads)[rows], rtol=1e-9, atol=0)
    assert ext.samples == WORLD * PER_RANK
    assert ddp.require_backward_grad_sync  # given back on exit

    model.zero_grad(set_to_none=True)  # DDP inside torch.compile's wrapper: its group found through it
    with jacmem.extend(jacmem.ClipGrad(C)):
        F.cross_entropy(torch.compile(ddp, backend="aot_eager")(X[rows]), y[rows]).backward()
    assert_grads(model, expected(grads, C), f"rank {rank} torch.compile(DDP)")

    other = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to(DT))  # a model of its own
    jacmem.track(other)
    try:
        loss = F.cross_entropy(other(torch.randn(3, 4, dtype=DT)), torch.tensor([0, 1, 0]))  # DDP's sync on
        with pytest.raises(RuntimeError, match="require_backward_grad_sync = False"):
            with jacmem.extend(jacmem.ClipGrad(C)):
                loss.backward()
    finally:
        jacmem.untrack(other)

    # tracked through torch.compile's wrapper too: DDP's sync on is refused (a model of
    # its own, as DDP's reducer fails on the forward after a backward that raised)
    spare = torch.compile(nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to(DT)), backend="aot_eager")
    jacmem.track(spare)
    try:
        loss = F.cross_entropy(spare(torch.randn(3, 4, dtype=DT)), torch.tensor([0, 1, 0]))
        with pytest.raises(RuntimeError, match="require_backward_grad_sync = False"):
            with jacmem.extend(jacmem.ClipGrad(C)):
                loss.backward()
    finally:
        jacmem.untrack(spare)
    ddp.require_backward_grad_sync = False
    for tracked, what in ((ddp, "tracked"), (torch.compile(ddp, backend="aot_eager"), "torch.compile(DDP) tracked")):
        jacmem.track(tracked)
        try:
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(tracked(X[rows]), y[rows])
            with jacmem.extend(jacmem.ClipGrad(C)):
                loss.backward()
            assert_grads(model, expected(grads, C), f"rank {rank} {what}")
        finally:
            jacmem.untrack(tracked)


@pytest.mark.slow
@needs_gloo
def test_ddp_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    run_ranks(_ddp_worker, tmp_path, world=WORLD)


@pytest.mark.parametrize("strategy", ["ghost", "ghost_gram", "unfold"])
def test_any_norm_strategy_gives_the_same_clipped_sum(strategy, monkeypatch):
    """The norms by each of a conv's strategies (chosen by name), the clipped sum as always."""
    # norms, not per-sample gradients
    monkeypatch.setattr(jacmem.engine.clipping.ClippingEngine, "_per_sample", lambda *args: False)
    model, X, y = family("conv2d")
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    with jacmem.extend(jacmem.ClipGrad(C), strategy={nn.Conv2d: strategy}) as ctx:
        F.cross_entropy(model(X), y).backward()
    assert (
        f"0.weight batch_l2 <- {strategy}" in ctx.explain()
        or f"0.weight batch_l2 <- per-sample gradients by {strategy}" in ctx.explain()
    )
    assert_grads(model, expected(grads, C), strategy)


class Pooled(nn.Module):
    """A wide Linear on a long sequence, pooled: [N, T, D] -> [N, 3]. Its per-sample
    gradients outgrow its ``x`` and ``g`` (D² > 2·T·D), and its ghost norm's T² terms
    cost more than writing them (T² > 60·D)."""

    def __init__(self, d: int):
        super().__init__()
        self.wide, self.head = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.wide(x)).mean(1))


@pytest.mark.parametrize("chunk_bytes,chosen", [(2**26, "per-sample gradients kept"), (1, "norms, then")])
def test_the_keep_budget_chooses_per_sample_gradients_or_norms(chunk_bytes, chosen):
    """Per-sample gradients bigger than ``x`` and ``g`` are kept where the cost model finds
    them cheaper than a ghost norm and a second product, within the pass's budget (a
    multiple of ``chunk_bytes``); past it, the norms now and the clipped sum from ``x``
    and ``g``. Both give the clipped sum of the per-sample loop."""
    torch.manual_seed(0)
    model, X, y = Pooled(300).to(DT), torch.randn(3, 140, 300, dtype=DT), torch.randint(0, 3, (3,))
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    with jacmem.extend(jacmem.ClipGrad(C), chunk_bytes=chunk_bytes) as ctx:
        F.cross_entropy(model(X), y).backward()
    assert f"wide.weight clipped sum <- {chosen}" in ctx.explain(), ctx.explain()
    assert_grads(model, expected(grads, C), chosen)
