"""Language models and a vision transformer at their real size: jacmem beside a plain step,
Opacus 1.6 and ``torch.func`` (issue 25).

``python -m benchmarks.lm`` (``make bench`` runs it after the DP benchmark) runs, per
(model, method), two processes, as :mod:`benchmarks.dp` does: one that times a step of the
method and a plain SGD step of an untouched copy of the model alternately, and takes the
median of the per-step ratios with their spread (min–max); and one for the peak resident
set (``VmHWM``, the whole process: model, batch and step) with glibc returning every freed
buffer at once, set against that of a process running the plain step alone. Every step is
forward, backward, the SGD update and ``zero_grad``, on the same batch every step.

The models (random weights, nothing downloaded; dropout off, so that every method computes
the same function; position ids passed expanded to ``[N, T]``, which Opacus needs):

- ``gpt2``: HF ``GPT2LMHeadModel``, vocabulary 50257 tied to the head, d=768, 12 heads,
  2 layers, next-token loss, ``[8, T=128]`` token ids;
- ``bert``: HF ``BertForMaskedLM``, BERT-base-shaped (vocabulary 30522 tied to the MLM
  decoder, d=768, 12 heads, 2 layers), the token loss at every position, ``[8, T=128]``;
- ``llama-lora``: HF ``LlamaForCausalLM`` (vocabulary 32000, d=512, 8 heads, 2 layers,
  untied head) under PEFT LoRA (r=8 on ``q_proj``/``v_proj``; the base frozen), ``[8, T=128]``;
- ``vit-s``: timm ``vit_small_patch16_224``, 1000 classes, ``[8, 3, 224, 224]``.

The methods: ``plain``; jacmem's ``ClipGrad`` (flat, C = 1), ``BatchL2Grad`` and
``Variance`` inside ``jacmem.extend``; a whole private step (clip, noise σ = 1, update; no
Poisson sampling) with jacmem's :class:`jacmem.privacy.PrivacyEngine`, Opacus's with its
hooks, and Opacus's ghost clipping; ``torch.func`` (``vmap(grad)``: per-sample gradients,
their norms and the clipped sum), skipped where its per-sample gradients would need more
than ``--func-gib``. A peer that refuses a model is a row "fails: <reason>".

The table goes to BENCHMARKS.md between ``<!-- lm:start -->`` and ``<!-- lm:end -->``;
``--quick``: tiny configurations of the same models, one pair, written to
``out/lm-quick.md`` (it checks the harness).
"""

from __future__ import annotations

import copy
import sys
import time
import warnings

import torch
from torch import Tensor, nn

from benchmarks import dp, harness

ROOT = harness.ROOT
START, END = "<!-- lm:start -->", "<!-- lm:end -->"
MODELS = ("gpt2", "bert", "llama-lora", "vit-s")
METHODS = (
    "jacmem:ClipGrad",
    "jacmem:BatchL2Grad",
    "jacmem:Variance",
    "jacmem:PrivacyEngine",
    "opacus:hooks",
    "opacus:ghost",
    "torch.func",
)
LABELS = {
    "jacmem:ClipGrad": "jacmem `ClipGrad` in the block",
    "jacmem:BatchL2Grad": "jacmem `BatchL2Grad`",
    "jacmem:Variance": "jacmem `Variance`",
    "jacmem:PrivacyEngine": "private step, jacmem `PrivacyEngine`",
    "opacus:hooks": "private step, Opacus 1.6 hooks",
    "opacus:ghost": "private step, Opacus 1.6 ghost clipping",
    "torch.func": "`torch.func` vmap(grad), clipped sum",
}
#: the issue's targets at real size, over the plain step, in time and in peak memory;
#: the private step's only on the LoRA model
TARGETS = {"jacmem:ClipGrad": 1.2, "jacmem:BatchL2Grad": 1.15, "jacmem:Variance": 1.15}
LORA_TARGET = 1.1
LR, C = 0.1, 1.0


