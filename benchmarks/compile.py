"""torch.compile: plain and jacmem steps, eager and compiled (issue 27).

``python -m benchmarks.compile`` runs, per model, one process that builds six steps:
mode ``eager`` or ``compiled`` (``torch.compile``, the default inductor backend) times
method ``plain`` (forward and backward), ``BatchL2Grad`` or ``ClipGrad`` (inside
``jacmem.extend``). The plain steps run on a deep copy of the model, wrapped in a module
class of its own so that its compiled code has a cache entry of its own; the jacmem
steps share one compiled model, as a user's would. The process runs ``--warmup`` steps
of each (the compilation happens there), then alternates the six steps for
``--repeats`` rounds, so that a change of the machine's load falls on all of them
alike. It reports each step's median time and the medians of the per-round ratios:
compiled / eager (same method), eager jacmem / eager plain and compiled jacmem /
compiled plain; and for each compiled step the graphs Dynamo made, its graph breaks
(with their reasons, listed under the table) and the frames it compiled again during the
timed rounds (recompiles). It writes the table to benchmarks/details/compile.md between
``<!-- compile:start -->`` and ``<!-- compile:end -->``. ``--quick``: tiny sizes, one
round after one warm-up step, the ``aot_eager`` backend (no C++ build), written to
``out/compile-quick.md`` only; it checks the harness.

Models: the main tables' ``seed-cnn-64`` (an ``nn.Sequential``) and ``gpt2`` (HF GPT-2,
4 layers, d=256, tied, default ``[1, T]`` position ids), from :mod:`benchmarks.models`;
and ``gpt2-tiny`` (2 layers, d=128, 64 tokens, batch 8: 25 ms steps), where jacmem's
work per layer call, not the arithmetic, sets the ratios.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
from torch import nn

from benchmarks import harness

ROOT = harness.ROOT
START, END = "<!-- compile:start -->", "<!-- compile:end -->"
MODES = ("eager", "compiled")
METHODS = ("plain", "BatchL2Grad", "ClipGrad")
#: the models, by name: those of :mod:`benchmarks.models`, and ``gpt2-tiny``
MODELS = ("seed-cnn-64", "gpt2", "gpt2-tiny")
#: ``gpt2-tiny``'s (layers, width, vocabulary, tokens, batch), full and quick
TINY = ((2, 128, 2000, 64, 8), (1, 16, 50, 8, 2))


def describe(model: str, quick: bool) -> str:
    if model != "gpt2-tiny":
        from benchmarks.models import MODELS as BENCHES

        return f"{model}: {BENCHES[model].description}" + (" (quick sizes)" if quick else "")
    layers, width, vocab, tokens, n = TINY[quick]
    return f"gpt2-tiny: HF GPT-2 LM (tied): {layers} layers, d={width}, vocabulary {vocab}, {tokens} tokens, batch {n}"


def build(model: str, quick: bool):
    """The module, its input and targets (logits ``[N, C, ...]`` against ``[N, ...]``)."""
    from benchmarks.models import MODELS as BENCHES
    from benchmarks.models import CausalLM, token_batch

    torch.manual_seed(0)
    if model != "gpt2-tiny":
        return BENCHES[model].build(quick)
    layers, width, vocab, tokens, n = TINY[quick]
    return (CausalLM(layers, width, 2, vocab, tokens), *token_batch((n, tokens), vocab))


class Plain(nn.Module):
    """The plain steps' copy of the model: a class of its own, so that torch.compile
    keeps its code apart from the jacmem steps' (no shared cache entry, no recompile
    when the two alternate)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def steps(case: dict) -> dict:
    """The six steps of one model, by ``"<mode> <method>"``: each a function that runs
    one training step (forward, loss, backward) and sets ``.grad``."""
    import copy

    from torch.nn import functional as F

    import jacmem

    model, X, y = build(case["model"], case["quick"])
    plain = Plain(copy.deepcopy(model))
    compiled = {m: torch.compile(m, backend=case["backend"]) for m in (plain, model)}
    extensions = {"plain": None, "BatchL2Grad": jacmem.BatchL2Grad, "ClipGrad": lambda: jacmem.ClipGrad(1.0)}

    def make(owner: nn.Module, run, extension):
        def step():
            for p in owner.parameters():
                p.grad = None
            if extension is None:
                F.cross_entropy(run(X), y).backward()
                return
            with jacmem.extend(extension()):
                F.cross_entropy(run(X), y).backward()

        return step

    out = {}
    for method, extension in extensions.items():
        owner = plain if extension is None else model
        out[f"eager {method}"] = make(owner, owner, extension)
        out[f"compiled {method}"] = make(owner, compiled[owner], extension)
    return out


def dynamo_counts() -> dict:
    """What Dynamo has done in this process so far: frames compiled, graphs made and
    graph breaks by reason."""
    from torch._dynamo.utils import counters

    return dict(
        frames=counters["frames"]["total"],
        graphs=counters["stats"]["unique_graphs"],
        breaks=dict(counters["graph_break"]),
    )


def counted(step, counts: dict, key: str) -> float:
    """Run ``step``, add what Dynamo did meanwhile to ``counts`` under ``key``
    (``frames``, ``graphs``, ``breaks``), and return the step's time in seconds."""
    before = dynamo_counts()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    after = dynamo_counts()
    entry = counts.setdefault(key, dict(frames=0, graphs=0, breaks={}))
    entry["frames"] += after["frames"] - before["frames"]
    entry["graphs"] += after["graphs"] - before["graphs"]
    for reason, n in after["breaks"].items():
        if n > before["breaks"].get(reason, 0):
            entry["breaks"][reason] = entry["breaks"].get(reason, 0) + n - before["breaks"].get(reason, 0)
    return seconds


