"""Second-order extensions, jacmem beside BackPACK 1.7.1: time and peak memory.

``python -m benchmarks.second_order`` runs, per (model, extension), three processes:
one that times jacmem and BackPACK alternately, step by step (the machine may be
shared: a paired ratio, the median of the per-step ratios, is what survives its
noise), and one per library for its memory; plus a plain forward/backward per model.
It then writes the table to benchmarks/details/second-order.md between ``<!-- secondorder:start -->`` and
``<!-- secondorder:end -->`` (the rest of the file is left alone). ``--quick``: tiny
sizes, one step after one warm-up, the table printed and written to
``out/second-order-quick.md`` only; it checks the harness.

Curvature on real architectures (issue 16): torchvision's resnet18 (32×32, eval) and a
small HF BERT classifier get ``DiagGGNExact`` and ``KFAC`` from jacmem and BackPACK and,
as a laplace-torch fit step, from laplace's curvlinops and ASDL backends (``diag``;
``kron`` with ``stochastic=True``, their KFAC), each library in its own process for time
and memory. A library that cannot do a case is recorded as "fails: <reason>".

Curvature on language models (issue 23): HF GPT-2 at its vocabulary 50257 on its own
shifted LM loss (``labels=ids``), tied (the default: ``DiagGGNMC``, ``DiagGGNExact``) and
untied (``KFAC``, ``KFACEF``, ``EKFAC``: KFAC refuses a tied weight), and a LLaMA at
vocabulary 32000 with PEFT LoRA adapters, base frozen (all five); the Monte-Carlo kinds
draw one sample. laplace's backends get the same models as next-token logits
``[N·(T-1), V]`` against ``ids[:, 1:]`` (their classification likelihood); a case whose
known cost is out of reach is "not run: <why>", jacmem's own refusals "refused: out of
reach (...)". Each table gives jacmem's time over a plain step's.

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
    "gpt2": ["DiagGGNMC", "DiagGGNExact"],
    "gpt2-untied": ["KFAC", "KFACEF", "EKFAC"],
    "llama-lora": ["DiagGGNMC", "KFAC", "KFACEF", "EKFAC", "DiagGGNExact"],
}
#: model -> (hidden width or None, batch size), full and quick
SIZES = {
    "mlp": ((512, 128), (16, 4)),
    "cnn": ((None, 8), (None, 2)),
    "resnet18": ((None, 8), (None, 2)),  # laplace's curvlinops diag holds Jacobians [N, 10, 11.2M]
    "bert": ((128, 8), (16, 2)),
    "gpt2": ((64, 4), (16, 2)),
    "gpt2-untied": ((64, 4), (16, 2)),
    "llama-lora": ((64, 4), (16, 2)),
}
#: model -> libraries, each a process of its own ("pair": jacmem and BackPACK alternating)
LIBS = {"mlp": ("pair", "jacmem", "backpack"), "cnn": ("pair", "jacmem", "backpack")}
LIBS |= {m: ("jacmem", "backpack", "curvlinops", "asdl") for m in ("resnet18", "bert")}
#: the language models, on their own shifted LM loss (``labels=ids``); BackPACK has no HF
#: model support (see its BERT row), so it is left out of them
LMS = ("gpt2", "gpt2-untied", "llama-lora")
LIBS |= {m: ("jacmem", "curvlinops", "asdl") for m in LMS}
#: laplace-torch's backends: library -> (module, the prefix of its backend classes)
LAPLACE = {
    "curvlinops": ("laplace.curvature.curvlinops", "Curvlinops"),
    "asdl": ("laplace.curvature.asdl", "Asdl"),
}
#: the column titles of the libraries
TITLES = {"jacmem": "jacmem", "backpack": "BackPACK", "curvlinops": "laplace curvlinops", "asdl": "laplace ASDL"}
#: BERT's sequence length and vocabulary, full and quick
BERT_TOKENS = ((32, 1000), (8, 50))
#: the language models' sequence length and vocabulary (GPT-2's 50257, LLaMA's 32000),
#: full and quick
LM_TOKENS = {"gpt2": ((16, 50257), (8, 500)), "llama-lora": ((16, 32000), (8, 500))}
LM_TOKENS["gpt2-untied"] = LM_TOKENS["gpt2"]
#: the extensions laplace's backends give: extension -> (backend: GGN or EF, stochastic,
#: method: diag or kron); EKFAC is none of them
LAPLACE_KINDS = {
    "DiagGGNExact": ("GGN", False, "diag"),
    "DiagGGNMC": ("GGN", True, "diag"),
    "KFAC": ("GGN", True, "kron"),
    "KFACEF": ("EF", False, "kron"),
}
#: the most bytes of the Jacobians ``[B, C, P]`` that laplace's curvlinops ``diag`` may hold
#: (a language model's rows are its tokens, ``C`` its vocabulary)
LAPLACE_JACOBIAN_BYTES = 4 * 2**30


class OutOfReach(Exception):
    """A peer's case not run: its known cost is beyond this machine."""


