"""One benchmark case in its own process: ``python -m benchmarks.child '<json>'``.

Builds the model and batch, prepares the method, then measures. On CPU: the resident
set size after setup, and the peak during the steps (``VmHWM``, its high-water
mark reset after setup where Linux allows; ``benchmarks.harness.measure`` takes
time and memory in separate processes on CPU, with different glibc settings); on CUDA:
``torch.cuda.max_memory_allocated`` above what was allocated after setup. Time: the
median over up to ``repeats`` steps (fewer for slow steps: about
``seconds`` in all, and at least 3) after ``warmup`` steps; and, against a plain
forward+backward of an unhooked copy of the model timed just before each step, the
median of the ratios. Prints one JSON line.
"""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
import warnings

from benchmarks.harness import answer, peak_rss_bytes, reset_peak, rss_bytes


def run(case: dict) -> dict:
    import torch

    torch.set_num_threads(case["threads"])
    warnings.simplefilter("ignore")
    from benchmarks.methods import prepare
    from benchmarks.models import MODELS

    device = torch.device(case["device"])
    model, X, y = MODELS[case["model"]].build(case["quick"], case.get("batch"))
    model, X, y = model.to(device), X.to(device), y.to(device)
    log: dict = {}
    # an unhooked twin, for plain steps timed alternately with the method's, so that
    # the ratio holds even while other work slows the machine down
    paired = case["method"] != "plain" and case.get("paired", True)
    plain_step = prepare("plain", copy.deepcopy(model), X, y, {}) if paired else None
    step = prepare(case["method"], model, X, y, log)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    gc.collect()
    sync()
    rss_setup = rss_bytes()
    reset = reset_peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        allocated_setup = torch.cuda.memory_allocated()

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    warm = [timed(step) for _ in range(case["warmup"])]
    repeats = case["repeats"]
    if warm and case["seconds"] > 0:  # fewer repeats for slow steps, never fewer than 3
        repeats = max(min(3, repeats), min(repeats, int(case["seconds"] / warm[-1])))
    times, ratios = [], []
    for _ in range(repeats):
        reference = timed(plain_step) if paired else None
        times.append(timed(step))
        if paired:
            ratios.append(times[-1] / reference)
    peak = peak_rss_bytes()
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = dict(
        case,
        time_s=statistics.median(times),
        times_s=times,
        paired_ratio=statistics.median(ratios) if ratios else None,
        rss_setup=rss_setup,
        rss_peak=peak,
        extra_bytes=peak - rss_setup if reset or peak > rss_setup else None,
        batch=X.shape[0],
        n_params=n_params,
        per_sample_bytes=X.shape[0] * n_params * 4,
        explain=log.get("explain"),
    )
    if cuda:
        out["extra_bytes"] = torch.cuda.max_memory_allocated() - allocated_setup
    return out


def main() -> None:
    answer(sys.argv[1], run)


if __name__ == "__main__":
    main()
