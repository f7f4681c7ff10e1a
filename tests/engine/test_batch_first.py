"""``batch_first=False``: models fed ``[T, N, ...]``, as Opacus's
``GradSampleModule(batch_first=False)``.

Every layer family that can take its batch on axis 1 (Linear, Embedding, LayerNorm,
RMSNorm, the generic fallback; RNNs, Opacus's DPLSTM and attention by their own ``batch_first``;
convolutions and GroupNorm on axis 0 inside a sequence-first model) against a
per-sample autograd loop over axis 1, in float64: BatchGrad, BatchL2Grad,
SumGradSquared, Variance in both flows (forward inside the block; ``jacmem.track``),
and ClipGrad. Then the calls whose batch axis cannot be told apart, which raise before
anything is written.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.clipping import assert_grads, expected, median_norm, norms
from tests.support.reference import check_against, clear, cross_entropy, per_sample_grads
from torch import Tensor, nn

import jacmem

DT = torch.float64
T, N, V = 4, 5, 11
FIRST_ORDER = (jacmem.BatchGrad, jacmem.BatchL2Grad, jacmem.SumGradSquared, jacmem.Variance)


class Swap(nn.Module):
    """``model`` fed batch-first: ``[N, T, ...] -> model([T, N, ...])``, so that the
    reference's loop over axis 0 is a loop over the model's axis 1."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x.movedim(0, 1))


def reference(model: nn.Module, X: Tensor, y: Tensor, reduction: str = "mean") -> dict:
    """{param: [N, *shape]}: sample ``n`` is ``X[:, n]`` alone, through ``model``."""
    return per_sample_grads(Swap(model), X.movedim(1, 0), y, cross_entropy, reduction)


class SeqFirst(nn.Module):
    """``layers`` on ``[T, N, ...]``, then a Linear head on the mean over ``T``: ``[N, 3]``."""

    def __init__(self, *layers: nn.Module, width: int):
        super().__init__()
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x)).mean(0)


class Steps(nn.Module):
    """An RNN's output sequence ``[T, N, H]``, whatever its own ``batch_first``."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor) -> Tensor:
        if self.rnn.batch_first:
            return self.rnn(x.transpose(0, 1))[0].transpose(0, 1)
        return self.rnn(x)[0]


class SelfAttention(nn.Module):
    """Self-attention ``[T, N, E] -> [T, N, E]``, whatever the module's own ``batch_first``."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        self.mha = mha

    def forward(self, x: Tensor) -> Tensor:
        x = x.transpose(0, 1) if self.mha.batch_first else x
        out = self.mha(x, x, x, need_weights=False)[0]
        return out.transpose(0, 1) if self.mha.batch_first else out


class ConvOverTime(nn.Module):
    """A Conv1d and a GroupNorm in a sequence-first model: ``[T, N, C]`` is laid out
    ``[N, C, T]`` for them (their batch is axis 0), and back."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.norm = nn.GroupNorm(2, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.conv(x.permute(1, 2, 0))).permute(2, 0, 1)


class StepBias(nn.Module):
    """No derivative registered (the generic fallback): a learnt first step, then a
    cumulative sum over time, ``[T, N, E] -> [T + 1, N, E]`` (Opacus's SequenceBias, with
    the steps mixed so that the recomputation must see a sample's whole sequence)."""

    def __init__(self, e: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(e))
        self.scale = nn.Parameter(torch.randn(e))

    def forward(self, x: Tensor) -> Tensor:
        first = self.bias.expand(1, x.shape[1], -1)
        return torch.cumsum(torch.cat([first, x * self.scale], 0), 0)


class TextLSTM(nn.Module):
    """Opacus's text model shape: Embedding -> LSTM -> Linear on the last step, on ``[T, N]``
    token ids (the last step kept as ``[1, N, H]``, its batch on axis 1)."""

    def __init__(self, batch_first_lstm: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.lstm = Steps(nn.LSTM(4, 6, batch_first=batch_first_lstm))
        self.fc = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.lstm(self.emb(x))[-1:])[0]


def dp_lstm(batch_first: bool) -> nn.Module:
    """Opacus's DPLSTM: its cells' RNNLinear run one step at a time on ``[N, I]``."""
    from opacus.layers import DPLSTM

    return SeqFirst(Steps(DPLSTM(4, 5, batch_first=batch_first)), width=5)


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=False)
    return SeqFirst(layer, width=4)