def child(case: dict) -> dict:
    """One model's six steps, warmed up, then alternated for ``case["repeats"]`` rounds:
    ``time_s`` (each step's median), ``ratio`` (the medians of the per-round ratios, by
    ``"<step> / <step>"``), ``warmup`` and ``timed`` (what Dynamo did in each, by step)."""
    torch.set_num_threads(case["threads"])
    warnings.simplefilter("ignore")
    runs = steps(case)
    warmup, timed = {}, {}
    for name, step in runs.items():
        for _ in range(case["warmup"]):
            counted(step, warmup, name)
    times = {name: [] for name in runs}
    for _ in range(case["repeats"]):
        for name, step in runs.items():
            times[name].append(counted(step, timed, name))

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    pairs = [(f"compiled {m}", f"eager {m}") for m in METHODS]
    for mode in MODES:
        pairs += [(f"{mode} {m}", f"{mode} plain") for m in METHODS[1:]]
    return dict(
        case,
        time_s={name: statistics.median(t) for name, t in times.items()},
        ratio={f"{a} / {b}": ratio(a, b) for a, b in pairs},
        warmup=warmup,
        timed=timed,
    )


def headline(reason: str) -> str:
    """A graph break's reason on one line: Dynamo's first line and its explanation."""
    lines = [line.strip() for line in reason.strip().splitlines()]
    why = [line for line in lines[1:] if line.startswith("Explanation:")]
    return " ".join(lines[:1] + why).replace("|", "/")


def table(results: list[dict], args) -> str:
    m = harness.machine()
    lines = [
        START,
        "## torch.compile: plain and jacmem steps, eager and compiled (issue 27)",
        "",
        f"Measured {args.started} with `python -m benchmarks.compile{' --quick' if args.quick else ''}` "
        f"({m['cpu']}, {m['cores']} cores, {args.threads} threads, torch {m['torch']}, backend {args.backend}, "
        f"load {args.load_before} before, {args.load_after} after). Per model one process alternates the six "
        f"steps for {args.repeats} rounds after {args.warmup} warm-up steps each: times are medians, ratios "
        "medians of the per-round ratios. Graphs and graph breaks: what Dynamo made for the step during its "
        "warm-up (0 graphs: it ran on the graphs of the step above, the same compiled model); recompiles: "
        f"frames compiled again during the timed rounds. {args.note}".rstrip(),
        "",
    ]
    for r in results:
        lines += [f"**{describe(r['model'], args.quick)}**", ""]
        if "error" in r:
            lines += ["fails: " + r["error"].replace("|", "/"), ""]
            continue
        t, q = r["time_s"], r["ratio"]
        lines += [
            "| step | eager s | compiled s | compiled / eager | eager / eager plain | compiled / compiled plain "
            "| graphs | graph breaks | recompiles |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        breaks = {}
        for method in METHODS:
            same = [q.get(f"{mode} {method} / {mode} plain", 1.0) for mode in MODES]
            w, c = r["warmup"][f"compiled {method}"], r["timed"][f"compiled {method}"]
            n = sum(w["breaks"].values())
            lines.append(
                f"| {method} | {t[f'eager {method}']:.3f} | {t[f'compiled {method}']:.3f} "
                f"| {q[f'compiled {method} / eager {method}']:.2f} | {same[0]:.2f} | {same[1]:.2f} "
                f"| {w['graphs']} | {n} | {c['frames']} |"
            )
            for reason, k in w["breaks"].items():
                breaks.setdefault(reason, []).append(f"{method} {k}")
        lines.append("")
        if breaks:
            lines += ["Graph breaks (reason: step and count):", ""]
            lines += [f"- {headline(reason)}: {', '.join(where)}" for reason, where in breaks.items()]
        else:
            lines.append("No graph breaks in the compiled steps.")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = harness.parser(
        "compile", __doc__, timeout=1800.0,
        models=dict(nargs="+", default=list(MODELS), choices=list(MODELS)),
        threads=dict(type=int, default=2),
        warmup=dict(type=int, help="warm-up steps of each step before the timed rounds (3; quick: 1)"),
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        harness.answer(args.child, child)
        return
    args.repeats = args.repeats or (1 if args.quick else 30)
    args.warmup = args.warmup or (1 if args.quick else 3)
    args.backend = "aot_eager" if args.quick else "inductor"
    markdown = args.markdown or (
        ROOT / "out" / "compile-quick.md" if args.quick else ROOT / "benchmarks" / "details" / "compile.md"
    )
    args.load_before = " ".join(harness.load())
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for i, model in enumerate(args.models, 1):
        case = dict(
            model=model, quick=args.quick, threads=args.threads, repeats=args.repeats, warmup=args.warmup,
            backend=args.backend,
        )  # fmt: skip
        r = harness.run_case(case, args.timeout, child=("-m", "benchmarks.compile", "--child"), env=harness.TIME_MALLOC)
        results.append(r)
        shown = r["error"] if "error" in r else ", ".join(f"{k} {v:.3f} s" for k, v in r["time_s"].items())
        print(f"[{i}/{len(args.models)}] {model}: {shown}", file=sys.stderr, flush=True)
    args.load_after = " ".join(harness.load())
    block = table(results, args)
    print(block)
    harness.write_block(markdown, block, START, END)


if __name__ == "__main__":
    main()
