"""Second-order extensions, jacmem beside BackPACK 1.7.1: time and peak memory.

``python -m benchmarks.second_order`` runs, per (model, extension), three processes:
one that times jacmem and BackPACK alternately, step by step (the machine may be
shared: a paired ratio, the median of the per-step ratios, is what survives its
noise), and one per library for its memory; plus a plain forward/backward per model.
It then writes the table to BENCHMARKS.md between ``<!-- secondorder:start -->`` and
``<!-- secondorder:end -->`` (the rest of the file is left alone). ``--quick``: tiny
sizes, one step after one warm-up, the table printed and written to
``out/second-order-quick.md`` only; it checks the harness.

Curvature on real architectures (issue 16): torchvision's resnet18 (32×32, eval) and a
small HF BERT classifier get ``DiagGGNExact`` and ``KFAC`` from jacmem and BackPACK and,
as a laplace-torch fit step, from laplace's curvlinops and ASDL backends (``diag``;
``kron`` with ``stochastic=True``, their KFAC), each library in its own process for time
and memory. A library that cannot do a case is recorded as "fails: <reason>".

Memory: the peak resident set size during the timed steps above that before them,
after one warm-up step (so one-time imports and initialisation do not count;
``/proc/self/clear_refs`` resets the high-water mark). Each case runs with
``MALLOC_MMAP_THRESHOLD_=131072``, so that glibc returns every freed large buffer at
once and the resident set follows the live tensors rather than the allocator's
retention. Time: the median over the repeats. Both libraries get the same seeded
model and batch, and 2 threads.
"""

from __future__ import annotations

import gc
import re
import statistics
import sys
import time
import warnings

from benchmarks import harness

ROOT = harness.ROOT
START, END = "<!-- secondorder:start -->", "<!-- secondorder:end -->"

#: model -> extensions run on it (KFRA's dense [D, D] matrices do not fit for the CNN's
#: 100,352-entry conv outputs, in either library)
EXTENSIONS: dict[str, list[str]] = {
    "mlp": ["DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact", "DiagHessian", "KFAC", "KFLR", "KFRA"],
    "cnn": ["DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact", "DiagHessian", "KFAC", "KFLR"],
    "resnet18": ["DiagGGNExact", "KFAC"],
    "bert": ["DiagGGNExact", "KFAC"],
}
#: model -> (hidden width or None, batch size), full and quick
SIZES = {
    "mlp": ((512, 128), (16, 4)),
    "cnn": ((None, 8), (None, 2)),
    "resnet18": ((None, 8), (None, 2)),  # laplace's curvlinops diag holds Jacobians [N, 10, 11.2M]
    "bert": ((128, 8), (16, 2)),
}
#: model -> libraries, each a process of its own ("pair": jacmem and BackPACK alternating)
LIBS = {"mlp": ("pair", "jacmem", "backpack"), "cnn": ("pair", "jacmem", "backpack")}
LIBS |= {m: ("jacmem", "backpack", "curvlinops", "asdl") for m in ("resnet18", "bert")}
#: laplace-torch's backends: library -> (module, GGN backend class)
LAPLACE = {
    "curvlinops": ("laplace.curvature.curvlinops", "CurvlinopsGGN"),
    "asdl": ("laplace.curvature.asdl", "AsdlGGN"),
}
#: the column titles of the libraries
TITLES = {"jacmem": "jacmem", "backpack": "BackPACK", "curvlinops": "laplace curvlinops", "asdl": "laplace ASDL"}
#: BERT's sequence length and vocabulary, full and quick
BERT_TOKENS = ((32, 1000), (8, 50))


