"""Compiled models (``torch.compile``) inside ``jacmem.extend``: float64, against the
per-sample loop (tests/support/reference.py).

A compiled forward traces jacmem's module hooks: each call of a module with trainable
parameters is recorded by the op ``jacmem::tap`` at the graph's run time, with no graph
break (docs/guide/compile.rst). Most tests count Dynamo's graphs with a
``CompileCounterWithBackend("aot_eager")`` backend (no C++ build): at least one, none
new after the first step, and no module named by ``explain()`` as run eagerly, so that
a model that ran eagerly fails. Those named ``default backend`` or ``inductor`` compile
as users do, with no backend argument (inductor, which reuses buffers: a C++ build,
tens of seconds; one compile serves each test's cases)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo as dynamo
from tests.support import hf_models
from tests.support.clipping import assert_grads, expected, median_norm, norms, per_sample
from tests.support.reference import (
    FIRST_ORDER,
    check_against,
    clear,
    cross_entropy,
    per_sample_grads,
)
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

import jacmem
from jacmem.engine import hooks

pytestmark = [pytest.mark.usefixtures("float64_default")]

N = 6
EXTENSION_SETS = [(f,) for f in FIRST_ORDER] + [tuple(FIRST_ORDER)]


def cnn():
    """The seed CNN's layers, small, as an ``nn.Sequential``: [N, 1, 12, 12] -> [N, 5]."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2),
        nn.Conv2d(4, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2),
        nn.Flatten(), nn.Linear(12, 5),
    )  # fmt: skip
    return model, torch.randn(N, 1, 12, 12), torch.randint(0, 5, (N,))


def gpt2():
    """Tiny HF GPT-2 (tied embeddings) with default position ids: HF makes them ``[1, T]``,
    so the position embedding's call has a batch of one, broadcast over the batch."""
    return hf_models.build("gpt2")


