"""Private training: one DP-SGD step against one ordinary SGD step, jacmem beside Opacus 1.6.

``python -m benchmarks.dp`` (or ``python -m benchmarks --dp``; ``make bench`` runs it
after the main benchmark) runs, per (model, engine), two processes: one that times a
private step (forward, backward, clip, noise, update) and an ordinary SGD step of an
untouched copy of the model alternately, step by step, and takes the median of the
per-step ratios (a shared machine's load moves both alike); and one for the peak memory
of the private step, set against that of a process running the ordinary step. The
engines: jacmem's :class:`jacmem.privacy.PrivacyEngine`, Opacus's ``PrivacyEngine`` with
its default per-sample hooks (``GradSampleModule``), and Opacus's ghost clipping
(``grad_sample_mode="ghost"``: two backward passes). Each with flat clipping, ``C = 1``,
``σ = 1``, no Poisson sampling (the batch is the benchmark's own, the same every step),
plain SGD. An engine that refuses a model is recorded as "fails: <reason>".

Memory: as in :mod:`benchmarks.harness` (glibc returning every freed buffer over 64 KiB at
once): the peak resident set during two steps after one warm-up, above the resident
set after setup. The table is written to BENCHMARKS.md between ``<!-- dp:start -->``
and ``<!-- dp:end -->``; ``--quick``: tiny sizes, one repeat, written to
``out/dp-quick.md`` (it checks the harness).
"""

from __future__ import annotations

import copy
import gc
import re
import statistics
import sys
import time
import warnings

from benchmarks import harness

ROOT = harness.ROOT
START, END = "<!-- dp:start -->", "<!-- dp:end -->"
MODELS = ("vit-tiny", "gpt2", "seed-cnn-256")
ENGINES = ("jacmem", "opacus:hooks", "opacus:ghost")
LABELS = {"jacmem": "jacmem", "opacus:hooks": "Opacus 1.6 hooks", "opacus:ghost": "Opacus 1.6 ghost clipping"}
#: the targets: a DP step over an ordinary one, in time and in peak memory
TARGET = 1.2
LR, SIGMA, C = 0.1, 1.0, 1.0


def _loader(X, y):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(X, y), batch_size=X.shape[0])


def prepare(engine: str, model, X, y, lossfunc=None):
    """A ``step()``: one SGD step of ``model`` on ``(X, y)`` with the loss ``lossfunc``
    (by default ``nn.CrossEntropyLoss()``), private with ``engine`` (or ``"plain"``)."""
    import torch
    from torch import nn

    lossfunc = lossfunc or nn.CrossEntropyLoss()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    private = dict(noise_multiplier=SIGMA, max_grad_norm=C, poisson_sampling=False)
    if engine == "jacmem":
        from jacmem.privacy import PrivacyEngine

        model, opt, _ = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=_loader(X, y), **private)
    elif engine == "opacus:hooks":
        from opacus import PrivacyEngine

        model, opt, _ = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=_loader(X, y), **private)
    elif engine == "opacus:ghost":
        from opacus import PrivacyEngine

        model, opt, lossfunc, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            data_loader=_loader(X, y),
            criterion=lossfunc,
            grad_sample_mode="ghost",
            **private,
        )
    elif engine != "plain":
        raise ValueError(f"unknown engine {engine!r}")

    def step():
        opt.zero_grad(set_to_none=True)
        lossfunc(model(X), y).backward()
        opt.step()

    return step


def _training(model):
    """Training mode (Opacus refuses models in eval mode), with dropout off so that
    every engine and the ordinary step compute the same function."""
    from torch import nn

    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def child(case: dict) -> dict:
    """One case: ``paired`` times the engine against a plain SGD step of a copy;
    otherwise the engine's (or plain's) peak memory."""
    import torch

    from benchmarks.models import MODELS as BENCHES

    torch.set_num_threads(case["threads"])
    warnings.simplefilter("ignore")
    model, X, y = BENCHES[case["model"]].build(case["quick"])
    model = _training(model)
    plain = prepare("plain", copy.deepcopy(model), X, y) if case["paired"] else None
    step = prepare(case["engine"], model, X, y)
    for _ in range(case["warmup"]):
        step()
        if plain:
            plain()
    gc.collect()
    setup = harness.rss_bytes()
    reset = harness.reset_peak()
    times, ratios = harness.paired_steps(step, plain, case["repeats"], case["seconds"])
    peak = harness.peak_rss_bytes()
    return dict(
        case,
        time_s=statistics.median(times),
        ratio=statistics.median(ratios) if ratios else None,
        steps=len(times),
        extra_bytes=peak - setup if reset or peak > setup else None,
    )


