"""What the conformance matrix declares, once: the cells that do not apply (with the
reason), the cells that raise a documented error (its class and a fragment of its
message), and the cells that fail today for a known bug (issue 36's items), which the
lead turns back into exact cells as the fixes land. :func:`settings_table` renders the
quantity x setting part as the docs' "Settings" table (``docs/guide/support.rst``).

Imports nothing heavy: the docs' Sphinx extension imports it.
"""

from __future__ import annotations

FIRST = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance", "BatchGradProjection", "BatchGradProjectionDense")
CLIP = ("ClipGrad",)
PRIVATE = ("PrivacyEngine",)
SECOND = (
    "DiagGGNExact", "BatchDiagGGNExact", "DiagHessian", "BatchDiagHessian", "DiagGGNMC", "BatchDiagGGNMC",
    "SqrtGGNExact", "SqrtGGNMC", "GGNMP", "HMP", "PCHMP", "KFLR", "KFRA", "KFACEF", "EKFAC", "KFAC",
)  # fmt: skip
HESSIAN = ("DiagHessian", "BatchDiagHessian", "HMP", "PCHMP")
KRONECKER = ("KFLR", "KFACEF", "EKFAC", "KFAC")
QUANTITY_ORDER = FIRST + CLIP + PRIVATE + SECOND
SETTING_ORDER = (
    "extend", "track", "compile", "model_compile", "ddp", "fsdp2", "process_group", "autocast_bf16",
    "batch_first_false", "accumulate", "create_graph",
)  # fmt: skip

#: (quantities, setting) -> why the cell does not apply (it is not run)
NOT_APPLICABLE: dict[tuple[tuple[str, ...], str], str] = {
    (PRIVATE, "track"): "the PrivacyEngine installs its own hooks at make_private; there is no block to track for",
    (PRIVATE, "accumulate"): "accumulation over batches is the DP optimizer's (Opacus's virtual steps), not a block's",
    (PRIVATE, "create_graph"): "a private step does not differentiate its own update",
}

#: (quantities, setting) -> (error class name, message fragment): raised before any result is written
ERRORS: dict[tuple[tuple[str, ...], str], tuple[str, str]] = {
    (SECOND, "fsdp2"): ("RuntimeError", "do not support FSDP"),
    (SECOND, "track"): ("RuntimeError", "need the forward pass inside the block"),
    (SECOND, "batch_first_false"): ("ValueError", "batch_first=False applies to first-order extensions"),
}

#: (models, quantities) -> (error class name, message fragment): a model's documented refusal,
#: in every setting that runs the quantity (a setting's own error, above, comes first)
TIED_LMS = ("gpt2", "lora_gpt2")
TOKEN_MODELS = ("gpt2", "lora_gpt2", "llama")
MODEL_ERRORS: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[str, str]] = {
    # no curvature rules for these layers: UnsupportedCurvatureError before the backward, naming them
    # (checked before the chain is walked, so before the transposed logits' ChainError: first match wins)
    (("lstm", "gru"), SECOND): ("UnsupportedCurvatureError", "rnn' ("),
    (("cnn_bn",), KRONECKER + ("KFRA",)): ("UnsupportedCurvatureError", "(BatchNorm2d)"),
    (("zero_dim",), HESSIAN + KRONECKER + ("KFRA", "GGNMP")): ("UnsupportedCurvatureError", "(ZeroDimScale)"),
    (("llama",), HESSIAN + KRONECKER + ("KFRA", "GGNMP")): ("UnsupportedCurvatureError", "(LlamaRMSNorm)"),
    (("gpt2", "bert", "vit", "transformer_encoder"), ("KFRA",)): ("UnsupportedCurvatureError", "(LayerNorm)"),
    (("transformer_encoder",), HESSIAN + KRONECKER + ("GGNMP",)): (
        "UnsupportedCurvatureError",
        "(MultiheadAttention)",
    ),
    (("vit",), HESSIAN + KRONECKER + ("GGNMP",)): ("UnsupportedCurvatureError", "'pos_embed' of module"),
    # the logits reach the loss through a transpose ([N, T, V] -> [N, V, T]): no module knowledge for
    # the Hessian's residual terms or KFRA's propagation through it
    (TOKEN_MODELS, ("DiagHessian", "BatchDiagHessian", "HMP", "PCHMP", "KFRA")): ("ChainError", "TransposeBackward0"),
    # GPT-2's tied wte/lm_head: the curvature's cross terms between the calls
    (("gpt2",), ("GGNMP", "KFLR", "KFACEF", "EKFAC", "KFAC")): ("NotImplementedError", "used by more than one call"),
    (("bert",), HESSIAN): ("NotImplementedError", "cannot pass curvature through module"),
    (("embedded_conv",), ("EKFAC",)): ("UnsupportedCurvatureError", "no eigenvalue correction for Conv2d"),
}

#: models that lack a setting's prerequisite: (model, setting) -> reason
_NO_RNN_GRAPH = (
    "Dynamo does not trace nn.LSTM/nn.GRU (torch._dynamo.config.allow_rnn is off by default): the compiled "
    "forward runs them eagerly, which the extend column covers"
)
MODEL_NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("lstm", "compile"): _NO_RNN_GRAPH,
    ("gru", "compile"): _NO_RNN_GRAPH,
    ("lstm", "model_compile"): _NO_RNN_GRAPH,
    ("gru", "model_compile"): _NO_RNN_GRAPH,
    ("zero_dim", "fsdp2"): "FSDP2's fully_shard refuses scalar parameters ('Change scale to a 1D tensor')",
}
BATCH_FIRST_MODELS = ("lstm", "gru", "transformer_encoder")