def vit():
    return hf_models.build("vit")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _steps(model, X, y, extensions, flow: str, steps: int = 3) -> CompileCounterWithBackend:
    """``steps`` backward passes of the compiled model, each in a block of its own; the
    counter of Dynamo's graphs, checked: some, none new after the first step, and no
    module that ran eagerly."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    if flow == "track":
        jacmem.track(compiled)
    try:
        for step in range(steps):
            clear(model)
            value = cross_entropy(compiled(X), y, "mean") if flow == "track" else None
            with jacmem.extend(*[e() for e in extensions]) as block:
                (cross_entropy(compiled(X), y, "mean") if value is None else value).backward()
            assert "ran eagerly" not in block.explain()
            if step == 0:
                first = counter.frame_count
    finally:
        if flow == "track":
            jacmem.untrack(compiled)
    assert counter.frame_count >= 1, "the model ran eagerly: Dynamo made no graph"
    assert counter.frame_count == first, f"recompiled after the first step: {first} -> {counter.frame_count}"
    return counter


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["inside", "track"])
@pytest.mark.parametrize("make", [cnn, vit, gpt2], ids=["cnn", "vit", "gpt2"])
def test_first_order_extensions_are_exact_on_compiled_models(make, flow):
    model, X, y = make()
    reference = per_sample_grads(model, X, y, cross_entropy)
    sets = EXTENSION_SETS if make is cnn and flow == "inside" else [tuple(FIRST_ORDER)]
    for fields in sets:
        _steps(model, X, y, [FIRST_ORDER[f] for f in fields], flow)
        check_against(model, reference, fields, f"[{make.__name__} {flow} {fields}]")


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["inside", "track"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_clip_grad_is_exact_on_a_compiled_model(clipping, flow):
    model, X, y = cnn()
    grads = per_sample(model, X, y, cross_entropy, "mean")
    per_layer = [g.flatten(1).norm(dim=1).median().item() for g in grads.values()]
    C = per_layer if clipping == "per_layer" else median_norm(grads)
    _steps(model, X, y, [lambda: jacmem.ClipGrad(C, clipping)], flow)
    assert_grads(model, expected(grads, C, clipping), f"[{clipping} {flow}]")


@pytest.mark.slow
def test_privacy_engine_on_a_compiled_model():
    from tests.support.privacy import LR, loader, loop_step

    from jacmem.privacy import PrivacyEngine

    model, X, y = cnn()
    C = norms(per_sample(model, X, y, cross_entropy, "sum")).median().item()
    expected_params = loop_step(copy.deepcopy(model), [(X, y)], C, "flat")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    engine = PrivacyEngine()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        private, opt, _ = engine.make_private(
            module=compiled, optimizer=opt, data_loader=loader(X, y), noise_multiplier=0.0, max_grad_norm=C,
            poisson_sampling=False, clipping="flat",
        )  # fmt: skip
        opt.zero_grad()
        cross_entropy(private(X), y, "mean").backward()
        opt.step()
    finally:
        engine.detach()
    assert counter.frame_count >= 1
    for p, e in zip(model.parameters(), expected_params):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_clip_grad_is_exact_on_a_compiled_gpt2_with_default_position_ids(flow):
    """The embedding of GPT-2's ``[1, T]`` position ids is expanded to the batch inside the
    compiled graph (jacmem.engine.hooks): its per-sample gradients, and so the clipping,
    are exact, as eagerly."""
    model, X, y = gpt2()
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    _steps(model, X, y, [lambda: jacmem.ClipGrad(C, "flat")], flow)
    assert_grads(model, expected(grads, C, "flat"), f"[gpt2 {flow}]")


@pytest.mark.slow
def test_clip_grad_is_exact_on_a_compiled_llama():
    """HF's LlamaRMSNorm computes in float32 inside the float64 model, and inductor's
    float32 kernels round differently from the eager recomputation that gives its
    per-sample gradients (relative 4e-8): the check that the loss reaches each parameter
    only through recorded calls allows float32's rounding there, so the step is exact to
    the per-sample loop (it refused, naming post_attention_layernorm.weight)."""
    model, X, y = hf_models.build("llama")
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    compiled = torch.compile(model)  # inductor, the default backend
    clear(model)
    with jacmem.extend(jacmem.ClipGrad(C, "flat")):
        cross_entropy(compiled(X), y, "mean").backward()
    want = expected(grads, C, "flat")
    for name, p in model.named_parameters():  # float32's rounding, where the model computes in it
        error = float((p.grad - want[p]).norm() / want[p].norm())
        assert error < 1e-5, f"{name}: relative error {error:.1e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_compiled_lora_with_its_embedding_adapter_is_exact(name):
    """PEFT's ``lora.Embedding`` reads its matrices from ``ParameterDict`` children: a
    compiled forward recorded only modules with parameters of their own, so its adapters
    got no per-sample quantities (a warning) and ``ClipGrad`` refused them. Now as
    eagerly: exact, by the module's own record."""
    pytest.importorskip("peft")
    model, X, y = hf_models.build_lora(name, embedding=True)
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    _steps(model, X, y, [lambda: jacmem.ClipGrad(C)], "inside", steps=2)
    assert_grads(model, expected(grads, C), f"[{name} LoRA with its embedding]")
    reference = per_sample_grads(model, X, y, cross_entropy)
    _steps(model, X, y, [jacmem.BatchGrad], "inside", steps=2)
    check_against(model, reference, ["grad_batch"])


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_a_compiled_gpt2_on_a_batch_of_one_is_exact(flow):
    """On a batch of one, GPT-2's token embedding runs on ``[1, T]`` ids too, the first call
    of the forward: the compiled forward refused it as a call whose output may be
    broadcast over the batch (a Poisson batch of one ended a private training run). No
    call on more rows follows, so the batch is that one row: exact, as eagerly."""
    model, X, y = gpt2()
    X, y = X[:1], y[:1]
    grads = per_sample(model, X, y, cross_entropy, "mean")
    reference = per_sample_grads(model, X, y, cross_entropy)
    _steps(model, X, y, [lambda: jacmem.ClipGrad(0.1)], flow)
    assert_grads(model, expected(grads, 0.1), f"[gpt2 batch of one {flow}]")
    _steps(model, X, y, [jacmem.BatchL2Grad], flow)
    check_against(model, reference, ["batch_l2"])


