"""Bayesian LoRA: a Laplace approximation over a language model's adapters
=========================================================================

The Laplace-LoRA recipe (Yang et al., ICLR 2024): fine-tune a language model's LoRA
adapters (MAP), then put a Kronecker-factored Laplace approximation over the adapters
alone, and predict with it. The base model stays frozen; the Gaussian has as many
dimensions as the adapters have weights.

Here the model is a tiny Hugging Face LLaMA (``LlamaForCausalLM`` from a config, 2
layers, d=64, vocabulary 32000, random weights: nothing is downloaded) with PEFT's LoRA
adapters on ``q_proj`` and ``v_proj``. The task is multiple choice: each prompt holds one
of ``K`` marker tokens among random filler tokens, and the answer is the next token,
one of ``K`` answer tokens, that names the marker. The model's answer is its last
position's logits over the answer tokens, ``[N, K]`` (the frozen LM head's output at the
answer tokens). Only the adapters train: the base model and its head stay frozen, as in
the paper. laplace-torch fits the Laplace over the adapters with
``backend=jacmem.laplace.JacmemGGN`` (jacmem's ``KFLR``), tunes the prior precision by
the marginal likelihood, and predicts (GLM, probit) on held-out prompts in distribution,
and out of distribution: prompts with no marker at all, where no answer is right and a
calibrated model says so.

jacmem's curvature of an LLaMA runs through autograd (rotary embeddings and attention
are functions, not modules). It splits the GGN at the loss's input, the ``[N, K]``
answer logits: the frozen attention, MLP, norms and head between the last adapter and
the loss are part of the Jacobian, which jacmem crosses by vector-Jacobian products only
(SDPA, HF's default attention, has no double backward on the CPU, and needs none), and
the loss Hessian is the cross-entropy's over ``K`` classes. The script checks jacmem's
Kronecker factors against laplace's curvlinops backend on one batch, and that the
Laplace is less confident than MAP where no answer is right.

Run: ``python examples/plot_bayesian_lora.py``; ``JACMEM_QUICK=1`` (as the docs build
runs it) for fewer prompts and training steps. It prints a table and saves
``out/plot_bayesian_lora.png``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from laplace import Laplace  # noqa: E402
from laplace.curvature import CurvlinopsGGN  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from jacmem.laplace import JacmemGGN  # noqa: E402

QUICK = os.environ.get("JACMEM_QUICK") == "1"
VOCAB, K = 32000, 4
#: prompt length, training prompts, training steps, test prompts (each kind)
T, N_TRAIN, STEPS, N_TEST = (12, 128, 40, 64) if QUICK else (16, 1024, 150, 512)
#: the marker tokens that may appear in a prompt, and the answer token of each
MARKERS, ANSWERS = torch.arange(200, 200 + K), torch.arange(100, 100 + K)
FILLER = (1000, VOCAB)


def prompts(n: int, generator: torch.Generator, marked: bool = True) -> tuple[Tensor, Tensor]:
    """``n`` prompts ``[n, T]`` of filler tokens, each with marker ``y`` at a random
    place before the last (``marked``; else no marker), and the labels ``y [n]``."""
    ids = torch.randint(*FILLER, (n, T), generator=generator)
    y = torch.randint(0, K, (n,), generator=generator)
    if marked:
        ids[torch.arange(n), torch.randint(0, T - 1, (n,), generator=generator)] = MARKERS[y]
    return ids, y


class AnswerLogits(nn.Module):
    """ids ``[N, T]`` -> the last position's logits over the answer tokens ``[N, K]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, logits_to_keep=1).logits[:, -1, ANSWERS]


def lora_llama() -> AnswerLogits:
    """A random tiny LLaMA with LoRA (rank 4) on ``q_proj`` and ``v_proj``, the only
    trainable parameters: the base and its LM head frozen."""
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=T, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return AnswerLogits(peft.get_peft_model(transformers.LlamaForCausalLM(config), lora))