class Refused(Exception):
    """jacmem's refusal of a case out of its reach, before any work."""


def describe(model: str, quick: bool) -> str:
    width, batch = SIZES[model][quick]
    if model == "mlp":
        return f"MLP 784-{width}-{width}-10, ReLU, cross-entropy, batch {batch}"
    if model == "resnet18":
        return f"torchvision resnet18 (num_classes=10, eval), 3×32×32 inputs, cross-entropy, batch {batch}"
    if model in LMS:
        tokens, vocab = LM_TOKENS[model][quick]
        if model == "llama-lora":
            return (
                f"HF LlamaForCausalLM (random init, eval) with PEFT LoRA (rank 4 on q_proj and v_proj, base frozen): "
                f"2 layers, d={width}, 4 heads (2 key-value), vocabulary {vocab}, {tokens} tokens, its own shifted "
                f"LM loss (`labels=ids`), batch {batch}"
            )
        tied = (
            "tied `lm_head`/`wte` (the default)" if model == "gpt2" else "untied `lm_head` (KFAC refuses a tied weight)"
        )
        return (
            f"HF GPT2LMHeadModel (random init, eval), {tied}: 2 layers, d={width}, 4 heads, vocabulary {vocab}, "
            f"{tokens} tokens, its own shifted LM loss (`labels=ids`), batch {batch}"
        )
    if model == "bert":
        (tokens, vocab) = BERT_TOKENS[quick]
        return (
            f"HF BertForSequenceClassification (random init, eval): 2 layers, d={width}, 2 heads, vocabulary "
            f"{vocab}, {tokens} tokens, 10 classes, cross-entropy, batch {batch}"
        )
    return f"seed CNN (4 convs 1-128-256-64-32, ReLU, MaxPool, Linear 32-10), cross-entropy, batch {batch}"


def build(model: str, quick: bool, lib: str = "jacmem"):
    """``(module, inputs, targets, loss function)`` of one case, seeded alike for every
    library; a language model's module gives its own loss where ``lib`` computes it by
    the model (``plain``, ``jacmem``), its flattened next-token logits for laplace."""
    import torch
    from torch import nn

    from benchmarks.models import mlp, seed_cnn

    torch.manual_seed(0)
    width, batch = SIZES[model][quick]
    if model in LMS:
        tokens, vocab = LM_TOKENS[model][quick]
        net, X = language_model(model, width, vocab, tokens, lib in LAPLACE), torch.randint(0, vocab, (batch, tokens))
        if lib in LAPLACE:
            return net, X, X[:, 1:].reshape(-1), nn.CrossEntropyLoss()
        return net, X, X, lambda loss, _: loss
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


def language_model(model: str, width: int, vocab: int, tokens: int, logits: bool):
    """GPT-2 (tied or untied) or a LLaMA with PEFT LoRA adapters (base frozen), in eval,
    as a module from token ids ``[N, T]`` to the model's own shifted LM loss (as jacmem's
    users call it), or with ``logits`` to the next tokens' logits ``[N·(T-1), V]`` (as
    laplace's backends take it; the targets are ``ids[:, 1:]`` flattened)."""
    import transformers
    from torch import nn

    class LanguageModel(nn.Module):
        def __init__(self, lm: nn.Module):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            if not logits:
                return self.lm(input_ids=ids, labels=ids).loss
            out = self.lm(input_ids=ids).logits
            return out[:, :-1].reshape(-1, out.shape[-1])

    if model == "llama-lora":
        import peft

        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens, bos_token_id=0,
            eos_token_id=0, attn_implementation="eager",
        )  # fmt: skip
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        return LanguageModel(peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).eval())
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=width, n_layer=2, n_head=4, n_positions=tokens, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=model == "gpt2", attn_implementation="eager",
    )  # fmt: skip
    return LanguageModel(transformers.GPT2LMHeadModel(config).eval())