def describe(model: str, quick: bool) -> str:
    width, batch = SIZES[model][quick]
    if model == "mlp":
        return f"MLP 784-{width}-{width}-10, ReLU, cross-entropy, batch {batch}"
    if model == "resnet18":
        return f"torchvision resnet18 (num_classes=10, eval), 3×32×32 inputs, cross-entropy, batch {batch}"
    if model == "bert":
        (tokens, vocab) = BERT_TOKENS[quick]
        return (
            f"HF BertForSequenceClassification (random init, eval): 2 layers, d={width}, 2 heads, vocabulary "
            f"{vocab}, {tokens} tokens, 10 classes, cross-entropy, batch {batch}"
        )
    return f"seed CNN (4 convs 1-128-256-64-32, ReLU, MaxPool, Linear 32-10), cross-entropy, batch {batch}"


def build(model: str, quick: bool):
    import torch
    from torch import nn

    from benchmarks.models import mlp, seed_cnn

    torch.manual_seed(0)
    width, batch = SIZES[model][quick]
    if model == "mlp":
        net, X = mlp(width), torch.randn(batch, 784)
    elif model == "resnet18":
        import torchvision

        net, X = torchvision.models.resnet18(num_classes=10).eval(), torch.randn(batch, 3, 32, 32)
    elif model == "bert":
        tokens, vocab = BERT_TOKENS[quick]
        net, X = bert(width, vocab, tokens), torch.randint(0, vocab, (batch, tokens))
    else:
        net, X = seed_cnn(), torch.randn(batch, 1, 28, 28)
    return net, X, torch.randint(0, 10, (X.shape[0],)), nn.CrossEntropyLoss()


def bert(width: int, vocab: int, tokens: int):
    """A small HF BERT classifier, as a module from token ids ``[N, T]`` to logits ``[N, 10]``."""
    from torch import nn
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * width,
        max_position_embeddings=tokens,
        num_labels=10,
        attn_implementation="eager",
    )

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = BertForSequenceClassification(config).eval()

        def forward(self, input_ids):
            return self.bert(input_ids).logits

    return Logits()


def prepare(case: dict):
    """The step function of one case."""
    import torch

    model, X, y, lossf = build(case["model"], case["quick"])
    lib, name = case["lib"], case["ext"]
    if lib == "plain":

        def step():
            lossf(model(X), y).backward()

    elif lib == "jacmem":
        import jacmem

        ext = getattr(jacmem, name)()

        def step():
            with jacmem.extend(ext):
                lossf(model(X), y).backward()

    elif lib in LAPLACE:  # a laplace-torch fit step: forward, loss and curvature, as Laplace.fit runs it
        import importlib

        module, backend = LAPLACE[lib]
        curvature = getattr(importlib.import_module(module), backend)(
            model, "classification", stochastic=name != "DiagGGNExact"
        )
        if name not in ("DiagGGNExact", "KFAC"):
            raise ValueError(f"laplace's backends give DiagGGNExact (diag) and KFAC (stochastic kron), not {name}")

        def step():
            if name == "DiagGGNExact":
                curvature.diag(X, y)
            else:
                curvature.kron(X, y, N=len(y))

    else:
        import backpack.extensions as bpe
        from backpack import backpack, extend

        model, lossf = extend(model), extend(lossf)
        ext = getattr(bpe, name)()

        def step():
            with backpack(ext):
                lossf(model(X), y).backward()

    def clean_step():
        step()
        for p in model.parameters():
            p.grad = None
            for field in ("diag_ggn_exact", "diag_ggn_mc", "diag_ggn_exact_batch", "diag_h", "kfac", "kflr", "kfra"):
                if hasattr(p, field):
                    delattr(p, field)

    torch.set_num_threads(case["threads"])
    return clean_step


def paired(case: dict) -> dict:
    """jacmem and BackPACK in one process, their steps alternating: the medians of
    each, and of the per-step ratios; ``repeats`` pairs at least, more (up to 10 times
    as many) while the pairs so far took under ``seconds``; the order alternates."""
    steps = [prepare(dict(case, lib=lib)) for lib in ("jacmem", "backpack")]
    for _ in range(case["warmup"]):
        for step in steps:
            step()
    times: list[list[float]] = [[], []]
    begin = time.perf_counter()
    while len(times[0]) < case["repeats"] or (
        time.perf_counter() - begin < case["seconds"] and len(times[0]) < 10 * case["repeats"]
    ):
        order = (0, 1) if len(times[0]) % 2 == 0 else (1, 0)  # each library goes first in half the pairs
        for k in order:
            start = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - start)
    ratios = [j / b for j, b in zip(*times)]
    return dict(
        case,
        jacmem_s=statistics.median(times[0]),
        backpack_s=statistics.median(times[1]),
        ratio=statistics.median(ratios),
        pairs=len(ratios),
    )