class TokenModel(nn.Module):
    """An HF model taking token ids [N, T] to its logits [N, T, V], with position ids
    (and, where the model has them, token type ids) passed expanded to [N, T]."""

    def __init__(self, hf: nn.Module, token_types: bool = False):
        super().__init__()
        self.hf, self.token_types = hf, token_types

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        extra = dict(token_type_ids=torch.zeros_like(ids)) if self.token_types else {}
        return self.hf(input_ids=ids, position_ids=positions, **extra).logits


class TokenLoss(nn.Module):
    """Cross-entropy of logits [N, T, V] (or [N, V]) against targets [N, T] (or [N]),
    over the positions flattened as HF's own LM losses take them: the mean over
    positions per sample, [N], then ``reduction`` over the batch (the mean over all
    tokens, as ``nn.CrossEntropyLoss``). Opacus's ghost clipping sets
    ``reduction = "none"`` and needs one loss per sample."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        flat = nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
        per_sample = flat.reshape(len(targets), -1).mean(1)
        return per_sample if self.reduction == "none" else getattr(per_sample, self.reduction)()


def gpt2(quick: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64) if quick else dict(n_layer=2, n_embd=768, n_head=12)
    config = GPT2Config(
        **size, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"
    )
    return TokenModel(GPT2LMHeadModel(config))


def bert(quick: bool) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    size = (
        dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=64)
        if quick
        else dict(num_hidden_layers=2)
    )
    config = BertConfig(**size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return TokenModel(BertForMaskedLM(config), token_types=True)


def llama_lora(quick: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(
        hidden_size=16 if quick else 512,
        intermediate_size=32 if quick else 1376,
        num_attention_heads=2 if quick else 8,
        num_key_value_heads=2 if quick else 8,
        vocab_size=64 if quick else 32000,
    )
    config = LlamaConfig(**size, num_hidden_layers=1 if quick else 2, max_position_embeddings=128)
    base = LlamaForCausalLM(config)
    return TokenModel(get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])))


def vit_s(quick: bool) -> nn.Module:
    import timm

    if quick:
        return timm.create_model(
            "vit_small_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2, num_classes=10
        )
    return timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=1000)


#: name -> (model builder, quick -> (X, y)), the same in every process (seeded)
BUILD = {
    "gpt2": (gpt2, lambda quick: _tokens(2 if quick else 8, 16 if quick else 128, 64 if quick else 50257)),
    "bert": (bert, lambda quick: _tokens(2 if quick else 8, 16 if quick else 128, 64 if quick else 30522)),
    "llama-lora": (llama_lora, lambda quick: _tokens(2 if quick else 8, 16 if quick else 128, 64 if quick else 32000)),
    "vit-s": (
        vit_s,
        lambda quick: (
            (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
            if quick
            else (torch.randn(8, 3, 224, 224), torch.randint(0, 1000, (8,)))
        ),
    ),
}


def _tokens(n: int, t: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Random token ids [n, t] and next-token targets [n, t]."""
    ids = torch.randint(0, vocab, (n, t + 1))
    return ids[:, :-1], ids[:, 1:]


def build(name: str, quick: bool) -> tuple[nn.Module, Tensor, Tensor]:
    """(model in training mode, X, y); dropout is off in every configuration."""
    torch.manual_seed(0)
    make, data = BUILD[name]
    model = make(quick).train()
    return model, *data(quick)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def func_bytes(model: nn.Module, batch: int) -> int:
    """A guess of ``torch.func``'s extra memory: three times the per-sample gradients'
    float32 bytes (as :func:`benchmarks.methods.expected_extra` guesses)."""
    return 3 * 4 * batch * sum(p.numel() for p in trainable(model))


