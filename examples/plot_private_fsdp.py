"""Private fine-tuning under FSDP2: two CPU processes
====================================================

DP-SGD on a tiny Hugging Face GPT-2 (random weights, token embedding tied to the output
head: nothing is downloaded) whose blocks and root are sharded with FSDP2's
``fully_shard``, in two processes on CPU (``gloo``), started as ``torchrun`` starts them
(``python -m torch.distributed.run --standalone --nproc-per-node 2``, ``env://``
rendezvous). Each rank takes its half of every global batch. jacmem's ``PrivacyEngine``
takes the sharded model as it is: each rank ends its backward pass with its rows of the
clipped sum over the global batch in each parameter's sharded ``.grad``, and adds
Gaussian noise to those rows alone, so that every coordinate gets its noise once, from
one rank, with the ranks' noise independent (see :doc:`/guide/privacy`).

The same global batches then train the same model in this one process. With noise 0
(``noise_multiplier=0``, not private: the comparison), the two processes' loss curve
is the one process's, step by step; beside them, the sharded run with noise
(σ = 0.8), and its ε. The task: sequences that count up by a fixed step modulo the
vocabulary, the next-token loss of HF's ``labels=``.

Run: ``python examples/plot_private_fsdp.py`` (``JACMEM_QUICK=1`` for a small run). On
GPUs the worker runs as it is under ``torchrun`` with ``nccl``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from jacmem.privacy import PrivacyEngine

# sphinx-gallery runs an example without __file__, in the example's folder
HERE = Path(globals().get("__file__", "plot_private_fsdp.py")).resolve()
QUICK = os.environ.get("JACMEM_QUICK") == "1"
WORLD = 2
LAYERS, WIDTH, VOCAB, T = (2, 16, 32, 8) if QUICK else (4, 64, 32, 16)
STEPS, BATCH = (6, 8) if QUICK else (40, 32)
SIGMA, C, LR, DELTA = 0.8, 1.0, 0.5, 1e-5


def counting_sequences() -> TensorDataset:
    """``STEPS·BATCH`` token sequences [T]: a random start, then +1, +2 or +3 per token,
    modulo the vocabulary."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (STEPS * BATCH, 1), generator=g)
    step = torch.randint(1, 4, (STEPS * BATCH, 1), generator=g)
    return TensorDataset((start + step * torch.arange(T)) % VOCAB)


def tiny_gpt2() -> GPT2LMHeadModel:
    """The same random weights in every process; no dropout."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=T, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def train(model: GPT2LMHeadModel, loader: DataLoader, sigma: float) -> tuple[list[float], float]:
    """``model`` made private, one step per batch of ``loader``: (the global batch's
    mean loss at each step, ε at δ = ``DELTA``)."""
    engine = PrivacyEngine()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=C,
        poisson_sampling=False,  # the same global batches in both runs
    )  # fmt: skip
    losses = []
    try:
        for (ids,) in loader:
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss  # this rank's samples: the mean over its tokens
            loss.backward()
            optimizer.step()
            loss = loss.detach()
            if dist.is_initialized():  # equal shares: the global mean is the ranks' mean
                dist.all_reduce(loss)
                loss /= dist.get_world_size()
            losses.append(loss.item())
    finally:
        engine.detach()
    return losses, float(engine.get_epsilon(DELTA)) if sigma else math.inf


def worker(out: str) -> None:
    """One rank under ``torchrun``: the sharded model, without noise then with, on its
    half of each global batch; rank 0 saves the curves to ``out``."""
    dist.init_process_group("gloo")  # env://: torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dataset = counting_sequences()
    runs = {}
    for sigma in (0.0, SIGMA):
        model = tiny_gpt2()
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)  # the root: embeddings (tied to lm_head) and the final layer norm
        # rank r's batch k: the samples of global batch k at positions r, r + 2, ...
        loader = DataLoader(dataset, batch_size=BATCH // WORLD, sampler=DistributedSampler(dataset, shuffle=False))
        runs[sigma] = train(model, loader, sigma)
    if dist.get_rank() == 0:
        torch.save(runs, out)
    dist.barrier()  # every rank's collectives are done


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    worker(sys.argv[2])
    # leave at once, the group left as it is: destroying it (or the interpreter's
    # teardown) joins gloo's threads while holding the GIL, and one of them may be freeing
    # a finished collective that holds a Python object, waiting for the GIL (a hang, now
    # and then)
    sys.stdout.flush()
    os._exit(0)

# %%
# Two ranks, started as ``torchrun`` starts them: this file, run with ``--worker``.

with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "curves.pt")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")  # the host's name may resolve to an unreachable address
    done = subprocess.run([*launch, str(HERE), "--worker", out], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"torchrun failed:\n{done.stdout}\n{done.stderr}")
    sharded = torch.load(out)

# %%
# One process on the same global batches, without noise, against the two ranks.

warnings.filterwarnings("ignore", message="Secure RNG turned off")
single, _ = train(tiny_gpt2(), DataLoader(counting_sequences(), batch_size=BATCH), 0.0)
(two, _), (noisy, epsilon) = sharded[0.0], sharded[SIGMA]
gap = max(abs(a - b) for a, b in zip(two, single))
print(f"noise 0: FSDP2 on 2 ranks against one process, largest loss difference over {STEPS} steps: {gap:.2e}")
print(f"σ = {SIGMA}: final loss {noisy[-1]:.3f}, ε = {epsilon:.2f} at δ = {DELTA:g}")
torch.testing.assert_close(torch.tensor(two), torch.tensor(single), rtol=1e-4, atol=1e-5)

# %%
# The loss curves.

from matplotlib import pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
steps = range(1, STEPS + 1)
ax.plot(steps, single, "k-", lw=4, alpha=0.3, label="one process, noise 0")
ax.plot(steps, two, "C0o--", label="FSDP2, 2 ranks, noise 0")
ax.plot(steps, noisy, "C1.-", label=f"FSDP2, 2 ranks, σ = {SIGMA} (ε = {epsilon:.1f})")
ax.set(xlabel="step", ylabel="next-token loss (global batch)", title="Private GPT-2 fine-tuning under FSDP2")
ax.legend(fontsize=8)
