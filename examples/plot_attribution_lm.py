"""Which training sequences raise a language model's loss on a query, and which lower it
=======================================================================================

Training-data attribution on a tiny Hugging Face GPT-2 (``GPT2LMHeadModel`` from a
config, random initial weights: nothing is downloaded). Its training set holds three kinds
of token sequences: from every start token, one sequence that counts up by 2 modulo the
vocabulary and one that counts up by 3; and four *corrupted* ones that count by 2 for six
tokens and then jump by 5. After training, :class:`jacmem.attribution.Influence` (EK-FAC)
scores every training sequence against a query, the count by 2 from 13. A positive score
says that training on that sequence lowered the query's loss (it helped); a negative
score, that it raised it. The sequence that helps most should be the query's own twin in
the training set; the one that raises its loss most, the corrupted sequence that shares
its first six tokens and teaches another continuation; counts by 3 from the same start
disagree with it from the second token on. The figure shows every training sequence's
score, coloured by its kind.

jacmem computes the per-sequence gradients of every layer in one backward pass, HF's
``Conv1D`` and the embeddings included (kronfluence tracks ``nn.Linear`` and
``nn.Conv2d`` only). The model here keeps its head apart from the token embedding
(``tie_word_embeddings=False``) so that EK-FAC has one Kronecker block per weight.

Run: ``python examples/plot_attribution_lm.py``; ``JACMEM_QUICK=1`` for a small, fast run
(fewer training steps: the ranking the text describes holds there too).
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from jacmem.attribution import Influence

QUICK = os.environ.get("JACMEM_QUICK") == "1"
VOCAB, T = 24, 12
CORRUPTED_STARTS = (1, 7, 13, 19)  # the query starts at 13
STEPS, LR = (150, 3e-3) if QUICK else (400, 3e-3)
KINDS = ("counts by 2", "counts by 3", "corrupted: by 2, then +5")


def sequences(kind: int, starts: torch.Tensor) -> torch.Tensor:
    """Token sequences [len(starts), T] of one kind (an index into KINDS)."""
    steps = torch.full((len(starts), T), 3 if kind == 1 else 2)
    if kind == 2:
        steps[:, 6:] = 5
    steps[:, 0] = 0
    return (starts[:, None] + steps.cumsum(1)) % VOCAB


def training_set() -> tuple[torch.Tensor, torch.Tensor]:
    """ids [n, T] and each sequence's kind [n]: a count by 2 and a count by 3 from every
    start, and a few corrupted counts."""
    every, corrupted = torch.arange(VOCAB), torch.tensor(CORRUPTED_STARTS)
    parts = [sequences(0, every), sequences(1, every), sequences(2, corrupted)]
    kinds = torch.cat([torch.full((len(p),), k) for k, p in enumerate(parts)])
    return torch.cat(parts), kinds


def sequence_loss(model, batch) -> torch.Tensor:
    """The summed next-token cross-entropy of each sequence, summed over the batch: the
    ``loss_fn`` that Influence expects (a sum of per-example losses)."""
    (ids,) = batch
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=T, tie_word_embeddings=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train(model: GPT2LMHeadModel, ids: torch.Tensor) -> None:
    """Full-batch Adam on the mean next-token loss."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sequence_loss(model, (ids,)) / ids[:, 1:].numel()
        loss.backward()
        optimizer.step()
        if step in (0, STEPS - 1):
            print(f"step {step + 1}: mean next-token loss {loss.item():.3f}")


def plot(scores: torch.Tensor, kinds: torch.Tensor) -> None:
    """Every training sequence's score, sorted, coloured by kind (left open: the gallery
    shows it)."""
    from matplotlib import pyplot as plt

    order = scores.argsort(descending=True)
    fig, ax = plt.subplots(figsize=(9, 3.8), layout="constrained")
    for k, label in enumerate(KINDS):
        where = (kinds[order] == k).nonzero().flatten()
        ax.bar(where, scores[order][where], width=1.0, color=f"C{k}", label=label)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(
        xlabel="training sequences, by score", ylabel="influence on the query's loss",
        title="positive: training on it lowered the query's loss; negative: raised it",
    )  # fmt: skip
    ax.legend()


def main() -> None:
    ids, kinds = training_set()
    model = tiny_gpt2()
    train(model, ids)
    model.eval()
    query = sequences(0, torch.tensor([13]))
    train_loader = DataLoader(TensorDataset(ids), batch_size=16)
    query_loader = DataLoader(TensorDataset(query), batch_size=1)
    influence = Influence(model, sequence_loss, curvature="ekfac", progress=False)
    influence.fit(train_loader)
    scores = influence.scores(query_loader, train_loader)[0]  # [n_train]
    print(f"query {query[0].tolist()}")
    order = scores.argsort(descending=True)
    for title, picks in (("lower its loss most", order[:3]), ("raise its loss most", order.flip(0)[:3])):
        print(f"training sequences that {title}:")
        for i in picks.tolist():
            print(f"  {scores[i]:+.3g}  {KINDS[kinds[i]]:<26} {ids[i].tolist()}")
    for k, label in enumerate(KINDS):
        print(f"mean score, {label}: {scores[kinds == k].mean():+.3g}")
    plot(scores, kinds)


# %%
# How to read the numbers: with jacmem's conventions a score is, to first order, how much
# the query's loss would rise if that sequence were left out of training, in the loss's
# own units (nats here). The twin's score is far larger than the change that leaving one
# sequence out could make: the estimate is linear and local, and the model was trained a
# fixed number of steps, not to a minimum. Trust the ranking and the sign, not the size;
# :doc:`/guide/attribution`
# says more.

if __name__ == "__main__":
    main()