@pytest.mark.slow
@pytest.mark.parametrize("make, backend", [(vit, "aot_eager"), (gpt2, None)], ids=["vit-aot_eager", "gpt2-inductor"])
def test_a_model_compiled_in_place_is_exact(make, backend):
    """``model.compile()`` compiles the model's calls in place, with no wrapper module: the
    block took the forward for an eager one and swapped timm's ``pos_embed`` and
    ``cls_token`` for watched views, which the compiled forward cannot take (a
    ``TypeError`` from deep in torch). Now as ``torch.compile(model)``: exact, with
    ``aot_eager`` and with the default backend (inductor), whose reuse of buffers gave
    GPT-2's clipped ``.grad`` off by up to 1.6e-3 on entries of order 1e-3
    (:func:`test_the_default_backend_is_exact_on_a_tied_gpt2`)."""
    model, X, y = make()
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    reference = per_sample_grads(model, X, y, cross_entropy)
    graphs = _graphs()
    model.compile() if backend is None else model.compile(backend=backend)
    for _ in range(2):
        clear(model)
        with jacmem.extend(jacmem.ClipGrad(C)):
            cross_entropy(model(X), y, "mean").backward()
    assert_grads(model, expected(grads, C), f"[{make.__name__} compiled in place, {backend or 'inductor'}]")
    clear(model)
    with jacmem.extend(jacmem.BatchL2Grad()):
        cross_entropy(model(X), y, "mean").backward()
    check_against(model, reference, ["batch_l2"])
    assert _graphs() > graphs, "the model ran eagerly: Dynamo made no graph"


@pytest.mark.slow
def test_a_compiled_gpt2_with_gradient_checkpointing_is_exact():
    """HF's gradient checkpointing logs a warning in GPT-2's forward, where torch.compile
    breaks the graph: the embeddings then run eagerly inside the compiled forward, and the
    position embedding's call on ``[1, T]`` ids was refused as a call that may be
    broadcast. It is spread over the batch as a traced call is: exact."""
    model, X, y = gpt2()
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.model.train()  # checkpointing runs in training mode only; no dropout, for the loop
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    grads = per_sample(model, X, y, cross_entropy, "mean")
    C = median_norm(grads)
    reference = per_sample_grads(model, X, y, cross_entropy)
    compiled = torch.compile(model, backend="aot_eager")
    with jacmem.extend(jacmem.ClipGrad(C)) as block:
        cross_entropy(compiled(X), y, "mean").backward()
    assert_grads(model, expected(grads, C), "[gpt2 checkpointed]")
    assert "transformer.wpe (Embedding) ran eagerly" in block.explain()
    clear(model)
    with jacmem.extend(jacmem.BatchL2Grad()):
        cross_entropy(compiled(X), y, "mean").backward()
    check_against(model, reference, ["batch_l2"])


class Prompted(nn.Module):
    """[N, 3, 4] -> [N, 3]: a prompt (an Embedding on one row of ids) repeated over the
    batch before each sample's rows, then a Linear head on their mean."""

    def __init__(self):
        super().__init__()
        self.prompt, self.head = nn.Embedding(5, 4), nn.Linear(4, 3)
        self.register_buffer("ids", torch.arange(2)[None])

    def forward(self, x):
        prompts = self.prompt(self.ids).repeat(x.shape[0], 1, 1)
        return self.head(torch.cat([prompts, x], 1).mean(1))


