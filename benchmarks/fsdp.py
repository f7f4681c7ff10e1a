"""Private training beyond one process: a DP-SGD step under FSDP2 against DDP and one process.

``python -m benchmarks.fsdp`` (``make bench`` runs it) times one private step of jacmem's
:class:`jacmem.privacy.PrivacyEngine` (forward, backward, clipping, noise and the SGD
update; flat clipping, ``C = 1``, ``σ = 1``, no Poisson sampling: the same global batch
every step) on a tiny-but-not-trivial HF GPT-2 (4 layers, d = 256, 4 heads, vocabulary
2048, tied embeddings, ``T = 64``, a global batch of 16 sequences) in four settings:

- one process, 1 thread, on the whole batch; and one process with 2 threads (the cores
  the two ranks use together);
- DDP (``DistributedDataParallel``), 2 gloo ranks on the CPU, 1 thread each, each rank
  on its 8 rows of the batch;
- FSDP2 (``fully_shard`` on each block, then the root), 2 gloo ranks, 1 thread each.

In each setting, an ordinary SGD step of an untouched copy of the model, wrapped alike,
alternates with the private step in the same processes (the ranks meet at a barrier
before each step; rank 0's clock); the table gives the medians (and min–max) of both
over the timed steps after one warm-up pair, and the median of the per-step ratios (a
shared machine's load moves both alike). The table is written to BENCHMARKS.md between
``<!-- fsdp:start -->`` and ``<!-- fsdp:end -->``; ``--quick``: tiny sizes, one step,
written to ``out/fsdp-quick.md`` (it checks the harness).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import tempfile
import time
import warnings

from benchmarks import harness

ROOT = harness.ROOT
START, END = "<!-- fsdp:start -->", "<!-- fsdp:end -->"
#: (label, ranks, threads per rank, wrapping)
SETTINGS = (
    ("one process, 1 thread", 1, 1, "none"),
    ("one process, 2 threads", 1, 2, "none"),
    ("DDP, 2 ranks × 1 thread", 2, 1, "ddp"),
    ("FSDP2, 2 ranks × 1 thread", 2, 1, "fsdp"),
)
LR, SIGMA, C = 0.1, 1.0, 1.0


def sizes(quick: bool) -> dict:
    """The model (layers, d, heads, vocabulary) and the global batch [N, T]."""
    if quick:
        return dict(layers=1, d=16, heads=2, vocab=64, N=4, T=8)
    return dict(layers=4, d=256, heads=4, vocab=2048, N=16, T=64)


def wrap(model, wrapping: str):
    """``model`` (a :class:`benchmarks.models.CausalLM`) as the setting trains it."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    if wrapping == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if wrapping == "fsdp":
        for block in model.lm.transformer.h:
            fully_shard(block)
        fully_shard(model)
    return model


def prepare(private: bool, model, X, y, full_batch: int):
    """A ``step()``: one SGD step of ``model`` on ``(X, y)`` (this rank's rows), private
    (jacmem's PrivacyEngine, the global batch ``full_batch``) or not."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from jacmem.privacy import PrivacyEngine

    lossfunc = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if private:
        # the loader only tells the engine the batch size: each rank's share of the global batch
        share = full_batch // (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        model, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(X, y), batch_size=share),
            noise_multiplier=SIGMA, max_grad_norm=C, poisson_sampling=False,
        )  # fmt: skip

    def step():
        opt.zero_grad(set_to_none=True)
        lossfunc(model(X), y).backward()
        opt.step()

    return step


def rank_main(rank: int, case: dict, store: str, out: str) -> None:
    """One rank of a setting: the paired steps, rank 0's times saved to ``out``."""
    import torch
    import torch.distributed as dist

    from benchmarks.models import CausalLM, token_batch

    torch.set_num_threads(case["threads"])
    warnings.simplefilter("ignore")
    world = case["ranks"]
    if world > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    s = sizes(case["quick"])
    torch.manual_seed(0)  # the same model and global batch in every rank
    model = CausalLM(s["layers"], s["d"], s["heads"], s["vocab"], s["T"])
    X, y = token_batch((s["N"], s["T"]), s["vocab"])
    share = s["N"] // world
    X, y = X[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    plain = prepare(False, wrap(copy.deepcopy(model), case["wrapping"]), X, y, s["N"])
    private = prepare(True, wrap(model, case["wrapping"]), X, y, s["N"])

    def timed(step) -> float:
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    plain(), private()
    times = [(timed(plain), timed(private)) for _ in range(case["repeats"])]
    if rank == 0:
        torch.save(times, out)
    if world > 1:
        # a spawned rank: leave at once, the group as it is (destroying it joins gloo's
        # threads while holding the GIL, which one of them may wait for: a hang, now and then)
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)