def _extension_step(model, X, y, ext):
    import jacmem

    lossfunc = TokenLoss()
    opt = torch.optim.SGD(trainable(model), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        with jacmem.extend(ext):
            lossfunc(model(X), y).backward()
        opt.step()
        for p in trainable(model):  # what the extension stored goes, as a user would drop it
            p.batch_l2 = p.variance = None

    return step


def _func_step(model, X, y):
    """Per-sample gradients by ``vmap(grad)``, their flat norms, and the clipped sum
    (C = 1, the batch mean as jacmem's and Opacus's ``loss_reduction="mean"``) as ``grad``."""
    from torch.func import functional_call, grad, vmap

    lossfunc = TokenLoss()
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    frozen = {k: p.detach() for k, p in params.items() if k not in names}
    opt = torch.optim.SGD(trainable(model), lr=LR)

    def loss_one(own: dict[str, Tensor], x: Tensor, t: Tensor) -> Tensor:
        out = functional_call(model, ({**own, **frozen}, dict(model.named_buffers())), (x.unsqueeze(0),))
        return lossfunc(out, t.unsqueeze(0))

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def step():
        grads = per_sample({k: params[k].detach() for k in names}, X, y)  # name -> [N, *p.shape]
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)  # [N]
        scale = (C / (norms + 1e-6)).clamp(max=1.0) / X.shape[0]
        for k in names:
            params[k].grad = torch.einsum("n,n...->...", scale, grads[k])
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def prepare(method: str, model: nn.Module, X: Tensor, y: Tensor):
    """A ``step()``: one SGD step of ``model`` on ``(X, y)`` with ``method`` (or ``"plain"``)."""
    import jacmem

    if method in ("plain", "opacus:hooks", "opacus:ghost"):
        return dp.prepare(method, model, X, y, TokenLoss())
    if method == "jacmem:PrivacyEngine":
        return dp.prepare("jacmem", model, X, y, TokenLoss())
    if method == "jacmem:ClipGrad":
        return _extension_step(model, X, y, jacmem.ClipGrad(C))
    if method in ("jacmem:BatchL2Grad", "jacmem:Variance"):
        return _extension_step(model, X, y, getattr(jacmem, method.split(":")[1])())
    if method == "torch.func":
        return _func_step(model, X, y)
    raise ValueError(f"unknown method {method!r}")


def child(case: dict) -> dict:
    """One case: ``paired`` times the method against a plain SGD step of a copy;
    otherwise the whole process's peak resident set over a warm-up step and one step."""
    torch.set_num_threads(case["threads"])
    warnings.simplefilter("ignore")
    model, X, y = build(case["model"], case["quick"])
    if case["method"] == "torch.func" and func_bytes(model, X.shape[0]) > case["func_gib"] * 2**30:
        return dict(case, error=f"skipped: needs {func_bytes(model, X.shape[0]) / 2**30:.1f} GiB")
    plain = prepare("plain", copy.deepcopy(model), X, y) if case["paired"] else None
    step = prepare(case["method"], model, X, y)
    return harness.timed_case(case, step, plain)


def run_case(case: dict, timeout: float) -> dict:
    """One case in its own process, with :mod:`benchmarks.harness`'s glibc settings for
    timing (paired) or for memory."""
    env = harness.TIME_MALLOC if case["paired"] else harness.MEMORY_MALLOC
    return harness.run_case(case, timeout, child=("-m", "benchmarks.lm", "--child"), env=env)


def _failure(r: dict) -> str:
    return harness.failure(r, declined=("skipped",))


def _target(model: str, method: str) -> float | None:
    if model == "llama-lora" and method == "jacmem:PrivacyEngine":
        return LORA_TARGET
    return None if model == "vit-s" else TARGETS.get(method)