FAMILIES = {
    "linear": lambda: SeqFirst(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6), width=6),
    "embedding": lambda: SeqFirst(nn.Embedding(V, 4), nn.Linear(4, 5), width=5),
    "layernorm": lambda: SeqFirst(nn.Linear(4, 6), nn.LayerNorm(6), width=6),
    "rmsnorm": lambda: SeqFirst(nn.Linear(4, 6), nn.RMSNorm(6), width=6),
    "conv_groupnorm": lambda: SeqFirst(ConvOverTime(), nn.Linear(6, 5), width=5),
    "rnn": lambda: SeqFirst(Steps(nn.RNN(4, 5)), width=5),
    "gru": lambda: SeqFirst(Steps(nn.GRU(4, 5, num_layers=2, bidirectional=True)), width=10),
    "lstm": lambda: SeqFirst(Steps(nn.LSTM(4, 5)), width=5),
    "lstm_own_batch_first": lambda: SeqFirst(Steps(nn.LSTM(4, 5, batch_first=True)), width=5),
    "opacus_dplstm": lambda: dp_lstm(False),
    "opacus_dplstm_own_batch_first": lambda: dp_lstm(True),
    "attention": lambda: SeqFirst(SelfAttention(nn.MultiheadAttention(4, 2)), width=4),
    "attention_own_batch_first": lambda: SeqFirst(
        SelfAttention(nn.MultiheadAttention(4, 2, batch_first=True)), width=4
    ),
    "generic_fallback": lambda: SeqFirst(StepBias(4), nn.Linear(4, 5), width=5),
    "transformer_encoder": encoder,
    "text_lstm": TextLSTM,
}
TOKENS = {"embedding", "text_lstm"}


def family(name: str):
    torch.manual_seed(0)
    model = FAMILIES[name]().to(DT)
    X = torch.randint(0, V, (T, N)) if name in TOKENS else torch.randn(T, N, 4, dtype=DT)
    return model, X, torch.randint(0, 3, (N,))


def run(model, X, y, extensions, flow: str, reduction: str = "mean") -> None:
    """One backward under ``batch_first=False``: the forward inside the block, or tracked
    before it."""
    clear(model)
    if flow == "inside":
        with jacmem.extend(*extensions, batch_first=False):
            cross_entropy(model(X), y, reduction).backward()
        return
    jacmem.track(model, batch_first=False)
    try:
        loss = cross_entropy(model(X), y, reduction)
        with jacmem.extend(*extensions, batch_first=False):
            loss.backward()
    finally:
        jacmem.untrack(model)