def prepare(case: dict):
    """The step function of one case."""
    import torch

    lib, name = case["lib"], case["ext"]
    model, X, y, lossf = build(case["model"], case["quick"], lib)
    if lib == "plain":

        def step():
            lossf(model(X), y).backward()

    elif lib == "jacmem":
        import jacmem

        ext = getattr(jacmem, name)()

        def step():
            try:
                with jacmem.extend(ext):
                    lossf(model(X), y).backward()
            except RuntimeError as err:  # jacmem's designed answer where the exact kinds cost too much
                if "out of reach" in str(err):
                    raise Refused(str(err).removeprefix("jacmem: ")) from err
                raise

    elif lib in LAPLACE:  # a laplace-torch fit step: forward, loss and curvature, as Laplace.fit runs it
        import importlib

        module, prefix = LAPLACE[lib]
        kind, stochastic, method = LAPLACE_KINDS[name]
        if lib == "curvlinops" and method == "diag" and not stochastic:
            size = len(y) * int(model(X[:1]).shape[-1]) * sum(p.numel() for p in model.parameters() if p.requires_grad)
            if size * 4 > LAPLACE_JACOBIAN_BYTES:
                raise OutOfReach(f"its Jacobians [{len(y)}, C, P] take {size * 4 / 2**30:.0f} GB")
        options = {"stochastic": stochastic} if kind == "GGN" else {}  # the EF backends sample nothing
        curvature = getattr(importlib.import_module(module), prefix + kind)(model, "classification", **options)

        def step():
            if method == "diag":
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
        error = r["error"].replace("|", "/")
        if error.startswith(("OutOfReach: ", "n/a")):
            return "not run: " + error.removeprefix("OutOfReach: ")
        if error.startswith("Refused: "):
            return "refused: out of reach: " + error.removeprefix("Refused: ")
        return "fails: " + error
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
    memory per library, jacmem's time over a plain step's (the Monte-Carlo kinds draw one
    sample: per MC sample) and over each other library's."""
    libs, plain = LIBS[model], by.get((model, "plain", "-"), {})
    head = "| extension | " + " | ".join(f"{TITLES[lib]} s | {TITLES[lib]} MB" for lib in libs)
    head += " | jacmem × plain" + "".join(f" | jacmem / {TITLES[lib]} time" for lib in libs[1:]) + " |"
    lines = [head, "|---|" + "---|" * (3 * len(libs))]
    for ext in EXTENSIONS[model]:
        rs = [by.get((model, lib, ext), {}) for lib in libs]
        cells = [f"{_cell(r, 'time_s')} | {_cell(r, 'extra_bytes')}" if "error" not in r else _cell(r, "") for r in rs]
        cells = [c if " | " in c else f"{c} | " for c in cells]  # a failure spans its library's time and memory
        ratios = [
            f"{rs[0]['time_s'] / r['time_s']:.2f}" if "time_s" in rs[0] and "time_s" in r else "n/a"
            for r in [plain, *rs[1:]]
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
    markdown = args.markdown or (
        ROOT / "out" / "second-order-quick.md" if args.quick else ROOT / "benchmarks" / "details" / "second-order.md"
    )
    cases = []
    for model in args.models:
        cases.append(dict(model=model, lib="plain", ext="-"))
        cases += [dict(model=model, lib=lib, ext=ext) for ext in EXTENSIONS[model] for lib in LIBS[model]]
    for case in cases:
        if case["lib"] in LAPLACE and case["ext"] not in LAPLACE_KINDS:
            case["skip"] = f"n/a (laplace has no {case['ext']})"
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
    harness.write_block(markdown, block, START, END)


if __name__ == "__main__":
    main()
