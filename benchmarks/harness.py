"""What every benchmark shares: one case in a process of its own, the glibc settings
for timing and for memory, the resident set size, a method's steps timed against plain
ones, the cells of a table of such cases, and writing a block of BENCHMARKS.md.

The driver (:mod:`benchmarks.run`) and each benchmark import this module; it imports no
other module of ``benchmarks``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: glibc settings for the timed process: freed memory stays in the heap for the next
#: step, as jemalloc or tcmalloc would keep it. With glibc's defaults every buffer over
#: 32 MiB is a fresh mapping whose pages fault in at every step, which on a VM can cost
#: as much as the step's arithmetic and moves single ratios by half from run to run.
TIME_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)}
#: glibc settings for the memory process: every buffer over 64 KiB is its own mapping,
#: returned at once when freed, so that the peak resident set is the peak of live memory
#: (with TIME_MALLOC it would include what the heap kept)
MEMORY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def run_case(case: dict, timeout: float, child=("-m", "benchmarks.child"), env: dict | None = None) -> dict:
    """Run one case in a process of its own (``python <child> <case as JSON>``, with
    ``env`` added), and return the dict it prints after ``RESULT ``, or the case with
    an ``error``."""
    if "skip" in case:
        return dict(case, error=case["skip"])
    threads = str(case["threads"])
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, **(env or {}))
    cmd = [sys.executable, *child, json.dumps(case)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(case, error=f"timed out after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(case, error=f"exit {proc.returncode}: {tail}"[:200])


def answer(case_json: str, fn) -> None:
    """The child's side of :func:`run_case`: print ``fn(case)`` after ``RESULT ``, or,
    where it raises (an engine that refuses the model), the case with an ``error``
    (the table's "fails: <reason>")."""
    case = json.loads(case_json)
    try:
        result = fn(case)
    except Exception as err:
        result = dict(case, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200])
    print("RESULT " + json.dumps(result), flush=True)


def measure(case: dict, timeout: float) -> dict:
    """Time and peak memory of one :mod:`benchmarks.child` case. On CPU, from two
    processes (see TIME_MALLOC and MEMORY_MALLOC): the time process's result with the
    memory process's peak; the memory process runs one warm-up step and two steps,
    unpaired. On CUDA one process gives both (``max_memory_allocated`` counts live
    tensors whatever the host allocator)."""
    if case["device"] != "cpu" or case["quick"] or "skip" in case:
        return run_case(case, timeout)
    timed = run_case(case, timeout, env=TIME_MALLOC)
    if "error" in timed:
        return timed
    memory = run_case(dict(case, warmup=1, repeats=2, seconds=0.0, paired=False), timeout, env=MEMORY_MALLOC)
    if "error" in memory:
        return dict(case, error=f"memory run: {memory['error']}"[:200])
    return dict(timed, **{k: memory[k] for k in ("rss_setup", "rss_peak", "extra_bytes")})


def paired_steps(
    step: Callable[[], object], plain: Callable[[], object] | None, repeats: int, seconds: float = 0.0
) -> tuple[list[float], list[float]]:
    """``step``'s times (s) and, where ``plain`` is given, each over a ``plain`` step timed
    right before it (the two alternated, so that the machine's drift hits both): at least
    ``repeats`` steps, more while under ``seconds`` from the start, at most ``10 × repeats``."""
    times, ratios = [], []
    begin = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - begin < seconds and len(times) < 10 * repeats):
        if plain:
            start = time.perf_counter()
            plain()
            reference = time.perf_counter() - start
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if plain:
            ratios.append(times[-1] / reference)
    return times, ratios


def failure(r: dict, declined: tuple[str, ...] = ()) -> str:
    """A failed case's table cell: its error where the case declined (the error, or its
    message after the exception's name, starts with one of ``declined``: ``"skipped"``,
    ``"not run"``), else ``"fails: <the message>"``; ``|`` made ``/`` (a cell's bar)."""
    error = r["error"].replace("|", "/")
    message = error.split(": ", 1)[-1]
    return next((e for e in (error, message) if declined and e.startswith(declined)), "fails: " + message)


def timed_case(case: dict, step: Callable[[], object], plain: Callable[[], object] | None) -> dict:
    """``case`` with its measurements: one warm-up of ``step`` (and ``plain``), then
    :func:`paired_steps` over ``case["repeats"]``: the median step time (s), the ratios over
    ``plain`` (where given), and the process's peak resident set."""
    step()
    if plain:
        plain()
    gc.collect()
    times, ratios = paired_steps(step, plain, case["repeats"])
    return dict(case, time_s=statistics.median(times), ratios=ratios, peak_bytes=peak_rss_bytes())


