"""One cell of the conformance matrix: run (once per model and setting) and check.

:func:`check` is the matrix's whole judgement of a cell, called by ``test_matrix.py``
and, under a planted fault, by ``test_can_fail.py``. A cell passes when, on every rank,
the quantity equals the oracle for every trainable parameter (float64: rtol 1e-9; a
setting's own tolerance where it declares one), with no jacmem warning beside it and,
in a compile setting, inductor having compiled the graphs; or when it raises the
declared error, having written nothing and left no hook.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch

from . import declarations, oracle
from .models import MODELS, Model
from .quantities import QUANTITIES, Quantity
from .settings import SETTINGS, Outcome, Setting

_RUNS: dict[tuple[str, str], dict] = {}
_EXPECTED: dict[tuple, oracle.Expected] = {}


def expected(spec: Model, batch_first: bool, rows: slice, one_sample: bool) -> oracle.Expected:
    """The oracle for ``spec``'s model on the samples ``rows`` of its batch (the first of
    them alone with ``one_sample``)."""
    key = (spec.name, batch_first, rows.start, rows.stop, one_sample)
    if key not in _EXPECTED:
        model, X, y = spec.build(batch_first)
        axis = 0 if batch_first else 1
        n = X.shape[axis]
        start, stop, _ = rows.indices(n)
        X, y = X.narrow(axis, start, stop - start), y[start:stop]
        if one_sample:
            X, y = X.narrow(axis, 0, 1), y[:1]
        _EXPECTED[key] = oracle.Expected(model, spec.loss(), X, y, axis, threshold(spec))
    return _EXPECTED[key]


def threshold(spec: Model) -> float:
    """The model's flat clipping threshold, from the whole batch's per-sample norms."""
    key = (spec.name, "threshold")
    if key not in _EXPECTED:
        model, X, y = spec.build()
        _EXPECTED[key] = oracle.median_threshold(oracle.per_sample_grads(model, spec.loss(), X, y), X.shape[0])
    return _EXPECTED[key]


def applicable(model: str, setting: str) -> list[Quantity]:
    return [q for q in QUANTITIES.values() if declarations.not_applicable(model, setting, q.name) is None]


def outcomes(model: str, setting: str, fresh: str | None = None) -> dict:
    """quantity -> [(rows, Outcome)]: every applicable quantity, run once per pair
    (``fresh``: only that quantity, run again, not kept)."""
    key = (model, setting)
    if fresh or key not in _RUNS:
        if not fresh:
            _forget_all_but(model)
        spec, s = MODELS[model], SETTINGS[setting]
        tmp = Path(tempfile.mkdtemp(prefix=f"conformance-{model}-{setting}-"))
        qs = [QUANTITIES[fresh]] if fresh else applicable(model, setting)
        result = s.runner(spec, qs, threshold(spec), tmp)
        if fresh:
            return result
        _RUNS[key] = result
    return _RUNS[key]


def _forget_all_but(model: str) -> None:
    """Drop the kept runs, and the other models' oracles: a worker runs one (model, setting)
    pair's cells together (``xdist_group``), and resnet18's second-order results alone
    take gigabytes, which every pair kept at once would multiply past the machine's memory."""
    _RUNS.clear()
    for key in [k for k in _EXPECTED if k[0] != model]:
        del _EXPECTED[key]
    gc.collect()