def train(model: AnswerLogits, X: Tensor, y: Tensor, generator: torch.Generator) -> AnswerLogits:
    """MAP: Adam on the trainable parameters, mini-batches of 32."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(STEPS):
        i = torch.randint(0, len(X), (32,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X[i]), y[i]).backward()
        optimizer.step()
    return model.eval()


def check_factors(model: AnswerLogits, X: Tensor, y: Tensor) -> float:
    """jacmem's Kronecker factors of every trainable parameter on one batch against
    laplace's curvlinops backend (its exact KFAC, expanded over tokens); the largest
    relative difference."""
    got, want = (backend(model, "classification").kron(X, y, N=len(X))[1] for backend in (JacmemGGN, CurvlinopsGGN))
    worst = 0.0
    for ours, theirs in zip(got.kfacs, want.kfacs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            worst = max(worst, float((a - b).norm() / b.norm()))
    assert worst < 1e-4, f"jacmem's Kronecker factors differ from curvlinops' by {worst:.2g}"
    return worst


def scores(probs: Tensor, y: Tensor | None) -> dict[str, float]:
    """Mean confidence (largest probability); with labels, accuracy, NLL and ECE (10 bins)."""
    confidence, guess = probs.max(-1)
    out = {"confidence": confidence.mean().item()}
    if y is not None:
        right = (guess == y).double()
        bins = (confidence * 10).long().clamp(max=9)
        ece = sum((right[bins == b].sum() - confidence[bins == b].sum()).abs() for b in range(10)) / len(y)
        nll = -probs[torch.arange(len(y)), y].clamp(min=1e-12).log().mean()
        out.update(accuracy=right.mean().item(), nll=nll.item(), ece=float(ece))
    return out


# %%
# MAP: fine-tune the adapters. The marker's token reaches the last position
# only through attention, whose queries and values the adapters change.

torch.manual_seed(0)
data = torch.Generator().manual_seed(0)
model = lora_llama()
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
total = sum(p.numel() for p in model.parameters())
print(f"LLaMA, 2 layers, d=64, vocabulary {VOCAB}: {trainable:,} of {total:,} parameters trainable")
X, y = prompts(N_TRAIN, data)
train(model, X, y, data)

# %%
# The curvature. jacmem's Kronecker factors of the adapters first, against laplace's
# curvlinops backend on one batch; then laplace fits the Laplace over all trainable
# parameters (the adapters alone) with jacmem's backend, and tunes the prior precision
# by the marginal likelihood.

worst = check_factors(model, X[:16], y[:16])
print(f"Kronecker factors on one batch: jacmem's equal curvlinops' within {worst:.1e} (relative)")
la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron", backend=JacmemGGN)
la.fit(DataLoader(TensorDataset(X, y), batch_size=32))
warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")  # it is what we use
la.optimize_prior_precision(method="marglik", n_steps=20 if QUICK else 100, link_approx="probit")
print(f"prior precision {la.prior_precision.item():.3g}, log marginal likelihood {la.log_marginal_likelihood():.1f}")

# %%
# The predictive, MAP's softmax against the Laplace's (GLM, probit), on held-out prompts
# and on prompts with no marker, where every answer is as good as another.

tests = {
    "held-out prompts": prompts(N_TEST, data),
    "no marker (OOD)": (prompts(N_TEST, data, marked=False)[0], None),
}
predictors = {
    "MAP": lambda X: torch.softmax(model(X), -1),
    "Laplace": lambda X: la(X, pred_type="glm", link_approx="probit"),
}
results = {}
with torch.no_grad():
    for name, predict in predictors.items():
        results[name] = {test: scores(predict(Xt), yt) for test, (Xt, yt) in tests.items()}
print(f"{'':>8}{'accuracy':>10}{'NLL':>8}{'ECE':>8}{'confidence':>12}{'OOD confidence':>16}")
for name, r in results.items():
    i, o = r["held-out prompts"], r["no marker (OOD)"]
    row = (i["accuracy"], i["nll"], i["ece"], i["confidence"], o["confidence"])
    print(f"{name:>8}" + "".join(f"{v:>{w}.3f}" for v, w in zip(row, (10, 8, 8, 12, 16))))
assert results["Laplace"]["no marker (OOD)"]["confidence"] < results["MAP"]["no marker (OOD)"]["confidence"]

# %%
# The same as bars. Where no answer is right, the Laplace's confidence falls towards
# the uniform ``1 / K``; MAP stays sure.

fig, axes = plt.subplots(1, 4, figsize=(13, 3.5), layout="constrained")
bars = [("accuracy", "held-out prompts"), ("nll", "held-out prompts"), ("ece", "held-out prompts")]
bars.append(("confidence", "no marker (OOD)"))
for ax, (what, test) in zip(axes, bars):
    ax.bar(list(results), [r[test][what] for r in results.values()], color=["C0", "C1"])
    ax.set_title(f"{what} ({test})")
axes[-1].axhline(1 / K, color="grey", linestyle=":", label="uniform")
axes[-1].legend(loc="lower right")
fig.suptitle("LoRA on a tiny LLaMA: MAP vs a Kronecker Laplace over the adapters (backend=JacmemGGN)")
out = Path(globals().get("__file__", "plot_bayesian_lora.py")).resolve().parents[1] / "out"
out.mkdir(parents=True, exist_ok=True)
fig.savefig(out / "plot_bayesian_lora.png", dpi=100)