def progress(r: dict, paired: bool, failure: Callable[[dict], str]) -> str:
    """A timed case's progress line (stderr): ``failure(r)`` where it failed; else, paired,
    its step time and median ratio over the plain step (:func:`paired_steps`), or its peak."""
    if "error" in r:
        return failure(r)
    if paired:
        return f"{r['time_s'] * 1e3:.0f} ms, {statistics.median(r['ratios']):.2f}x plain ({len(r['ratios'])} pairs)"
    return f"peak {r['peak_bytes'] / 2**20:.0f} MiB"


def timed_rows(
    results: list[dict],
    models: list[str],
    methods: list[str],
    labels: dict[str, str],
    plain_label: str,
    extra: tuple[int, Callable[[str, str, float, float | None], list[str]]],
    failure: Callable[[dict], str],
) -> list[str]:
    """The rows of a table of methods each timed against a plain step (paired results,
    ``ratios``: :func:`paired_steps`) and measured for peak memory (unpaired,
    ``peak_bytes``), ``results`` keyed by ``(model, method, paired)``. Per model, the plain
    step's row (where its peak was measured), then each method's ``| model | label | step
    (ms) | median (min–max) | peak (MiB) | × plain peak | *extra |``: ``extra = (k, cells)``,
    ``cells(model, method, median ratio, peak ratio or None)`` its last ``k`` cells; a
    failed method's row is ``failure(result)`` and empty cells."""
    k, cells = extra
    by = {(r["model"], r["method"], r["paired"]): r for r in results}
    lines = []
    for model in models:
        plain = by.get((model, "plain", False), {})
        if "peak_bytes" in plain:
            lines.append(f"| {model} | {plain_label} | | 1 | {plain['peak_bytes'] / 2**20:.0f} | 1 |" + " |" * k)
        for method in methods:
            t, m = by.get((model, method, True)), by.get((model, method, False))
            if t is None:
                continue
            if "error" in t:
                lines.append(f"| {model} | {labels[method]} | {failure(t)} | | | |" + " |" * k)
                continue
            ratio = statistics.median(t["ratios"])
            mem, mem_ratio = "n/a", None
            if m and "error" not in m:
                mem = f"{m['peak_bytes'] / 2**20:.0f}"
                mem_ratio = m["peak_bytes"] / plain["peak_bytes"] if "peak_bytes" in plain else None
            row = [
                model,
                labels[method],
                f"{t['time_s'] * 1e3:.0f}",
                f"{ratio:.2f} ({min(t['ratios']):.2f}–{max(t['ratios']):.2f})",
                mem,
                "n/a" if mem_ratio is None else f"{mem_ratio:.2f}",
                *cells(model, method, ratio, mem_ratio),
            ]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset the peak-RSS high-water mark (Linux >= 4.0); False where we cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The peak resident set size since :func:`reset_peak` (``VmHWM``). Not
    ``getrusage``'s ``ru_maxrss``: Linux carries that over ``exec`` from the parent, so a
    child's figure would be at least its parent's peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def load() -> list[str] | str:
    """The load average over 1, 5 and 15 minutes."""
    try:
        return open("/proc/loadavg").read().split()[0:3]
    except OSError:
        return "unknown"


def machine() -> dict:
    """CPU model, cores, torch and Python versions, and the GPU where there is one."""
    import platform

    import torch

    cpu = next(
        (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
        platform.processor() or "unknown",
    )
    info = dict(cpu=cpu, cores=os.cpu_count(), torch=torch.__version__, python=platform.python_version())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_block(path: Path, block: str, start: str, end: str) -> None:
    """Replace the block between ``start`` and ``end`` in ``path`` (read right before
    writing), or append it; ``path``'s folder is made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda m: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text.lstrip("\n"))


def parser(module: str, doc: str, timeout: float, **extra) -> argparse.ArgumentParser:
    """The command line every benchmark module shares (``python -m benchmarks.<module>``):
    ``--quick`` (tiny sizes, one repeat: checks the harness), ``--repeats``, ``--timeout``
    (seconds per case), ``--markdown`` (where the report goes), ``--note`` (a sentence
    for it) and the hidden ``--child`` by which a case's process is started. ``extra``:
    the module's own options, ``name=dict(add_argument's keywords)``."""
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{module}", description=" ".join(doc.split("\n\n")[0].split())
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks the harness")
    for name, kwargs in extra.items():
        p.add_argument("--" + name.replace("_", "-"), **kwargs)
    p.add_argument("--repeats", type=int, help="timed repeats (the module's default; quick: 1)")
    p.add_argument("--timeout", type=float, default=timeout)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--note", default="", help="a sentence for the report")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p