@pytest.mark.slow
@pytest.mark.parametrize("field", [*FIRST_ORDER, "grad"])
def test_a_compiled_call_on_one_row_before_the_batch_is_refused(field):
    """A call on one row of ids that calls on the batch follow: its output may be
    broadcast over the batch, which a compiled graph cannot follow, so it raises, naming
    the module (eagerly it is followed, and exact). With the rest of the model frozen
    (PEFT's prompt tuning) no call on the batch is recorded: the first-order extensions
    gave the batch's sums, with no word; the end of the pass now raises, as the model's
    input offers no batch of one."""
    extension = FIRST_ORDER.get(field, lambda: jacmem.ClipGrad(1.0))
    model, X, y = Prompted(), torch.randn(N, 3, 4), torch.randint(0, 3, (N,))
    with pytest.raises(RuntimeError, match=r"module '_orig_mod.prompt' \(Embedding\) ran on a batch of one"):
        _steps(model, X, y, [extension], "inside", steps=1)
    model.head.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"'_orig_mod.prompt' ran on a batch of one, but no input|take 1 rows"):
        _steps(model, X, y, [extension], "inside", steps=1)


@pytest.mark.slow
def test_compiled_records_leave_no_entries_behind():
    """What a compiled graph's calls leave in jacmem's tables: the output-gradient hooks
    go with their graph or their block, step after step; a module's slot goes with it."""
    model, X, y = cnn()
    before = set(hooks._SLOTS)  # (those of other tests' models that are still alive)
    for steps in (1, 4):
        _steps(model, X, y, [jacmem.BatchGrad], "inside", steps=steps)
        assert not hooks._TAPPED
    assert len(set(hooks._SLOTS) - before) == 3  # one per module with parameters of its own
    del model
    dynamo.reset()  # the compiled code holds the model
    gc.collect()
    assert not set(hooks._SLOTS) - before


@pytest.mark.slow
def test_inductor_compiles_the_cnn_exactly():
    """The default backend (inductor, a C++ build on CPU), as users run it."""
    model, X, y = cnn()
    reference = per_sample_grads(model, X, y, cross_entropy)
    compiled = torch.compile(model)
    for _ in range(2):
        clear(model)
        with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad()):
            cross_entropy(compiled(X), y, "mean").backward()
    check_against(model, reference, ("grad_batch", "batch_l2"), "[inductor]")