def child(case: dict) -> dict:
    """One setting: its ranks spawned (gloo, meeting through a file), rank 0's times."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        args = (case, f"file://{os.path.join(tmp, 'rendezvous')}", out)
        if case["ranks"] == 1:
            rank_main(0, *args)
        else:
            mp.start_processes(rank_main, args=args, nprocs=case["ranks"], join=True, start_method="spawn")
        times = torch.load(out)
    plain, private = zip(*times)
    return dict(case, plain=list(plain), private=list(private), ratio=statistics.median(b / a for a, b in times))


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.0f} ({min(times) * 1e3:.0f}–{max(times) * 1e3:.0f})"


def table(results: list[dict], args) -> list[str]:
    s = sizes(args.quick)
    info = harness.machine()
    lines = [
        START,
        "## Private training under FSDP2: a DP-SGD step against DDP and one process",
        "",
        f"`python -m benchmarks.fsdp{' --quick' if args.quick else ''}` ({args.started}; {info['cpu']}, "
        f"{info['cores']} cores, torch {info['torch']}; load average {args.load_before} before, "
        f"{' '.join(harness.load())} after). HF GPT-2, {s['layers']} layers, d = {s['d']}, vocabulary {s['vocab']} "
        f"(tied), T = {s['T']}, a global batch of {s['N']}. One step: forward, backward, clipping, noise and the SGD "
        f"update (jacmem's PrivacyEngine, flat clipping, C = {C:g}, σ = {SIGMA:g}, no Poisson sampling); the "
        "ordinary SGD step of a copy wrapped alike alternates with it in the same processes, gloo ranks on the CPU "
        f"meeting at a barrier before each step, rank 0's clock; {args.repeats} pairs after one warm-up pair: "
        "medians (min–max), and the median of the per-step ratios." + (" " + args.note if args.note else ""),
        "",
        "| setting | DP step (ms) | SGD step (ms) | DP × SGD | DP × one process's DP (1 thread) |",
        "|---|---|---|---|---|",
    ]
    base = next((r for r in results if r["ranks"] == 1 and r["threads"] == 1 and "error" not in r), None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | fails: {r['error'].replace('|', '/')} | | | |")
            continue
        against = statistics.median(r["private"]) / statistics.median(base["private"]) if base else None
        lines.append(
            f"| {r['label']} | {_ms(r['private'])} | {_ms(r['plain'])} | {r['ratio']:.2f} | "
            f"{'n/a' if against is None else f'{against:.2f}'} |"
        )
    return [*lines, "", END]


def main(argv=None) -> None:
    p = harness.parser("fsdp", __doc__, timeout=900.0)
    args = p.parse_args(argv)
    if args.child:
        harness.answer(args.child, child)
        return
    args.repeats = args.repeats or (1 if args.quick else 7)
    markdown = args.markdown or (ROOT / "out" / "fsdp-quick.md" if args.quick else ROOT / "BENCHMARKS.md")
    args.load_before = " ".join(harness.load())
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for i, (label, ranks, threads, wrapping) in enumerate(SETTINGS, 1):
        case = dict(label=label, ranks=ranks, threads=threads, wrapping=wrapping, quick=args.quick)
        case["repeats"] = args.repeats
        r = harness.run_case(case, args.timeout, child=("-m", "benchmarks.fsdp", "--child"), env=harness.TIME_MALLOC)
        results.append(r)
        shown = r["error"] if "error" in r else f"DP {_ms(r['private'])} ms, {r['ratio']:.2f}x an SGD step"
        print(f"[{i}/{len(SETTINGS)}] {label}: {shown}", file=sys.stderr, flush=True)
    block = "\n".join(table(results, args))
    print(block)
    harness.write_block(markdown, block, START, END)


if __name__ == "__main__":
    main()
