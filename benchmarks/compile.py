"""torch.compile: plain and jacmem steps, eager and compiled (issue 27).

``python -m benchmarks.compile`` runs, per model, one process per (mode, method): mode
``eager`` or ``compiled`` (``torch.compile(model)``, the default inductor backend),
method ``plain`` (forward and backward), ``BatchL2Grad`` or ``ClipGrad`` (inside
``jacmem.extend``). Each process runs warm-up steps (the compilation happens there),
then times ``--repeats`` steps (median). It writes the table to BENCHMARKS.md between
``<!-- compile:start -->`` and ``<!-- compile:end -->``. ``--quick``: tiny sizes, one
step after one warm-up, the ``aot_eager`` backend (no C++ build), written to
``out/compile-quick.md`` only; it checks the harness.

Models: the seed CNN (an ``nn.Sequential``, [N, 1, 28, 28]) and a small HF GPT-2 LM
(random init, tied embeddings), with default ``[1, T]`` position ids.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

from benchmarks import harness

ROOT = harness.ROOT
START, END = "<!-- compile:start -->", "<!-- compile:end -->"
MODES = ("eager", "compiled")
METHODS = ("plain", "BatchL2Grad", "ClipGrad")
#: model -> batch size, full and quick
BATCH = {"cnn": (32, 2), "gpt2": (8, 2)}
#: GPT-2's (layers, width, vocabulary, tokens), full and quick
GPT2 = ((2, 128, 2000, 64), (1, 16, 50, 8))


def describe(model: str, quick: bool) -> str:
    n = BATCH[model][quick]
    if model == "cnn":
        return f"seed CNN (nn.Sequential: 4 convs 1-128-256-64-32, ReLU, MaxPool, Linear 32-10), batch {n}"
    layers, width, vocab, tokens = GPT2[quick]
    return f"HF GPT-2 LM (tied): {layers} layers, d={width}, vocabulary {vocab}, {tokens} tokens, batch {n}"


def build(model: str, quick: bool):
    """The module, its input and targets (logits ``[N, C, ...]`` against ``[N, ...]``)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    n = BATCH[model][quick]
    if model == "cnn":
        from benchmarks.models import seed_cnn

        return seed_cnn(), torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, vocab, tokens = GPT2[quick]
    config = GPT2Config(vocab_size=vocab, n_positions=tokens, n_embd=width, n_layer=layers, n_head=2)
    lm = GPT2LMHeadModel(config)

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids).logits.transpose(1, 2)

    return Logits(), torch.randint(0, vocab, (n, tokens)), torch.randint(0, vocab, (n, tokens))


def prepare(case: dict):
    """The step function of one case."""
    import torch
    from torch.nn import functional as F

    import jacmem

    model, X, y = build(case["model"], case["quick"])
    run = torch.compile(model, backend=case["backend"]) if case["mode"] == "compiled" else model
    extension = {"BatchL2Grad": jacmem.BatchL2Grad, "ClipGrad": lambda: jacmem.ClipGrad(1.0)}.get(case["method"])

    def step():
        for p in model.parameters():
            p.grad = None
        if extension is None:
            F.cross_entropy(run(X), y).backward()
            return
        with jacmem.extend(extension()):
            F.cross_entropy(run(X), y).backward()

    return step


def child(case: dict) -> dict:
    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(case["threads"])
    step = prepare(case)
    for _ in range(case["warmup"]):
        step()
    times = []
    for _ in range(case["repeats"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return dict(case, time_s=statistics.median(times))


def table(results: list[dict], args) -> str:
    by = {(r["model"], r["mode"], r["method"]): r for r in results}
    m = harness.machine()
    lines = [
        START,
        "## torch.compile: plain and jacmem steps, eager and compiled (issue 27)",
        "",
        f"Measured {args.started} with `python -m benchmarks.compile{' --quick' if args.quick else ''}` "
        f"({m['cpu']}, {m['cores']} cores, {args.threads} threads, torch {m['torch']}, backend {args.backend}, "
        f"load {args.load_before}; "
        f"median of {args.repeats} steps after {args.warmup} warm-up). {args.note}".rstrip(),
        "",
    ]
    for model in args.models:
        lines += [f"**{describe(model, args.quick)}**", ""]
        lines += [
            "| step | eager s | compiled s | compiled / eager | eager / eager plain | compiled / compiled plain |"
        ]
        lines += ["|---|---|---|---|---|---|"]
        plain = [by.get((model, mode, "plain"), {}).get("time_s") for mode in MODES]
        for method in METHODS:
            rs = [by.get((model, mode, method), {}) for mode in MODES]
            t = [r.get("time_s") for r in rs]
            if any("error" in r for r in rs):
                cells = ["fails: " + r["error"].replace("|", "/") if "error" in r else f"{r['time_s']:.3f}" for r in rs]
                lines.append(f"| {method} | {cells[0]} | {cells[1]} | n/a | n/a | n/a |")
                continue
            ratios = [t[1] / t[0]] + [t[k] / plain[k] if plain[k] else float("nan") for k in (0, 1)]
            lines.append(f"| {method} | {t[0]:.3f} | {t[1]:.3f} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = harness.parser(
        "compile", __doc__, timeout=600.0,
        models=dict(nargs="+", default=list(BATCH), choices=list(BATCH)),
        threads=dict(type=int, default=2),
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        harness.answer(args.child, child)
        return
    args.repeats = args.repeats or (1 if args.quick else 10)
    args.warmup = 1 if args.quick else 3
    args.backend = "aot_eager" if args.quick else "inductor"
    markdown = args.markdown or (ROOT / "out" / "compile-quick.md" if args.quick else ROOT / "BENCHMARKS.md")
    cases = [dict(model=m, mode=mode, method=k) for m in args.models for k in METHODS for mode in MODES]
    args.load_before = " ".join(harness.load())
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for i, case in enumerate(cases, 1):
        case.update(
            quick=args.quick, threads=args.threads, repeats=args.repeats, warmup=args.warmup, backend=args.backend
        )
        r = harness.run_case(case, args.timeout, child=("-m", "benchmarks.compile", "--child"))
        results.append(r)
        shown = r["error"] if "error" in r else f"{r['time_s']:.3f} s"
        print(
            f"[{i}/{len(cases)}] {case['model']} {case['mode']} {case['method']}: {shown}", file=sys.stderr, flush=True
        )
    block = table(results, args)
    print(block)
    harness.write_block(markdown, block, START, END)


if __name__ == "__main__":
    main()