def _graphs() -> int:
    """The number of graphs Dynamo has made in this process (for a compile with the
    default backend, which takes no counter)."""
    return dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_default_backend_is_exact_on_a_tied_gpt2():
    """``torch.compile(model)`` with no backend argument: inductor, which writes new values
    into the buffer of a tensor once its graph needs it no more, in the forward (a layer's
    input that the backward recomputes) and in the backward (an output gradient, after
    jacmem's op): the records kept the forward's inputs and the backward's gradients
    themselves, so ClipGrad's ``.grad`` of GPT-2's second ``c_attn`` was off by 1.6 relative,
    with a threshold that clips nothing too. The records now keep copies, the inputs from
    the backward. The summed gradient ``jacmem::fused`` returns is inductor's buffer too,
    which it added the tied embedding's gradient into: Variance of ``wte`` alone (its
    second moments from the head's gradient and the embedding's index terms) counted the
    embedding's part twice, 13x off. Every first-order extension together and Variance and
    SumGradSquared alone, ClipGrad and two steps of a PrivacyEngine, in float64, against
    the per-sample loop; one compile serves them all."""
    from tests.support.privacy import LR, loader, loop_step

    from jacmem.privacy import PrivacyEngine

    model, X, y = gpt2()
    grads = per_sample(model, X, y, cross_entropy, "mean")
    reference = per_sample_grads(model, X, y, cross_entropy)
    graphs = _graphs()
    compiled = torch.compile(model)
    for C in (median_norm(grads), 1e6):  # one that clips some samples, one that clips none
        for _ in range(2):
            clear(model)
            with jacmem.extend(jacmem.ClipGrad(C)) as block:
                cross_entropy(compiled(X), y, "mean").backward()
            assert "ran eagerly" not in block.explain()
        assert_grads(model, expected(grads, C), f"[gpt2 inductor, ClipGrad({C})]")
    clear(model)
    with jacmem.extend(*[e() for e in FIRST_ORDER.values()]):
        cross_entropy(compiled(X), y, "mean").backward()
    check_against(model, reference, FIRST_ORDER, "[gpt2 inductor]")
    for field in ("variance", "sum_grad_squared"):  # no per-sample gradients: the tied wte's index terms
        clear(model)
        with jacmem.extend(FIRST_ORDER[field]()):
            cross_entropy(compiled(X), y, "mean").backward()
        check_against(model, reference, (field,), f"[gpt2 inductor, {field} alone]")
    assert _graphs() > graphs, "the model ran eagerly: Dynamo made no graph"

    clear(model)
    C = median_norm(grads)  # (Opacus's per-sample gradients of a mean: those of the loss's N-th part, times N)
    twin = copy.deepcopy(model)
    for _ in range(2):
        stepped = loop_step(twin, [(X, y)], C, "flat", reduction="mean")
        with torch.no_grad():
            for p, e in zip(twin.parameters(), stepped):
                p.copy_(e)
    engine = PrivacyEngine()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        private, opt, _ = engine.make_private(
            module=compiled, optimizer=opt, data_loader=loader(X, y), noise_multiplier=0.0, max_grad_norm=C,
            poisson_sampling=False, clipping="flat",
        )  # fmt: skip
        for _ in range(2):
            opt.zero_grad()
            cross_entropy(private(X), y, "mean").backward()
            opt.step()
    finally:
        engine.detach()
    for p, e in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), e.detach(), rtol=1e-10, atol=1e-12)


def test_sequential_compiles_as_one_graph():
    """An ``nn.Sequential`` calls its layers in a loop of torch's own code: jacmem's hooks
    break no graph there, so its forward is one graph, as without jacmem."""
    model, X, y = cnn()
    counter = _steps(model, X, y, [jacmem.BatchGrad], "inside")
    assert counter.frame_count == 1


class Uncompiled(nn.Module):
    """A Linear whose caller torch.compile does not trace."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(12, 5)

    @torch.compiler.disable
    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


@pytest.mark.slow
def test_explain_names_the_modules_that_ran_eagerly():
    """Where torch.compile gives up on a frame (here the ``nn.Sequential``'s, as a
    function it may not trace is called in its loop), the modules it calls run eagerly,
    exact; the block's ``explain()`` names each."""
    model, X, y = cnn()
    model[-1] = Uncompiled()
    reference = per_sample_grads(model, X, y, cross_entropy)
    counter = CompileCounterWithBackend("aot_eager")
    with jacmem.extend(jacmem.BatchGrad()) as block:
        cross_entropy(torch.compile(model, backend=counter)(X), y, "mean").backward()
    check_against(model, reference, ["grad_batch"], "[uncompiled]")
    assert counter.frame_count == 0
    eager = [line.split(" ran eagerly")[0] for line in block.explain().splitlines() if "ran eagerly" in line]
    assert eager == ["_orig_mod.0 (Conv2d)", "_orig_mod.3 (Conv2d)", "_orig_mod.7.inner (Linear)"]