#: cells the oracle cannot check exactly, beyond the quantities' own rule: (model, quantities) -> reason
UNCHECKED: dict[tuple[str, tuple[str, ...]], str] = {
    ("resnet18", SECOND): "the dense float64 GGN of 11M parameters is out of reach; the CNN row covers convs and BN",
}

#: cells that fail today: (models or "*", settings or "*", quantities or "*") -> reason, a strict
#: xfail (also over a declared error the cell does not raise). "issue 36 item N": known, being
#: fixed; "new": found by this matrix
XFAIL: dict[tuple, str] = {
    (("lstm", "gru"), "fsdp2", FIRST + CLIP + PRIVATE): (
        "new: under FSDP2 the RNNs' fused strategy reads a parameter FSDP2 has resharded ('setStorage: ... out of "
        "bounds for storage of size 0'): an error naming the module, not a number, but a refusal of valid input"
    ),
    (("transformer_encoder",), "fsdp2", CLIP + PRIVATE): (
        "new: ClipGrad under FSDP2 on nn.MultiheadAttention raises torch's 'aten.addmm.default got mixed "
        "torch.Tensor and DTensor': a refusal of valid input"
    ),
    (("llama",), "autocast_bf16", HESSIAN + KRONECKER + ("GGNMP",)): (
        "new: under bfloat16 autocast LlamaRMSNorm's weight is not refused up front: the Kronecker kinds and GGNMP "
        "give it a result (checked against the oracle for GGNMP only), and the Hessian kinds raise ChainError at "
        "the transposed logits instead of UnsupportedCurvatureError"
    ),
}


def _lookup(table, quantity: str, setting: str):
    for (qs, s), value in table.items():
        if quantity in qs and s == setting:
            return value
    return None


#: (model, quantities) -> why those cells are not run, in any setting
MODEL_QUANTITIES_NOT_RUN: dict[tuple[str, tuple[str, ...]], str] = {
    ("resnet18", SECOND): (
        "one run of the second-order kinds on torchvision's resnet18 (11M parameters, batch 3) went past this "
        "machine's 24 GB (a worker OOM-killed at 23.8 GB); the CNN row and "
        "tests/derivatives/test_functional_second_order.py::test_resnet18_diagonals cover its layers"
    ),
}


def not_applicable(model: str, setting: str, quantity: str) -> str | None:
    """Why the cell does not apply, or None."""
    for (m, qs), reason in MODEL_QUANTITIES_NOT_RUN.items():
        if m == model and quantity in qs:
            return reason
    if setting == "batch_first_false" and model not in BATCH_FIRST_MODELS:
        return f"{model} has no batch_first argument"
    return MODEL_NOT_APPLICABLE.get((model, setting)) or _lookup(NOT_APPLICABLE, quantity, setting)


#: (model, setting) -> (error class name, message fragment) for every quantity of the kinds named
MODEL_SETTING_ERRORS: dict[tuple[str, str], tuple[str, str]] = {
    # the root module holds `pos` and returns [N, C] for the loss: under batch_first=False every module
    # that jacmem records must keep the batch on axis 1
    ("transformer_encoder", "batch_first_false"): ("ValueError", "must take the batch on axis 1"),
}


def error(setting: str, quantity: str, model: str | None = None) -> tuple[str, str] | None:
    """The declared error of the cell: the setting's, else the model's in that setting, else the model's."""
    found = _lookup(ERRORS, quantity, setting)
    if found or model is None:
        return found
    if (model, setting) in MODEL_SETTING_ERRORS:
        return MODEL_SETTING_ERRORS[(model, setting)]
    for (models, qs), value in MODEL_ERRORS.items():
        if model in models and quantity in qs:
            return value
    return None


def unchecked(model: str, quantity: str) -> str | None:
    for (m, qs), reason in UNCHECKED.items():
        if m == model and quantity in qs:
            return reason
    return None


def _matches(key, value: str) -> bool:
    return key == "*" or value == key or (isinstance(key, tuple) and value in key)


def xfail(model: str, setting: str, quantity: str) -> str | None:
    """Why the cell fails today (a strict xfail), or None; never for a cell that does not
    apply. A cell with a declared error is xfail where it does not raise that error."""
    if not_applicable(model, setting, quantity):
        return None
    for (m, s, q), reason in XFAIL.items():
        if m == "*" and model == "*" or model != "*" and _matches(m, model):
            if _matches(s, setting) and _matches(q, quantity):
                return reason
    return None


def settings_table() -> str:
    """The quantity x setting table, as Markdown: ``exact``, ``error``, ``n.a.`` or ``wrong
    today`` (a strict xfail of every model: a known bug), the reasons as numbered notes below."""
    notes: list[str] = []
    lines = [
        "| quantity | " + " | ".join(f"`{s}`" for s in SETTING_ORDER) + " |",
        "|---|" + "---|" * len(SETTING_ORDER),
    ]
    for q in QUANTITY_ORDER:
        cells = []
        for s in SETTING_ORDER:
            reason, err, bug = _lookup(NOT_APPLICABLE, q, s), error(s, q), xfail("*", s, q)
            if reason:
                label, text = "n.a.", f"n.a.: {reason}"
            elif err:
                label, text = "error", f"raises `{err[0]}` (its message says: {err[1]})"
            elif bug:
                label, text = "wrong today", f"a known bug: {bug}"
            else:
                cells.append("exact")
                continue
            if text not in notes:
                notes.append(text)
            cells.append(f"{label} [{notes.index(text) + 1}]")
        lines.append(f"| `{q}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- [{i + 1}] {t}" for i, t in enumerate(notes)) + "\n"