@pytest.mark.parametrize("flow", ["inside", "track"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_first_order_quantities_per_sample_over_axis_1(name, flow):
    model, X, y = family(name)
    want = reference(model, X, y)
    run(model, X, y, [e() for e in FIRST_ORDER], flow)
    check_against(model, want, [e.savefield for e in FIRST_ORDER], f"[{name} {flow}]")


@pytest.mark.usefixtures("path")  # both ways to the clipped sum
@pytest.mark.parametrize("name", list(FAMILIES))
def test_clip_grad_clips_each_sample_of_axis_1(name):
    model, X, y = family(name)
    grads = {p: g * N for p, g in reference(model, X, y).items()}  # each sample's own loss term
    C = median_norm(grads)
    ext = jacmem.ClipGrad(C)
    run(model, X, y, [ext], "inside")
    assert_grads(model, expected(grads, C), name)
    torch.testing.assert_close(ext.norms, norms(grads), rtol=1e-9, atol=0)
    assert ext.samples == N


def test_per_layer_clipping_and_sum_reduction_tracked():
    model, X, y = family("text_lstm")
    grads = reference(model, X, y, "sum")
    C = [g.flatten(1).norm(dim=1).median().item() for g in grads.values()]
    run(model, X, y, [jacmem.ClipGrad(C, "per_layer", "sum")], "track", "sum")
    assert_grads(model, expected(grads, C, "per_layer"), "per_layer")


def test_opacus_dp_multihead_attention_text_model_agrees_with_opacus():
    """Opacus's own text test model (Embedding -> DPMultiheadAttention -> Linear on
    ``[T, N]``, whose SequenceBias gets the generic fallback): jacmem's per-sample
    gradients equal those of Opacus's GradSampleModule(batch_first=False), and the loop's."""
    from opacus import GradSampleModule
    from opacus.layers import DPMultiheadAttention

    class SampleAttnNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 8)
            self.attn = DPMultiheadAttention(8, 2, add_bias_kv=True)
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            x = self.emb(x)
            x, _ = self.attn(x, x, x)
            return self.fc(x).mean(0)

    torch.manual_seed(0)
    model = SampleAttnNet().to(DT)
    X, y = torch.randint(0, V, (T, N)), torch.randint(0, 3, (N,))
    want = reference(model, X, y, "sum")
    run(model, X, y, [jacmem.BatchGrad()], "inside", "sum")
    check_against(model, want, ["grad_batch"], "[DPMultiheadAttention]")
    ours = {n: p.grad_batch.clone() for n, p in model.named_parameters()}
    clear(model)
    gsm = GradSampleModule(model, batch_first=False, loss_reduction="sum")
    try:
        cross_entropy(gsm(X), y, "sum").backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(ours[name], p.grad_sample, rtol=1e-9, atol=1e-12, msg=name)
    finally:
        gsm._close()


# -- calls whose batch axis cannot be told apart -------------------------------------


class LastStep(nn.Module):
    """The classic text classifier head, ``fc(out[-1])``: its input ``[N, H]`` has the batch
    on axis 0, where batch_first=False says axis 1."""

    def __init__(self, out: int):
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.lstm = nn.LSTM(4, 6)
        self.fc = nn.Linear(6, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.lstm(self.emb(x))[0][-1])


def nothing_written(model: nn.Module, grad: bool = True) -> None:
    """No jacmem attribute; with ``grad``, no ``.grad`` either (ClipGrad's, or a forward
    that raised)."""
    for p in model.parameters():
        assert not (grad and p.grad is not None and p.grad.any())
        assert not hasattr(p, "grad_batch")


@pytest.mark.parametrize("ext", [jacmem.BatchGrad, lambda: jacmem.ClipGrad(1.0)])
def test_a_head_on_the_last_step_without_its_axis_raises_at_the_call(ext):
    """Its output's axis 1 differs from its input's: the forward raises, naming the
    module and the fix, and leaves nothing behind."""
    model = LastStep(3).to(DT)
    X, y = torch.randint(0, V, (T, N)), torch.randint(0, 3, (N,))
    with pytest.raises(ValueError, match=r"batch_first=False, module 'fc' \(Linear\).*out\[-1:\]"):
        with jacmem.extend(ext(), batch_first=False):
            cross_entropy(model(X), y, "mean").backward()
    nothing_written(model)


@pytest.mark.parametrize("ext", [jacmem.BatchGrad, lambda: jacmem.ClipGrad(1.0)])
def test_a_module_whose_axis_1_is_not_the_batch_raises_at_the_call(ext):
    """A square head on ``out[-1]``: its axis 1 (6) looks like a batch at the call, but
    disagrees with the embedding's (5) in the same forward."""
    model = LastStep(6).to(DT)
    X, y = torch.randint(0, V, (T, N)), torch.randint(0, 6, (N,))
    with pytest.raises(
        ValueError, match=r"batch_first=False, module 'fc' \(Linear\) has a batch of 6 where 'emb' had 5"
    ):
        with jacmem.extend(ext(), batch_first=False):
            cross_entropy(model(X), y, "mean").backward()
    nothing_written(model)


def test_an_input_without_axis_1_raises():
    emb = nn.Embedding(V, 4).to(DT)
    with pytest.raises(ValueError, match=r"module 'Embedding' \(Embedding\).*input has shape \(5,\), with no axis 1"):
        with jacmem.extend(jacmem.BatchGrad(), batch_first=False):
            emb(torch.randint(0, V, (N,))).sum().backward()
    nothing_written(emb)


def test_track_and_block_must_agree():
    model, X, y = family("linear")
    jacmem.track(model, batch_first=False)
    try:
        loss = cross_entropy(model(X), y, "mean")
        with pytest.raises(ValueError, match=r"batch_first=False, but the block has batch_first=True"):
            with jacmem.extend(jacmem.BatchGrad()):
                loss.backward()
    finally:
        jacmem.untrack(model)
    nothing_written(model)


def test_second_order_extensions_refuse_the_option():
    with pytest.raises(ValueError, match=r"batch_first=False applies to first-order extensions and ClipGrad"):
        jacmem.extend(jacmem.DiagGGNExact(), batch_first=False)


def test_batch_first_true_is_unchanged_and_warns_about_a_sequence_first_model():
    """The default reads axis 0; a sequence-first model gets the warning that names the option."""
    model, X, y = family("lstm")
    with pytest.warns(RuntimeWarning, match=r"pass batch_first=False to jacmem.extend"):
        with jacmem.extend(jacmem.BatchGrad()):
            cross_entropy(model(X), y, "mean").backward()


def test_modules_of_one_pass_on_different_batches_raise_before_anything_is_written():
    """Each forward agrees with itself, but the pass holds two batch sizes: under
    batch_first=False that is an error, not a warning."""
    a, b = family("linear")[0], family("lstm")[0]
    X, Y = torch.randn(T, N, 4, dtype=DT), torch.randn(T, 3, 4, dtype=DT)
    with pytest.raises(RuntimeError, match=r"under batch_first=False, the modules of one backward pass see different"):
        with jacmem.extend(jacmem.BatchGrad(), batch_first=False):
            (a(X).sum() + b(Y).sum()).backward()
    nothing_written(a, grad=False)  # autograd's .grad, as in any failed pass
    nothing_written(b, grad=False)


class _NoRootParams(nn.Module):
    """Token ids, ``[T, N]`` (``time=0``) or ``[N, T]`` (``time=1``) -> ``[N, 2]``; the
    root holds no parameter of its own, so only its children would carry hooks were the
    root not hooked too."""

    def __init__(self, time: int):
        super().__init__()
        self.time = time
        self.emb, self.fc = nn.Embedding(7, 4), nn.Linear(4, 2)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(self.emb(ids)).sum(self.time)


@pytest.mark.parametrize("batch_first", [True, False])
def test_tracked_forwards_of_other_batch_sizes_start_afresh(batch_first):
    """A tracked model's later forward on another batch size (Poisson batches) is a new
    forward: exact, neither refused nor taken for a broadcast of the last one."""
    torch.manual_seed(0)
    axis = 0 if batch_first else 1  # the batch's
    model = jacmem.track(_NoRootParams(time=1 - axis), batch_first=batch_first)
    params = [model.emb.weight, model.fc.weight, model.fc.bias]
    try:
        for n in (5, 3, 1):
            ids, y = torch.randint(0, 7, (n, 4) if batch_first else (4, n)), torch.randint(0, 2, (n,))
            with jacmem.extend(jacmem.BatchGrad(), batch_first=batch_first):
                cross_entropy(model(ids), y, "mean").backward()
            rows = [
                torch.autograd.grad(cross_entropy(model(ids.narrow(axis, i, 1)), y[i : i + 1], "sum") / n, params)
                for i in range(n)
            ]
            for k, p in enumerate(params):
                torch.testing.assert_close(p.grad_batch, torch.stack([row[k] for row in rows]))
            clear(model)
    finally:
        jacmem.untrack(model)
