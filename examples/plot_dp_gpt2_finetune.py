"""Private fine-tuning of a GPT-2 with most weights frozen
=======================================================

DP-SGD fine-tuning of a tiny Hugging Face GPT-2 (``GPT2LMHeadModel`` from a config,
random weights: nothing is downloaded) in the style of parameter-efficient
fine-tuning: every weight is frozen except those of the last transformer block and the
final layer norm. jacmem's ``PrivacyEngine`` clips each sequence's gradient over the
trainable parameters alone (the frozen ones cost nothing), and the model stays the
Hugging Face object (no wrapper): ``model.generate`` and ``model.config`` work as
before. The task: sequences that count up by a fixed step modulo the vocabulary, the
next-token loss of HF's ``labels=``. The script prints the loss and ε (at δ = 1e-5)
after each epoch, and a sequence the model generates at the end.

Run: ``python examples/plot_dp_gpt2_finetune.py``; ``JACMEM_QUICK=1`` for a small, fast
run. The docs build runs it so: eight steps, after which the loss is still near chance
(``ln 32``), so its figure shows ε alone, which the accountant gives exactly whatever the
run's length; the loss is plotted at full size.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from jacmem.privacy import PrivacyEngine

QUICK = os.environ.get("JACMEM_QUICK") == "1"
LAYERS, WIDTH, VOCAB, T = (2, 32, 32, 12) if QUICK else (4, 64, 32, 24)
SAMPLES, BATCH, EPOCHS = (64, 16, 2) if QUICK else (1024, 64, 4)
SIGMA, C, DELTA, LR = 0.8, 1.0, 1e-5, 0.2


def counting_sequences(n: int, seed: int = 0) -> TensorDataset:
    """``n`` token sequences [T]: a random start, then +1, +2 or +3 per token, modulo
    the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    return TensorDataset((start + step * torch.arange(T)) % VOCAB)


def tiny_gpt2() -> GPT2LMHeadModel:
    """Random weights; all frozen but the last block's and the final layer norm's."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=T, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    model.requires_grad_(False)
    model.transformer.h[-1].requires_grad_(True)
    model.transformer.ln_f.requires_grad_(True)
    return model


def plot(history: list[tuple[int, float, float]]) -> None:
    """The mean training loss (not in quick mode: too few steps to show anything) and ε
    after each epoch (left open: the gallery shows it)."""
    from matplotlib import pyplot as plt

    epochs, losses, epsilons = zip(*history)
    if QUICK:
        fig, ax_eps = plt.subplots(figsize=(5, 3.5), layout="constrained")
    else:
        fig, (ax_loss, ax_eps) = plt.subplots(1, 2, figsize=(10, 3.5), layout="constrained")
        ax_loss.plot(epochs, losses, marker="o")
        ax_loss.set(xlabel="epoch", ylabel="mean training loss", title="next-token loss", xticks=epochs)
    ax_eps.plot(epochs, epsilons, marker="o", color="C1")
    ax_eps.set(xlabel="epoch", ylabel=f"ε at δ = {DELTA:g}", title="privacy spent", xticks=epochs)


def main() -> None:
    model = tiny_gpt2()
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(
        f"GPT-2, {LAYERS} layers, d={WIDTH}: {sum(p.numel() for p in trainable):,} of "
        f"{sum(p.numel() for p in model.parameters()):,} parameters trainable"
    )
    optimizer = torch.optim.SGD(trainable, lr=LR)
    loader = DataLoader(counting_sequences(SAMPLES), batch_size=BATCH)
    engine = PrivacyEngine()
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=C
    )
    assert private is model  # the Hugging Face model itself
    history = []  # (epoch, mean loss, ε)
    try:
        for epoch in range(EPOCHS):
            losses = []
            for (ids,) in loader:
                optimizer.zero_grad()
                loss = model(ids, labels=ids).loss  # every sequence has T tokens: the mean of per-sequence means
                loss.backward()
                optimizer.step()
                if len(ids):
                    losses.append(loss.item())
            history.append((epoch + 1, sum(losses) / len(losses), engine.get_epsilon(DELTA)))
            print(f"epoch {epoch + 1}: mean loss {history[-1][1]:.3f}, ε = {history[-1][2]:.2f} at δ = {DELTA:g}")
    finally:
        engine.detach()
    plot(history)
    prompt = torch.tensor([[3, 5, 7]])
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    print(f"prompt {prompt[0].tolist()} -> generated {out[0, 3:].tolist()}")


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    main()