def table(results: list[dict], args) -> list[str]:
    lines = [
        START,
        "## Language models at their real size (issue 25)",
        "",
        f"`python -m benchmarks.lm{' --quick' if args.quick else ''}` ({args.started}; {args.machine}; load "
        f"average {args.load_before} before, {' '.join(harness.load())} after; {args.threads} threads). Models "
        "(random weights, dropout off, position ids passed as [N, T]): HF GPT-2 (vocabulary 50257 tied to the "
        "head, d=768, 12 heads, 2 layers, next-token loss, N=8, T=128); HF BertForMaskedLM, BERT-base-shaped "
        "(vocabulary 30522 tied to the decoder, d=768, 2 layers, token loss at every position, N=8, T=128); HF "
        "Llama (vocabulary 32000, d=512, 8 heads, 2 layers) under PEFT LoRA (r=8 on q_proj, v_proj; the base "
        "frozen), N=8, T=128; timm ViT-S (vit_small_patch16_224, 1000 classes), N=8. Each step: forward, "
        "backward, the SGD update; private steps: flat clipping, C = 1, σ = 1, no Poisson sampling. **Time**: "
        f"the method's step and a plain SGD step of an untouched copy alternated in one process ({args.repeats} "
        "pairs after one warm-up), the median of the per-step ratios and their spread (min–max). **Memory**: the "
        "whole process's peak RSS (VmHWM: model, batch and steps) over a warm-up step and one step, glibc "
        "returning freed buffers at once, each method and the plain step in processes of their own; × plain is "
        "total peak over the plain process's total peak (one process each: the figure moves by a few MiB). "
        f"`torch.func` is skipped where 3× its per-sample gradients exceed {args.func_gib:g} GiB. **Targets** "
        f"(issue 25, time and peak): `ClipGrad` ≤ {TARGETS['jacmem:ClipGrad']}×; `BatchL2Grad`, `Variance` ≤ "
        f"{TARGETS['jacmem:Variance']}× (on the three language models); the private LoRA step ≤ {LORA_TARGET}× "
        "a plain LoRA step." + (" " + args.note if args.note else ""),
        "",
        "| model | method | step (ms) | × plain time: median (min–max) | peak (MiB) | × plain peak | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def target_and_met(model: str, method: str, ratio: float, peak: float | None) -> list[str]:
        target = _target(model, method)
        met = "" if target is None else "yes" if ratio <= target and (peak or 1e9) <= target else "no"
        return ["" if target is None else f"≤ {target}", met]

    lines += harness.timed_rows(
        results, args.models, args.methods, LABELS, "plain SGD step", (2, target_and_met), _failure
    )
    return [*lines, "", END]


def cases(args) -> list[dict]:
    out = []
    for model in args.models:
        out.append(dict(model=model, method="plain", paired=False))
        for method in args.methods:
            out += [dict(model=model, method=method, paired=True), dict(model=model, method=method, paired=False)]
    for case in out:
        case.update(quick=args.quick, threads=args.threads, func_gib=args.func_gib)
        case["repeats"] = args.repeats if case["paired"] else 1
    return out


def main(argv=None) -> None:
    p = harness.parser(
        "lm", __doc__, timeout=900.0,
        models=dict(nargs="+", default=list(MODELS), choices=list(MODELS)),
        methods=dict(nargs="+", default=list(METHODS), choices=list(METHODS)),
        threads=dict(type=int, default=2),
        func_gib=dict(type=float, default=6.0, help="torch.func's memory budget (GiB)"),
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        harness.answer(args.child, child)
        return
    args.repeats = args.repeats or (1 if args.quick else 5)
    markdown = args.markdown or (ROOT / "out" / "lm-quick.md" if args.quick else ROOT / "BENCHMARKS.md")
    info = harness.machine()
    args.machine = f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}"
    args.load_before = " ".join(harness.load())
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    todo = cases(args)
    results = []
    for i, case in enumerate(todo, 1):
        r = run_case(case, args.timeout)
        results.append(r)
        kind = "paired" if case["paired"] else "memory"
        shown = harness.progress(r, case["paired"], _failure)
        print(f"[{i}/{len(todo)}] {case['model']} {case['method']} {kind}: {shown}", file=sys.stderr, flush=True)
        # the block after every case: a run cut short leaves what it measured
        harness.write_block(markdown, "\n".join(table(results, args)), START, END)
    print("\n".join(table(results, args)))


if __name__ == "__main__":
    main()
