"""The driver: builds the list of cases, runs each in a subprocess, shows progress on
stderr, and writes the report. ``python -m benchmarks --help``."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from benchmarks.harness import ROOT, load, machine, measure


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny models and batches, 1 repeat: checks the harness")
    p.add_argument(
        "--dp", action="store_true", help="the private-training section only (benchmarks/dp.py), --quick passed on"
    )
    p.add_argument("--models", nargs="+", help="model names (default: all); see benchmarks/models.py")
    p.add_argument("--only", help="regular expression: run only cases whose 'model method' matches")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    p.add_argument("--threads", type=int, default=2, help="torch threads in each case (default 2)")
    p.add_argument("--warmup", type=int, help="steps before timing (default 1)")
    p.add_argument("--repeats", type=int, help="most timed steps per case (default 7, quick 1)")
    p.add_argument("--seconds", type=float, default=4.0, help="timing budget per case; at least 3 repeats")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a case is abandoned")
    p.add_argument("--all-strategies", action="store_true", help="jacmem with every strategy on every model")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1; ratios are paired in-process)")
    p.add_argument("--memory-cap", type=float, default=3.0, help="GiB: skip cases expected to need more (default 3)")
    p.add_argument("--markdown", type=Path, help="report path (default BENCHMARKS.md; quick: out/benchmarks-quick/)")
    p.add_argument("--plot", type=Path, help="plot path (default benchmarks/results.png; quick: out/benchmarks-quick/)")
    p.add_argument("--note", default="", help="a sentence for the report's header, e.g. what else ran meanwhile")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="rewrite the report and plot from the results.json of one or more runs (the first has the metadata); run nothing",
    )
    args = p.parse_args(argv)
    quick_dir = ROOT / "out" / "benchmarks-quick"
    args.markdown = args.markdown or (quick_dir / "BENCHMARKS.md" if args.quick else ROOT / "BENCHMARKS.md")
    args.plot = args.plot or (quick_dir / "results.png" if args.quick else ROOT / "benchmarks" / "results.png")
    args.warmup = 1 if args.warmup is None else args.warmup
    args.repeats = (1 if args.quick else 7) if args.repeats is None else args.repeats
    if args.quick:
        args.seconds = 0.0
    return args


def cases(args) -> list[dict]:
    import torch

    from benchmarks.methods import EXTENSIONS, expected_extra, methods_for
    from benchmarks.models import MODELS

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for name in args.models or list(MODELS):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        model, X, _ = MODELS[name].build(args.quick)
        per_sample = X.shape[0] * sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
        has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
        compare = EXTENSIONS if args.all_strategies else MODELS[name].compare_strategies
        for method in methods_for(model, compare):
            if args.only and not re.search(args.only, f"{name} {method}"):
                continue
            case = dict(model=name, method=method, quick=args.quick, device=device, threads=args.threads)
            case.update(warmup=args.warmup, repeats=args.repeats, seconds=args.seconds)
            expected = expected_extra(method, per_sample, has_conv) / 2**30
            if expected > args.memory_cap:
                case["skip"] = (
                    f"skipped: would need about {expected:.1f} GiB above plain (--memory-cap {args.memory_cap:g})"
                )
            out.append(case)
    return out


def progress(i: int, total: int, r: dict) -> str:
    head = f"[{i}/{total}] {r['model']} {r['method']}"
    if "error" in r:
        return f"{head}: n/a ({r['error']})"
    line = f"{head}: {r['time_s'] * 1e3:.0f} ms"
    if r.get("paired_ratio"):
        line += f" ({r['paired_ratio']:.2f}x plain)"
    if r.get("extra_bytes") is not None:
        line += f", peak +{r['extra_bytes'] / 2**20:.0f} MiB over setup"
    return line


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dp:
        from benchmarks import dp

        return dp.main(["--quick"] if args.quick else [])
    from benchmarks import report

    if args.from_json:
        runs = [json.loads(path.read_text()) for path in args.from_json]
        results = [r for saved in runs for r in saved["results"]]
        meta = dict(runs[0]["meta"], **({"note": args.note} if args.note else {}))
        report.write(results, meta, args.markdown, args.plot)
        print(f"wrote {args.markdown} and {args.plot} from {', '.join(map(str, args.from_json))}", file=sys.stderr)
        return

    todo = cases(args)
    args.plot.parent.mkdir(parents=True, exist_ok=True)  # results.partial.json goes there from the first case
    started, load_before = time.time(), load()
    print(f"{len(todo)} cases, each in its own process; load average {' '.join(load_before)}", file=sys.stderr)
    results: list[dict] = [{}] * len(todo)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(measure, case, args.timeout): i for i, case in enumerate(todo)}
        for done, future in enumerate(as_completed(futures), 1):
            results[futures[future]] = future.result()
            print(progress(done, len(todo), results[futures[future]]), file=sys.stderr, flush=True)
            partial = args.plot.with_name("results.partial.json")  # what is done so far, should the run stop
            partial.write_text(json.dumps([r for r in results if r], indent=1))
    args.plot.with_name("results.partial.json").unlink()
    meta = dict(
        command="python -m benchmarks"
        + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv)),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        minutes=(time.time() - started) / 60,
        load_before=" ".join(load_before),
        load_after=" ".join(load()),
        threads=args.threads,
        quick=args.quick,
        note=args.note,
        **machine(),
    )
    report.write(results, meta, args.markdown, args.plot)
    print(f"wrote {args.markdown} and {args.plot} in {meta['minutes']:.1f} min", file=sys.stderr)
