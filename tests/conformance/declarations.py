"""What the conformance matrix declares, once: the cells that do not apply (with the
reason), the cells that raise a documented error (its class and a fragment of its
message), and the cells that fail today for a known bug (issue 36's items), which the
lead turns back into exact cells as the fixes land. :func:`settings_table` renders the
quantity x setting part as the docs' "Settings" table (``docs/guide/support.rst``).

Imports nothing heavy: the docs' Sphinx extension imports it.
"""

from __future__ import annotations

FIRST = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")
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
    # the logits reach the loss through a transpose ([N, T, V] -> [N, V, T]): no module knowledge for
    # the Hessian's residual terms or KFRA's propagation through it
    (TOKEN_MODELS, ("DiagHessian", "BatchDiagHessian", "HMP", "PCHMP", "KFRA")): ("ChainError", "TransposeBackward0"),
    # GPT-2's tied wte/lm_head: the curvature's cross terms between the calls
    (("gpt2",), ("GGNMP", "KFLR", "KFACEF", "EKFAC", "KFAC")): ("NotImplementedError", "used by more than one call"),
    # a registered layer with first-order derivatives only: no Jacobian to pass curvature through
    (("zero_dim",), HESSIAN + ("KFRA",)): ("ChainError", "cannot backpropagate curvature"),
    # a LayerNorm's second derivative, and KFRA's propagation through the attention's reshapes
    (("transformer_encoder",), HESSIAN + ("KFRA",)): ("ChainError", "cannot backpropagate curvature"),
    (("bert", "vit"), HESSIAN): ("NotImplementedError", "cannot pass curvature through module"),
    (("bert", "vit"), ("KFRA",)): ("ChainError", "Reshape"),
}

#: models that lack a setting's prerequisite: (model, setting) -> reason
MODEL_NOT_APPLICABLE: dict[tuple[str, str], str] = {}
BATCH_FIRST_MODELS = ("lstm", "gru", "transformer_encoder")

#: cells the oracle cannot check exactly, beyond the quantities' own rule: (model, quantities) -> reason
UNCHECKED: dict[tuple[str, tuple[str, ...]], str] = {
    ("resnet18", SECOND): "the dense float64 GGN of 11M parameters is out of reach; the CNN row covers convs and BN",
}

#: cells that fail today: (models or "*", settings or "*", quantities or "*") -> reason, a strict
#: xfail (a cell with a declared error is judged by it instead). "issue 36 item N": known, being
#: fixed; "new": found by this matrix
XFAIL: dict[tuple, str] = {
    (("transformer_encoder", "vit"), "*", SECOND): (
        "issue 36 item 3: second order skips nn.MultiheadAttention and root parameters (pos_embed, cls_token), "
        "with a warning"
    ),
    (("zero_dim",), "*", ("BatchL2Grad", "ClipGrad", "PrivacyEngine")): (
        "issue 36 item 6: a registered layer's 0-dim parameter: IndexError in the norms"
    ),
    (("lstm", "gru"), "*", SECOND): (
        "new: second order on nn.LSTM/nn.GRU warns 'not supported ... its parameters get nothing' and leaves "
        "them without a result, where it should raise"
    ),
    (("cnn_bn", "zero_dim"), "*", KRONECKER + ("KFRA",)): (
        "new: KFLR/KFRA/KFACEF/EKFAC/KFAC warn 'has no Kronecker factors for BatchNorm2d / a registered layer' "
        "and leave its parameters without a result, where they should raise"
    ),
    (("llama",), tuple(s for s in SETTING_ORDER if s != "autocast_bf16"), KRONECKER): (
        "new: KFLR/KFACEF/EKFAC/KFAC warn 'has no Kronecker factors for LlamaRMSNorm' and leave it without a "
        "result (not under bfloat16 autocast, where it gets one)"
    ),
    (("vit",), "*", ("EKFAC",)): "new: EKFAC warns 'no eigenvalue correction for Conv2d' and leaves it nothing",
    (("zero_dim",), "*", ("GGNMP",)): (
        "new: GGNMP warns that a module called positionally 'was called with keyword or non-tensor arguments' "
        "and leaves it nothing"
    ),
    (("llama",), tuple(s for s in SETTING_ORDER if s != "autocast_bf16"), ("GGNMP",)): (
        "new: GGNMP warns that a module called positionally 'was called with keyword or non-tensor arguments' "
        "and leaves it nothing (not under bfloat16 autocast, where LlamaRMSNorm gets its product)"
    ),
}


def _lookup(table, quantity: str, setting: str):
    for (qs, s), value in table.items():
        if quantity in qs and s == setting:
            return value
    return None


def not_applicable(model: str, setting: str, quantity: str) -> str | None:
    """Why the cell does not apply, or None."""
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
    """Why the cell fails today (a strict xfail), or None; never for a cell with a declared
    error, or one that does not apply."""
    if error(setting, quantity, None if model == "*" else model) or not_applicable(model, setting, quantity):
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