def run_case(case: dict, timeout: float) -> dict:
    """One case in its own process: the paired timing with glibc keeping freed memory,
    a memory case with glibc returning it (see :mod:`benchmarks.harness`)."""
    env = harness.TIME_MALLOC if case["paired"] else harness.MEMORY_MALLOC
    return harness.run_case(case, timeout, child=("-m", "benchmarks.dp", "--child"), env=env)


def table(results: list[dict], args) -> list[str]:
    by = {(r["model"], r["engine"], r["paired"]): r for r in results}
    lines = [
        START,
        "## Private training: a DP-SGD step against an ordinary SGD step",
        "",
        f"`python -m benchmarks.dp{' --quick' if args.quick else ''}` ({args.started}, load average "
        f"{args.load_before} before, {' '.join(harness.load())} after; {args.threads} threads). One step: forward, "
        f"backward, clipping, noise and the SGD update (flat clipping, C = {C:g}, σ = {SIGMA:g}, the same batch "
        "every step). **Time**: the private step and an ordinary SGD step of an untouched copy alternated in one "
        f"process ({args.repeats} pairs at least, more while under {args.seconds:g} s), the median of the per-step "
        "ratios. **Memory**: the peak RSS during two steps above that after setup, each engine and the ordinary step "
        "in processes of their own (glibc returning freed buffers at once), and their ratio. The target: "
        f"at most {TARGET}× in both." + (" " + args.note if args.note else ""),
        "",
        "| model | engine | DP step (ms) | × SGD step | target met | peak (MiB) | × SGD step's peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in args.models:
        plain_mem = by.get((model, "plain", False), {})
        for engine in ENGINES:
            t, m = by.get((model, engine, True)), by.get((model, engine, False))
            if t is None:
                continue
            if "error" in t:
                lines.append(f"| {model} | {LABELS[engine]} | {harness.failure(t)} | | | | |")
                continue
            mem, mem_ratio = "n/a", "n/a"
            if m and "error" not in m and m.get("extra_bytes") is not None:
                mem = f"{m['extra_bytes'] / 2**20:.0f}"
                if (plain_mem.get("extra_bytes") or 0) >= 2**20:  # no ratio to a figure under 1 MiB
                    mem_ratio = f"{m['extra_bytes'] / plain_mem['extra_bytes']:.2f}"
            met = t["ratio"] <= TARGET and mem_ratio != "n/a" and float(mem_ratio) <= TARGET
            lines.append(
                f"| {model} | {LABELS[engine]} | {t['time_s'] * 1e3:.0f} | {t['ratio']:.2f} | "
                f"{'yes' if met else 'no'} | {mem} | {mem_ratio} |"
            )
    return [*lines, "", END]


def cases(args) -> list[dict]:
    out = []
    for model in args.models:
        out.append(dict(model=model, engine="plain", paired=False))
        for engine in ENGINES:
            out += [dict(model=model, engine=engine, paired=True), dict(model=model, engine=engine, paired=False)]
    out = [c for c in out if not args.only or re.search(args.only, f"{c['model']} {c['engine']}")]
    for case in out:
        case.update(quick=args.quick, threads=args.threads, warmup=1, seconds=args.seconds)
        case["repeats"] = args.repeats if case["paired"] else 2
    return out


def main(argv=None) -> None:
    p = harness.parser(
        "dp", __doc__, timeout=600.0,
        models=dict(nargs="+", default=list(MODELS), choices=list(MODELS)),
        only=dict(help="regular expression on 'model engine' (plain runs always match 'plain')"),
        threads=dict(type=int, default=2),
        seconds=dict(type=float, default=6.0, help="time budget of a paired timing (default 6; quick 0)"),
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        harness.answer(args.child, child)
        return
    args.repeats = args.repeats or (1 if args.quick else 7)
    args.seconds = 0.0 if args.quick else args.seconds
    markdown = args.markdown or (ROOT / "out" / "dp-quick.md" if args.quick else ROOT / "BENCHMARKS.md")
    args.load_before = " ".join(harness.load())
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    todo = cases(args)
    results = []
    for i, case in enumerate(todo, 1):
        r = run_case(case, args.timeout)
        results.append(r)
        kind = "paired" if case["paired"] else "memory"
        if "error" in r:
            shown = harness.failure(r)
        elif case["paired"]:
            shown = f"{r['time_s'] * 1e3:.0f} ms, {r['ratio']:.2f}x an SGD step ({r['steps']} pairs)"
        else:
            shown = "peak n/a" if r["extra_bytes"] is None else f"peak {r['extra_bytes'] / 2**20:+.0f} MiB"
        print(f"[{i}/{len(todo)}] {case['model']} {case['engine']} {kind}: {shown}", file=sys.stderr, flush=True)
    block = "\n".join(table(results, args))
    print(block)
    harness.write_block(markdown, block, START, END)


if __name__ == "__main__":
    main()
