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
    (SECOND, "fsdp2"): ("NotImplementedError", "FSDP"),
    (SECOND, "track"): ("RuntimeError", "need the forward pass inside the block"),
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
}

#: models that lack a setting's prerequisite: (model, setting) -> reason
MODEL_NOT_APPLICABLE: dict[tuple[str, str], str] = {}
BATCH_FIRST_MODELS = ("lstm", "gru", "transformer_encoder")

#: cells the oracle cannot check exactly, beyond the quantities' own rule: (model, quantities) -> reason
UNCHECKED: dict[tuple[str, tuple[str, ...]], str] = {
    ("resnet18", SECOND): "the dense float64 GGN of 11M parameters is out of reach; the CNN row covers convs and BN",
}

#: known bugs of issue 36: (model or "*", setting or "*", quantity or "*") -> reason; strict xfail
XFAIL: dict[tuple[str, str, str], str] = {
    ("*", "process_group", "PrivacyEngine"): (
        "issue 36 item 2: a plain model made private on each rank of a group gets the distributed optimizer "
        "and its clipped sums all-reduced over WORLD"
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


def error(setting: str, quantity: str, model: str | None = None) -> tuple[str, str] | None:
    """The declared error of the cell: the setting's, else the model's."""
    found = _lookup(ERRORS, quantity, setting)
    if found or model is None:
        return found
    for (models, qs), value in MODEL_ERRORS.items():
        if model in models and quantity in qs:
            return value
    return None


def unchecked(model: str, quantity: str) -> str | None:
    for (m, qs), reason in UNCHECKED.items():
        if m == model and quantity in qs:
            return reason
    return None


def xfail(model: str, setting: str, quantity: str) -> str | None:
    for (m, s, q), reason in XFAIL.items():
        if m in ("*", model) and s in ("*", setting) and q in ("*", quantity):
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