def _compiled_after_first_order(model, X, y) -> tuple[nn.Module, CompileCounterWithBackend]:
    """The model compiled, and its graph made in a first-order block (checked: one, at least)."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    with jacmem.extend(jacmem.BatchL2Grad()):
        cross_entropy(compiled(X), y, "mean").backward()
    assert counter.frame_count >= 1, "the model ran eagerly: Dynamo made no graph"
    return compiled, counter


def test_second_order_is_exact_on_a_compiled_model():
    """DiagGGNExact and DiagHessian (and per sample) of a compiled model, after a
    first-order block made its graph, equal the dense diagonals of the plain model's GGN
    and Hessian; the block runs the model eagerly (no new graph), and the first-order
    graph serves the next first-order block (no recompile)."""
    from tests.support.secondorder_ref import dense, diagonals

    model, X, y = cnn()
    lossf = nn.CrossEntropyLoss()
    compiled, counter = _compiled_after_first_order(model, X, y)
    frames = counter.frame_count
    exts = [jacmem.DiagGGNExact(), jacmem.DiagHessian(), jacmem.BatchDiagGGNExact(), jacmem.BatchDiagHessian()]
    with jacmem.extend(*exts):
        lossf(compiled(X), y).backward()
    (ggn, hess), (ggn_n, hess_n) = dense(model, lossf, X, y), dense(model, lossf, X, y, per_sample=True)
    refs = {"diag_ggn_exact": ggn, "diag_h": hess, "diag_ggn_exact_batch": ggn_n, "diag_h_batch": hess_n}
    for field, M in refs.items():
        for name, ref in diagonals(model, M).items():
            got = getattr(model.get_parameter(name), field)
            torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-7, msg=f"{field} of {name}")
    with jacmem.extend(jacmem.BatchL2Grad()):
        cross_entropy(compiled(X), y, "mean").backward()
    assert counter.frame_count == frames, f"recompiled: {frames} -> {counter.frame_count}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, extension",
    [(cnn, jacmem.DiagGGNExact), (cnn, jacmem.KFAC), (gpt2, jacmem.DiagGGNExact), (gpt2, jacmem.BatchDiagGGNExact)],
    ids=["cnn-DiagGGNExact", "cnn-KFAC", "gpt2-DiagGGNExact", "gpt2-BatchDiagGGNExact"],
)
def test_second_order_after_first_order_on_a_compiled_model_equals_eager(make, extension):
    """A second-order block on a compiled model whose graph a first-order block made (the
    Dynamo graph the first-order engine traced, without the second-order engine's
    torch-function mode): its results equal an eager block's, step after step, with no
    new graph."""
    model, X, y = make()
    field = extension.savefield

    def curvature(run) -> dict[str, object]:
        for p in model.parameters():
            p.__dict__.pop(field, None)
        torch.manual_seed(1)  # (KFAC samples its loss's labels)
        with jacmem.extend(extension()):
            cross_entropy(run(X), y, "mean").backward()
        return {n: getattr(p, field) for n, p in model.named_parameters() if hasattr(p, field)}

    eager = curvature(model)
    compiled, counter = _compiled_after_first_order(model, X, y)
    frames = counter.frame_count
    for step in range(2):
        got = curvature(compiled)
        assert got.keys() == eager.keys() and got, f"step {step}: {sorted(got)} != {sorted(eager)}"
        for name, ref in eager.items():
            torch.testing.assert_close(got[name], ref, atol=1e-12, rtol=1e-10, msg=f"step {step}: {field} of {name}")
    assert counter.frame_count == frames, f"recompiled: {frames} -> {counter.frame_count}"


def test_code_compiled_before_the_hooks_raises_naming_the_fix():
    """A compiled model's first forward outside any block: torch.compile built its code
    without jacmem's hooks and reuses it inside the block, where nothing would be
    recorded; the block raises at the end of that forward, and the fix works."""
    model, X, y = cnn()
    reference = per_sample_grads(model, X, y, cross_entropy)
    compiled = torch.compile(model, backend="aot_eager")
    cross_entropy(compiled(X), y, "mean").backward()
    with pytest.raises(RuntimeError, match=r"\(Sequential\).*torch\.compile.*torch\.compiler\.reset\(\)"):
        with jacmem.extend(jacmem.BatchGrad()):
            compiled(X)
    torch.compiler.reset()
    clear(model)
    with jacmem.extend(jacmem.BatchGrad()):
        cross_entropy(compiled(X), y, "mean").backward()
    check_against(model, reference, ["grad_batch"], "[after reset]")


@pytest.mark.slow
def test_compiled_layers_compute_their_gradient_once_as_eager_ones_do():
    """A compiled Conv2d or Linear runs through ``Fused`` (as ``ComputeOnce`` in an eager
    forward): the block gives its weight gradient from the pass of its per-sample
    quantities, so it picks the same strategies as in an eager step (explain()), and the
    compiled backward computes no gradient of its own for it."""
    model, X, y = cnn()
    reference = per_sample_grads(model, X, y, cross_entropy)
    explained = {}
    for mode in ("eager", "compiled"):
        run = torch.compile(model, backend="aot_eager") if mode == "compiled" else model
        clear(model)
        with jacmem.extend(jacmem.BatchL2Grad()) as block:
            cross_entropy(run(X), y, "mean").backward()
        check_against(model, reference, ("grad", "batch_l2"), f"[{mode}]")
        explained[mode] = block.explain().replace("_orig_mod.", "")
    assert explained["compiled"] == explained["eager"]
    assert all("; grad <- " in line for line in explained["compiled"].splitlines())


@pytest.mark.slow
def test_a_fused_graph_backward_after_its_block_gives_autograd_gradients(monkeypatch):
    """A graph traced inside a first-order block runs its layers through ``Fused``; where
    its backward comes after the block has closed (its records are gone), the layers'
    gradients are those of their forward run again: exact."""
    model, X, y = cnn()
    plain = copy.deepcopy(model)
    cross_entropy(plain(X), y, "mean").backward()
    compiled = torch.compile(model, backend="aot_eager")
    with jacmem.extend(jacmem.BatchGrad()):
        cross_entropy(compiled(X), y, "mean").backward()
    clear(model)
    recomputed, original = [], hooks._recomputed
    monkeypatch.setattr(
        hooks, "_recomputed", lambda module, *args: recomputed.append(module) or original(module, *args)
    )
    with jacmem.extend(jacmem.BatchGrad()):
        loss = cross_entropy(compiled(X), y, "mean")
    with pytest.warns(UserWarning, match="after the block had closed"):
        loss.backward()
    assert len(recomputed) == 3  # the two Conv2d and the Linear
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10, msg=name)


class EmbeddedConv(nn.Module):
    """Token embeddings (optionally layer-normed) viewed as images, into a grouped strided
    convolution: the gradient of the embedding's (or the norm's) output reaches its
    records as a view of the convolution's input gradient."""

    def __init__(self, norm: bool):
        super().__init__()
        self.emb = nn.Embedding(11, 4, padding_idx=0)
        self.norm = nn.LayerNorm(4) if norm else nn.Identity()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: Tensor) -> Tensor:  # ids [N, 6] -> logits [N, 3]
        h = self.conv(self.norm(self.emb(ids)).view(-1, 2, 3, 4))
        return self.head(torch.tanh(h).flatten(1))


@pytest.mark.parametrize("norm", [True, False], ids=["layernorm", "embedding"])
def test_the_default_backend_is_exact_where_a_recorded_output_is_viewed(norm):
    """Inductor lays the convolution's input gradient out channels-last; while
    ``jacmem::tapped`` was declared as writing its gradient, inductor handed it the view's
    traced (contiguous) strides on that buffer: the norm's (the embedding's) per-sample
    gradients came out of rows shuffled within each sample, 0.03-0.10 off."""
    torch.manual_seed(0)
    model = EmbeddedConv(norm).double()
    X, y = torch.randint(0, 11, (5, 6)), torch.randint(0, 3, (5,))
    reference = per_sample_grads(model, X, y, cross_entropy)
    compiled = torch.compile(model)
    with jacmem.extend(jacmem.BatchGrad()):
        cross_entropy(compiled(X), y, "mean").backward()
    check_against(model, reference, ("grad_batch",), "[inductor, viewed output]")