def _close(
    actual: torch.Tensor, want: torch.Tensor, tol: float | None, what: str, scale: float = 0.0, slack=None
) -> None:
    """``actual`` equals ``want``: float64's rtol 1e-9, or ``tol``; the absolute floor is
    relative to the largest entry of ``want`` or ``scale`` (the quantity's largest over
    every parameter: a gradient that is zero in exact arithmetic, as a key bias's, is
    judged against the others). ``slack`` (with ``tol``): what each entry may be off
    beyond that (:func:`_clip_slack`)."""
    assert actual.shape == want.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(want.shape)}"
    if slack is not None and tol is not None:
        diff = actual - want.to(actual.dtype)
        actual = want.to(actual.dtype) + diff.sign() * (diff.abs() - slack.to(actual.dtype)).clamp(min=0)
    scale = max(want.abs().max().item() if want.numel() else 0.0, scale if tol is not None else 0.0, 1e-30)
    if tol is None:
        rtol, atol = 1e-9, 1e-11 * max(scale, 1.0)
    else:
        rtol, atol = tol, max(tol * scale, 1e-11)  # the float64 floor too: a variance of one sample is 0
    torch.testing.assert_close(actual, want.to(actual.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _rows_for(setting: Setting, q: Quantity, rows: slice) -> tuple[slice, slice]:
    """(the oracle's batch, the rows of it the rank holds). DDP and FSDP2 give the
    global batch's first order, clipping and step (per-sample rows: the rank's own);
    second order, and every quantity of a plain model in a group, the rank's batch. The
    global batch is the samples the two ranks hold, equal shares: of an odd batch (N = 3:
    GPT-2, ResNet-18) the last sample is on no rank."""
    if setting.name in ("ddp", "fsdp2") and q.kind != "second":
        whole = setting.name == "fsdp2" and q.savefield == "grad_batch"  # a DTensor over the global batch
        held = slice(0, 2 * (rows.stop - rows.start))
        return held, rows if q.per_sample and not whole else slice(None)
    return rows, slice(None)


def check(model: str, setting: str, quantity: str, fresh: bool = False) -> str:
    """Judge one cell; returns ``"exact"``, ``"refused"`` or ``"structural"``; raises
    AssertionError where the cell fails. ``fresh``: run the cell's quantity again (a
    planted fault), rather than take the pair's kept run."""
    spec, s, q = MODELS[model], SETTINGS[setting], QUANTITIES[quantity]
    runs = outcomes(model, setting, quantity if fresh else None)[quantity]
    declared = declarations.error(setting, quantity, model)
    status = "exact"
    for rows, out in runs:
        where = f"[{model} x {setting} x {quantity}, rows {rows}]"
        if declared:
            status = "refused"
            _check_refused(out, declared, where)
            continue
        if out.error is not None:
            raise AssertionError(f"{where}: raised {type(out.error).__name__}: {out.error}") from out.error
        # a notice that a module is recomputed per sample is about speed, beside an exact result;
        # any other warning beside a result fails the cell
        said = [w for w in out.warnings if "recomputed" not in w]
        assert not said, f"{where}: jacmem warned: {said}"
        if s.compiled:
            assert out.inductor, f"{where}: inductor compiled no graph (another backend, or no graph at all)"
        status = _check_values(spec, s, q, rows, out, where)
    return status


def _check_refused(out: Outcome, declared: tuple[str, str], where: str) -> None:
    cls, fragment = declared
    assert out.error is not None, f"{where}: expected {cls} ({fragment!r}), got a result"
    names = {c.__name__ for c in type(out.error).__mro__} | {getattr(out.error, "typename", "")}
    got = getattr(out.error, "typename", type(out.error).__name__)
    assert cls in names, f"{where}: expected {cls}, got {got}: {out.error}"
    assert fragment in str(out.error), f"{where}: {cls} without {fragment!r}: {out.error}"
    assert not out.leftovers, f"{where}: the error left results or hooks behind: {out.leftovers}"


def _check_values(spec: Model, s: Setting, q: Quantity, rows: slice, out: Outcome, where: str) -> str:
    batch, held = _rows_for(s, q, rows)
    e = expected(spec, s.batch_first, batch, q.one_sample)
    missing = sorted(set(e.shapes) - set(out.values))
    assert not missing, f"{where}: no {q.savefield} on {missing}"
    exact = (
        q.expect is not None
        and (not q.needs or getattr(spec, q.needs))
        and not declarations.unchecked(spec.name, q.name)
    )
    tol = s.tolerance if s.tolerance is not None else spec.tolerance
    wants = {name: q.expect(e, name) for name in e.shapes} if exact else {}
    scale = max((w.abs().max().item() for w in wants.values() if w.numel()), default=0.0)
    for name in e.shapes:
        got = out.values[name]
        assert torch.isfinite(got).all(), f"{where} {name}: not finite"
        if not exact:
            if q.per_sample:
                rows = e.n if held == slice(None) else held.stop - held.start
                assert got.shape == (rows, *e.shapes[name]), f"{where} {name}: shape {tuple(got.shape)}"
            continue
        want = wants[name]
        if q.per_sample:
            want = want[held]
        if s.name == "accumulate" and q.kind in ("first", "clip"):
            _check_accumulated(spec, q, e, out, name, where)
            if q.savefield == "grad":  # ClipGrad's result is .grad: the sum of both passes, checked above
                continue
        slack = None
        if s.name == "autocast_bf16" and q.kind == "clip":
            slack = _clip_slack(e, name)
        elif s.name == "autocast_bf16" and q.autocast_slack is not None:
            slack = q.autocast_slack(e, name, tol)
            slack = slack[held] if q.per_sample else slack
        _close(got, want, tol, f"{where} {name} {q.savefield}", scale, slack)
    return "exact" if exact else "structural"


def _clip_slack(e: oracle.Expected, name: str) -> torch.Tensor:
    """ClipGrad under bfloat16 autocast: what the clip factors' rounding may move each entry
    of ``Σ_n c_n g_n`` by. The factors ``c_n`` come from norms of 16-bit products, within
    bfloat16's ``eps`` (7.8e-3) of the float64 norms (BERT's: 1.4e-3), and an entry that
    cancels over the samples moves by their error times ``Σ_n c_n |g_n|``, not its own
    size. BERT's ``classifier.bias``: entries near 2e-3 that sum terms of 1.33, moved by
    2.0e-3 (1.4e-3 x 1.33), beyond 5e-2 of the largest entry (0.035); the per-sample loop
    under the same autocast is further off the float64 oracle (2.9e-3)."""
    return torch.finfo(torch.bfloat16).eps * e.clipped_magnitude[name]


def _check_accumulated(spec: Model, q: Quantity, e: oracle.Expected, out: Outcome, name: str, where: str) -> None:
    """``.grad`` after two passes: the sum of the first batch's and the model's."""
    from .settings import _second_batch

    key = (spec.name, "first batch")
    if key not in _EXPECTED:
        model, X, y = spec.build()
        X2, y2 = _second_batch(X, y)
        _EXPECTED[key] = oracle.Expected(model, spec.loss(), X2, y2, 0, threshold(spec))
    first = _EXPECTED[key]
    one = first.clipped if q.kind == "clip" else first.first["grad"]
    two = e.clipped if q.kind == "clip" else e.first["grad"]
    _close(out.grad[name], one[name] + two[name], spec.tolerance, f"{where} {name} accumulated .grad")