def child(case: dict) -> dict:

    warnings.simplefilter("ignore")
    if case["lib"] == "pair":
        return paired(case)
    step = prepare(case)
    for _ in range(case["warmup"]):
        step()
    gc.collect()
    setup = harness.rss_bytes()
    reset = harness.reset_peak()
    times = []
    for _ in range(case["repeats"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = harness.peak_rss_bytes()
    return dict(case, time_s=statistics.median(times), extra_bytes=peak - setup if reset or peak > setup else None)


def run_case(case: dict, timeout: float) -> dict:
    """One case in its own process, glibc returning freed buffers at once (see above)."""
    child = ("-m", "benchmarks.second_order", "--child")
    return harness.run_case(case, timeout, child=child, env={"MALLOC_MMAP_THRESHOLD_": "131072"})


def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.0f}"


def _cell(r: dict, key: str) -> str:
    if "error" in r:
        return "fails: " + r["error"].replace("|", "/")
    if r.get(key) is None:
        return "n/a"
    return _mb(r[key]) if key == "extra_bytes" else f"{r[key]:.3f}" if key.endswith("_s") else f"{r[key]:.2f}"


def table(results: list[dict], args) -> str:
    by = {(r["model"], r["lib"], r["ext"]): r for r in results}
    lines = [
        START,
        "## Second-order extensions: jacmem beside BackPACK",
        "",
        f"`python -m benchmarks.second_order{' --quick' if args.quick else ''}` ({args.started}, load average "
        f"{args.load_before} before, {' '.join(harness.load())} after): {args.threads} thread{'s' if args.threads != 1 else ''}, one warm-up step. A step is "
        "forward, loss and backward inside the extension's block. Time: jacmem and BackPACK in one process, their "
        f"steps alternating ({args.repeats} pairs at least, more while under {args.seconds:g} s, up to "
        f"{10 * args.repeats}), the medians of each and of the per-step ratios (a shared machine's load moves both "
        f"alike). Memory: each library in its own process, {args.repeats} steps, the peak RSS during them above that "
        "before them (MB; glibc returning freed buffers at once, see the module docstring). Ratios are jacmem / BackPACK: below 1 is better (no memory ratio "
        "where BackPACK's figure is under 1 MB).",
        "",
        "jacmem's times include its chain check: at each module, the gradient autograd delivers is compared "
        "with the parts its tracked consumers passed back, which autograd computed itself (hooks on their "
        "autograd nodes; no extra arithmetic but the comparison). KFRA on the CNN is left out: its dense matrices "
        "over the 100,352-entry conv outputs fit in neither library. resnet18 and BERT: each library in a process "
        f"of its own for time and memory ({args.repeats} steps); laplace's backends run their fit step "
        "(`diag`, and `kron` with `stochastic=True` for KFAC), which includes the forward pass and the loss."
        + (" " + args.note if args.note else ""),
        "",
    ]
    for model in args.models:
        plain = by.get((model, "plain", "-"), {})
        lines += [
            f"**{describe(model, args.quick)}** (plain forward+backward: {plain.get('time_s', float('nan')):.3f} s, "
            f"{_mb(plain.get('extra_bytes'))} MB)",
            "",
        ]
        if "pair" not in LIBS[model]:
            lines += separate(model, by)
            continue
        lines += [
            "| extension | jacmem s | BackPACK s | time ratio | jacmem MB | BackPACK MB | memory ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for ext in EXTENSIONS[model]:
            t = by.get((model, "pair", ext), {})
            j, b = by.get((model, "jacmem", ext), {}), by.get((model, "backpack", ext), {})
            memory = "n/a"
            if (
                "error" not in j
                and "error" not in b
                and j.get("extra_bytes") is not None
                and (b.get("extra_bytes") or 0) >= 2**20
            ):
                memory = f"{j['extra_bytes'] / b['extra_bytes']:.2f}"
            lines.append(
                f"| {ext} | {_cell(t, 'jacmem_s')} | {_cell(t, 'backpack_s')} | {_cell(t, 'ratio')} | "
                f"{_cell(j, 'extra_bytes')} | {_cell(b, 'extra_bytes')} | {memory} |"
            )
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def separate(model: str, by: dict) -> list[str]:
    """The table of a model whose libraries each ran in a process of their own: time and
    memory per library, and jacmem's time over each other library's."""
    libs = LIBS[model]
    head = "| extension | " + " | ".join(f"{TITLES[lib]} s | {TITLES[lib]} MB" for lib in libs)
    head += "".join(f" | jacmem / {TITLES[lib]} time" for lib in libs[1:]) + " |"
    lines = [head, "|---|" + "---|" * (3 * len(libs) - 1)]
    for ext in EXTENSIONS[model]:
        rs = [by.get((model, lib, ext), {}) for lib in libs]
        cells = [f"{_cell(r, 'time_s')} | {_cell(r, 'extra_bytes')}" if "error" not in r else _cell(r, "") for r in rs]
        cells = [c if " | " in c else f"{c} | " for c in cells]  # a failure spans its library's time and memory
        ratios = [
            f"{rs[0]['time_s'] / r['time_s']:.2f}" if "time_s" in rs[0] and "time_s" in r else "n/a" for r in rs[1:]
        ]
        lines.append(f"| {ext} | " + " | ".join(cells + ratios) + " |")
    return lines + [""]


def main(argv=None) -> None:
    p = harness.parser(
        "second_order", __doc__, timeout=600.0,
        models=dict(nargs="+", default=list(EXTENSIONS), choices=list(EXTENSIONS)),
        only=dict(help="regular expression on 'model lib extension'"),
        threads=dict(type=int, default=2),
        seconds=dict(type=float, default=4.0, help="time budget of a paired timing (default 4; quick 0)"),
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        harness.answer(args.child, child)
        return
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.warmup = 1
    args.seconds = 0.0 if args.quick else args.seconds
    markdown = args.markdown or (ROOT / "out" / "second-order-quick.md" if args.quick else ROOT / "BENCHMARKS.md")
    cases = []
    for model in args.models:
        cases.append(dict(model=model, lib="plain", ext="-"))
        cases += [dict(model=model, lib=lib, ext=ext) for ext in EXTENSIONS[model] for lib in LIBS[model]]
    cases = [c for c in cases if not args.only or re.search(args.only, f"{c['model']} {c['lib']} {c['ext']}")]
    args.load_before = " ".join(harness.load())
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for i, case in enumerate(cases, 1):
        case.update(
            quick=args.quick, threads=args.threads, repeats=args.repeats, warmup=args.warmup, seconds=args.seconds
        )
        r = run_case(case, args.timeout)
        results.append(r)
        if "error" in r:
            shown = r["error"]
        elif case["lib"] == "pair":
            shown = f"jacmem {r['jacmem_s']:.3f} s, BackPACK {r['backpack_s']:.3f} s, paired ratio {r['ratio']:.2f} ({r['pairs']} pairs)"
        else:
            shown = f"{r['time_s']:.3f} s, {_mb(r.get('extra_bytes'))} MB"
        print(f"[{i}/{len(cases)}] {case['model']} {case['lib']} {case['ext']}: {shown}", file=sys.stderr, flush=True)
    block = table(results, args)
    print(block)
    markdown.parent.mkdir(parents=True, exist_ok=True)
    harness.write_block(markdown, block, START, END)


if __name__ == "__main__":
    main()
