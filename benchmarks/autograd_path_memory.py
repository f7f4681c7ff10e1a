"""Peak memory of the second-order autograd path beside a plain backward (issue 16).

A small HF BERT classifier (2 layers, hidden 64, 4 heads, batch 8, 32 tokens, 3
labels, float32) on CPU: the peak of forward + backward above what was in use before
(:func:`jacmem.memory.peak_memory`), for a plain backward and inside
``jacmem.extend(ext)`` at the default ``chunk_bytes``; medians of repeats after one
warm-up. Run: ``python -m benchmarks.autograd_path_memory [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import transformers

import jacmem
from jacmem.memory import peak_memory


def bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256, vocab_size=512,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = bert()
    ids, y = torch.randint(0, 512, (8, 32)), torch.randint(0, 3, (8,))

    def step(*exts):
        def run():
            model.zero_grad(set_to_none=True)
            if not exts:
                F.cross_entropy(model(ids).logits, y).backward()
                return
            with jacmem.extend(*exts):
                F.cross_entropy(model(ids).logits, y).backward()
            for p in model.parameters():  # the results are the point, not the peak: drop them
                for field in ("diag_ggn_exact", "diag_ggn_exact_batch", "kflr", "kfac"):
                    if hasattr(p, field):
                        delattr(p, field)

        return run

    cases = {
        "plain backward": step(),
        "DiagGGNExact": step(jacmem.DiagGGNExact()),
        "BatchDiagGGNExact": step(jacmem.BatchDiagGGNExact()),
        "KFLR": step(jacmem.KFLR()),
        "DiagGGNMC": step(jacmem.DiagGGNMC()),
    }
    peaks = {}
    for name, run in cases.items():
        run()  # warm-up
        peaks[name] = statistics.median(peak_memory(run) for _ in range(args.repeats))
    base = peaks["plain backward"]
    for name, peak in peaks.items():
        print(f"{name:20s} {peak / 2**20:8.2f} MiB  {peak / base:5.2f}x plain")


if __name__ == "__main__":
    main()
