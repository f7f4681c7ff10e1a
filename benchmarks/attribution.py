"""Training-data attribution (issue 38): how well scores predict retraining, and what projected
gradients cost at language-model size.

``python -m benchmarks.attribution`` (``make bench`` runs it) has two parts, each case in a
process of its own (:mod:`benchmarks.harness`), jacmem and its peers apart:

**LDS**, the linear datamodeling score (Park et al. 2023, as kronfluence's and TRAK's papers
use it). A classification task generated here (Gaussian class centres, 10% of the training
labels flipped, so that single examples matter), an MLP with biases (tanh), float64, trained
to convergence by full-batch L-BFGS on the mean cross-entropy plus a weight decay. Ground
truth: the same model retrained from the same initialisation on ``M`` random halves of the
training set, and each query's loss under each. A method's scores ``τ[q, i]`` (query ``q``,
training example ``i``; positive: ``i`` lowers ``q``'s loss) predict, for a half ``S``, a
loss that falls with ``Σ_{i∈S} τ[q, i]``; the LDS is the Spearman correlation over the
halves of ``-Σ_{i∈S} τ[q, i]`` with the retrained loss, averaged over the queries. The
methods: jacmem's :class:`jacmem.attribution.Influence` (EK-FAC, conventions jacmem and
kronfluence; K-FAC; diagonal; identity, i.e. TracIn/grad-dot; the Kronecker projection of
size 256 with EK-FAC and with identity), and kronfluence 1.0.1's own EK-FAC on the same
model and data (empirical Fisher, float64). Each method with a damping runs over a grid of
dampings and over its default (``None``); the table gives each at its best damping and at
its default.

**Speed**, projected gradients (:class:`jacmem.BatchGradProjection`, Kronecker, 256 per
parameter) of the whole HF GPT-2 config (12 layers, d = 768, the 50257-token vocabulary
tied to the head; random weights) and of a LLaMA-style model under PEFT LoRA (as
:mod:`benchmarks.lm` builds it), against a plain forward and backward of the same model:
time (the two alternated in one process, the median of the per-step ratios) and peak
resident set (each in its own process, as :mod:`benchmarks.lm` measures it). kronfluence
runs on the ``nn.Linear`` parts it tracks: its covariance pass (the pass of its fit that
reads every training example) over the LoRA adapters; on GPT-2 its only ``nn.Linear`` is
the tied head, whose gradient covariance alone is ``50257²`` floats (not run).

Each part writes a line to BENCHMARKS.md and its table to benchmarks/details/attribution.md,
between ``<!-- attribution-<part>:start -->`` and ``<!-- attribution-<part>:end -->`` (a run
of one part leaves the other's). ``--quick``: a tiny task and tiny models, both written
under ``out/`` (it checks the harness).
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks import harness, lm

ROOT = harness.ROOT
#: each part's block, in BENCHMARKS.md (a line or two) and in the details file (its table):
#: a run of one part leaves the other's as it was
MARKS = {part: (f"<!-- attribution-{part}:start -->", f"<!-- attribution-{part}:end -->") for part in ("lds", "speed")}
HEADER = (
    "# Training-data attribution\n\nWritten by `python -m benchmarks.attribution` (`make bench`), one block per "
    "part (`--parts lds speed`); do not edit by hand."
)

#: LDS methods: name -> keywords of ``Influence`` (jacmem) or of kronfluence's run
LDS_METHODS = {
    "jacmem:ekfac": dict(curvature="ekfac"),
    "jacmem:ekfac:kronfluence": dict(curvature="ekfac", conventions="kronfluence"),
    "jacmem:ekfac:proj256": dict(curvature="ekfac", projection=256),
    "jacmem:kfac": dict(curvature="kfac"),
    "jacmem:diag": dict(curvature="diag"),
    "jacmem:identity": dict(curvature="identity"),
    "jacmem:identity:proj256": dict(curvature="identity", projection=256),
    "kronfluence:ekfac": dict(curvature="ekfac"),
}
LDS_LABELS = {
    "jacmem:ekfac": "jacmem EK-FAC",
    "jacmem:ekfac:kronfluence": 'jacmem EK-FAC, `conventions="kronfluence"`',
    "jacmem:ekfac:proj256": "jacmem EK-FAC, Kronecker-projected to 256",
    "jacmem:kfac": "jacmem K-FAC",
    "jacmem:diag": "jacmem diagonal",
    "jacmem:identity": "jacmem identity (grad-dot)",
    "jacmem:identity:proj256": "jacmem identity, Kronecker-projected to 256",
    "kronfluence:ekfac": "kronfluence 1.0.1 EK-FAC",
}
#: the dampings tried (besides each method's default, ``None``)
DAMPINGS = [10.0 ** (k / 2) for k in range(-16, 5)]
QUICK_DAMPINGS = [1e-3, 1e-1]
#: the task: full and quick sizes
TASK = dict(features=32, hidden=64, classes=5, train=256, query=32, subsets=64, weight_decay=1e-2)
QUICK_TASK = dict(features=4, hidden=8, classes=3, train=24, query=3, subsets=4, weight_decay=1e-2)

SPEED_MODELS = ("gpt2", "llama-lora")
SPEED_METHODS = ("jacmem:proj256", "kronfluence:covariance")
SPEED_LABELS = {
    "jacmem:proj256": "jacmem `BatchGradProjection(256)`, Kronecker",
    "kronfluence:covariance": "kronfluence 1.0.1 covariance pass (`nn.Linear` parts)",
}
#: the issue's targets over a plain forward and backward: time, peak
TARGET_TIME, TARGET_PEAK = 1.3, 1.2


# ---------------------------------------------------------------------------------------------
# the LDS task


def mlp(task: dict) -> nn.Module:
    """features -> hidden -> hidden -> classes, tanh, biases, float64."""
    f, h, c = task["features"], task["hidden"], task["classes"]
    return nn.Sequential(nn.Linear(f, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, c)).double()


def make_data(task: dict, seed: int = 0) -> dict[str, Tensor]:
    """X_train [n, f], y_train [n], X_query [q, f], y_query [q]: class centres drawn at
    distance about 2, unit noise; 10% of the training labels flipped at random."""
    gen = torch.Generator().manual_seed(seed)
    f, c = task["features"], task["classes"]
    centres = 2.0 * torch.randn(c, f, generator=gen, dtype=torch.float64) / math.sqrt(f) * 2

    def draw(n: int) -> tuple[Tensor, Tensor]:
        y = torch.randint(0, c, (n,), generator=gen)
        return centres[y] + torch.randn(n, f, generator=gen, dtype=torch.float64), y

    X, y = draw(task["train"])
    flip = torch.rand(task["train"], generator=gen) < 0.1
    y = torch.where(flip, torch.randint(0, c, (task["train"],), generator=gen), y)
    Xq, yq = draw(task["query"])
    return dict(X_train=X, y_train=y, X_query=Xq, y_query=yq)


def train(model: nn.Module, X: Tensor, y: Tensor, weight_decay: float) -> nn.Module:
    """Full-batch L-BFGS on mean cross-entropy + weight_decay/2 ‖θ‖², 300 iterations (the
    gradient's norm falls below 1e-4 on the task here)."""
    opt = torch.optim.LBFGS(
        model.parameters(), lr=1.0, max_iter=300, history_size=20, line_search_fn="strong_wolfe",
        tolerance_grad=1e-9, tolerance_change=1e-12,
    )  # fmt: skip

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y)
        loss = loss + weight_decay / 2 * sum(p.square().sum() for p in model.parameters())
        loss.backward()
        return loss

    opt.step(closure)
    return model


def query_losses(model: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """[q] cross-entropy of each query."""
    with torch.no_grad():
        return nn.functional.cross_entropy(model(X), y, reduction="none")


def ground_truth(task: dict, path: Path) -> dict:
    """Trains the model on all the training data and on ``subsets`` random halves (the same
    initialisation), and saves to ``path``: the data, the full model's state, the halves
    ``masks [M, n]`` and the retrained query losses ``losses [M, q]``."""
    data = make_data(task)
    torch.manual_seed(1)
    init = mlp(task).state_dict()
    full = mlp(task)
    full.load_state_dict(init)
    train(full, data["X_train"], data["y_train"], task["weight_decay"])
    gen = torch.Generator().manual_seed(2)
    n = task["train"]
    masks = torch.zeros(task["subsets"], n, dtype=torch.bool)
    losses = []
    for m in range(task["subsets"]):
        masks[m, torch.randperm(n, generator=gen)[: n // 2]] = True
        model = mlp(task)
        model.load_state_dict(init)
        train(model, data["X_train"][masks[m]], data["y_train"][masks[m]], task["weight_decay"])
        losses.append(query_losses(model, data["X_query"], data["y_query"]))
    accuracy = (full(data["X_query"]).argmax(1) == data["y_query"]).double().mean().item()
    torch.save(dict(data, task=task, state=full.state_dict(), masks=masks, losses=torch.stack(losses)), path)
    return dict(query_accuracy=accuracy)


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman correlation of each column of a [M, q] with that of b [M, q]: [q]."""

    def ranks(x: Tensor) -> Tensor:
        r = x.argsort(0).argsort(0).double()
        return r - r.mean(0)

    ra, rb = ranks(a), ranks(b)
    return (ra * rb).sum(0) / (ra.norm(dim=0) * rb.norm(dim=0))


def lds(scores: Tensor, masks: Tensor, losses: Tensor) -> float:
    """The LDS of scores [q, n] (positive: lowers the query's loss) against the halves
    masks [M, n] and retrained losses [M, q]: the mean over queries of the Spearman
    correlation of ``-Σ_{i∈S} τ[q, i]`` with the loss."""
    predicted = -(masks.double() @ scores.double().T)  # [M, q]
    return spearman(predicted, losses).mean().item()


def _loss_sum(model, batch) -> Tensor:
    """The summed cross-entropy of a batch (X, y): ``loss_fn`` of ``Influence``."""
    X, y = batch
    return nn.functional.cross_entropy(model(X), y, reduction="sum")


def _batches(X: Tensor, y: Tensor, size: int = 64) -> list[tuple[Tensor, Tensor]]:
    return [(X[i : i + size], y[i : i + size]) for i in range(0, len(X), size)]


def jacmem_scorer(saved: dict, keywords: dict):
    """damping -> [q, n] scores of jacmem's ``Influence`` with ``keywords`` (fitted afresh
    for each damping: ``Influence`` takes its damping at construction)."""
    from jacmem.attribution import Influence

    model = mlp(saved["task"])
    model.load_state_dict(saved["state"])
    train_loader = _batches(saved["X_train"], saved["y_train"])
    query_loader = _batches(saved["X_query"], saved["y_query"])

    def scores(damping: float | None) -> Tensor:
        influence = Influence(model, _loss_sum, damping=damping, progress=False, **keywords)
        influence.fit(train_loader)
        return influence.scores(query_loader, train_loader)

    return scores


def kronfluence_scorer(saved: dict, workdir: Path):
    """damping -> [q, n] scores of kronfluence's EK-FAC (empirical Fisher, float64) on the same
    model and data: the factors fitted once, here."""
    from kronfluence import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch.utils.data import TensorDataset

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            X, y = batch
            logits = model(X)
            if sample:
                with torch.no_grad():
                    y = torch.multinomial(logits.softmax(-1), 1).flatten()
            return nn.functional.cross_entropy(logits, y, reduction="sum")

        def compute_measurement(self, batch, model):
            return _loss_sum(model, batch)

    model = mlp(saved["task"])
    model.load_state_dict(saved["state"])
    task = Classification()
    model = prepare_model(model.eval(), task)
    analyzer = Analyzer("lds", model, task, cpu=True, disable_tqdm=True, output_dir=str(workdir / "kronfluence"))
    train_set = TensorDataset(saved["X_train"], saved["y_train"])
    query_set = TensorDataset(saved["X_query"], saved["y_query"])
    factor_args = FactorArguments(
        strategy="ekfac", use_empirical_fisher=True, activation_covariance_dtype=torch.float64,
        gradient_covariance_dtype=torch.float64, eigendecomposition_dtype=torch.float64,
        per_sample_gradient_dtype=torch.float64, lambda_dtype=torch.float64,
    )  # fmt: skip
    analyzer.fit_all_factors("ekfac", train_set, per_device_batch_size=64, factor_args=factor_args)

    def scores(damping: float | None) -> Tensor:
        score_args = ScoreArguments(
            damping_factor=damping, per_sample_gradient_dtype=torch.float64, precondition_dtype=torch.float64,
            score_dtype=torch.float64,
        )  # fmt: skip
        analyzer.compute_pairwise_scores(
            "lds", "ekfac", query_set, train_set, per_device_query_batch_size=16, per_device_train_batch_size=64,
            score_args=score_args, overwrite_output_dir=True,
        )  # fmt: skip
        return analyzer.load_pairwise_scores("lds")["all_modules"]

    return scores


def lds_child(case: dict) -> dict:
    """One LDS method: its default damping, the grid, then the midpoints (on the log scale)
    on each side of the grid's best; damping -> LDS."""
    torch.set_num_threads(case["threads"])
    warnings.simplefilter("ignore")
    saved = torch.load(case["task_file"])
    method = case["method"]
    keywords = dict(LDS_METHODS[method])
    if method.startswith("kronfluence"):
        scorer = kronfluence_scorer(saved, Path(case["task_file"]).parent)
    else:
        scorer = jacmem_scorer(saved, keywords)
    values, seconds = {}, []

    def measure(damping: float | None) -> None:
        start = time.perf_counter()
        scores = scorer(damping)
        seconds.append(time.perf_counter() - start)
        values[damping] = lds(scores, saved["masks"], saved["losses"])

    if keywords["curvature"] == "identity":
        measure(None)
        measure(None)  # the first call's time includes one-time warm-up
    else:
        grid = case["dampings"]
        for damping in [None, *grid]:
            measure(damping)
        best_grid = max(grid, key=lambda d: values[d] if values[d] == values[d] else -2.0)
        step = (grid[1] / grid[0]) ** 0.5
        for damping in (best_grid / step, best_grid * step):
            measure(damping)
    return dict(case, lds=list(values.items()), seconds_per_damping=statistics.median(seconds))


# ---------------------------------------------------------------------------------------------
# projected gradients at LM size


def gpt2_whole(quick: bool) -> nn.Module:
    """HF GPT-2 at its default config (12 layers, d = 768, 12 heads, the 50257-token vocabulary
    tied to the head), random weights, dropout off; quick: 1 layer, d = 16, vocabulary 64."""
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64) if quick else {}
    config = GPT2Config(**size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return lm.TokenModel(GPT2LMHeadModel(config))


#: model -> (builder, (N, T, vocabulary) full, quick)
SPEED_BUILD = {
    "gpt2": (gpt2_whole, (4, 64, 50257), (2, 8, 64)),
    "llama-lora": (lm.llama_lora, (8, 128, 32000), (2, 8, 64)),
}


def speed_build(name: str, quick: bool) -> tuple[nn.Module, Tensor, Tensor]:
    """(model in training mode, ids [N, T], next-token targets [N, T]), seeded."""
    torch.manual_seed(0)
    make, full, small = SPEED_BUILD[name]
    n, t, vocab = small if quick else full
    model = make(quick).train()
    ids = torch.randint(0, vocab, (n, t + 1))
    return model, ids[:, :-1], ids[:, 1:]


def _plain_step(model, X, y):
    """Forward and backward, ``.grad`` dropped: what a gradient pass costs without jacmem."""
    lossfunc = lm.TokenLoss()

    def step():
        model.zero_grad(set_to_none=True)
        lossfunc(model(X), y).backward()

    return step


def _projection_step(model, X, y, dim: int):
    import jacmem

    lossfunc = lm.TokenLoss()
    trainable = lm.trainable(model)

    def step():
        model.zero_grad(set_to_none=True)
        with jacmem.extend(jacmem.BatchGradProjection(dim, kind="kronecker")):
            lossfunc(model(X), y).backward()
        for p in trainable:  # the user takes the projections away (to the store)
            p.grad_proj = None

    return step


def _kronfluence_step(model, X, y):
    """kronfluence's covariance pass over the ``nn.Linear`` modules it can track (the LoRA
    adapters of a PEFT model; on GPT-2 the tied head alone, refused before any work)."""
    from kronfluence import prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.module.tracked_module import ModuleMode
    from kronfluence.module.utils import set_mode, update_factor_args
    from kronfluence.task import Task

    lossfunc = lm.TokenLoss()
    lossfunc.reduction = "sum"
    names = [
        k for k, m in model.named_modules() if isinstance(m, nn.Linear) and any(p.requires_grad for p in m.parameters())
    ]
    too_big = [k for k in names if model.get_submodule(k).out_features ** 2 * 4 > 2**30]
    if too_big:
        raise RuntimeError(f"not run: the gradient covariance of {too_big[0]} alone needs over 1 GiB")

    class LM(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return lossfunc(model(batch[0]), batch[1])

        def compute_measurement(self, batch, model):
            return lossfunc(model(batch[0]), batch[1])

        def get_influence_tracked_modules(self):
            return names

    model = prepare_model(model, LM())
    update_factor_args(model, FactorArguments(strategy="ekfac", use_empirical_fisher=True))
    set_mode(model, ModuleMode.COVARIANCE)

    def step():
        model.zero_grad(set_to_none=True)
        lossfunc(model(X), y).backward()

    return step


def speed_prepare(method: str, model: nn.Module, X: Tensor, y: Tensor, dim: int):
    if method == "plain":
        return _plain_step(model, X, y)
    if method == "jacmem:proj256":
        return _projection_step(model, X, y, dim)
    if method == "kronfluence:covariance":
        return _kronfluence_step(model, X, y)
    raise ValueError(f"unknown method {method!r}")


def speed_child(case: dict) -> dict:
    """``paired``: the method and a plain step of a copy alternated; otherwise the whole
    process's peak resident set over a warm-up step and one step."""
    torch.set_num_threads(case["threads"])
    warnings.simplefilter("ignore")
    model, X, y = speed_build(case["model"], case["quick"])
    plain = _plain_step(copy.deepcopy(model), X, y) if case["paired"] else None
    step = speed_prepare(case["method"], model, X, y, case["dim"])
    return harness.timed_case(case, step, plain)


# ---------------------------------------------------------------------------------------------
# the driver


def child(case: dict) -> dict:
    if case["part"] == "truth":
        torch.set_num_threads(case["threads"])
        return dict(case, **ground_truth(case["task"], Path(case["task_file"])))
    return lds_child(case) if case["part"] == "lds" else speed_child(case)


def run_case(case: dict, timeout: float) -> dict:
    env = harness.MEMORY_MALLOC if case.get("paired") is False else harness.TIME_MALLOC
    return harness.run_case(case, timeout, child=("-m", "benchmarks.attribution", "--child"), env=env)


def _failure(r: dict) -> str:
    """A failed case's cell: "not run: <why>" where the case declined, else "fails: <reason>"."""
    return harness.failure(r, declined=("not run",))


def best(r: dict) -> tuple[float | None, float, float]:
    """(best damping, its LDS, the LDS at the default damping) of an LDS result."""
    values = [(d, v) for d, v in r["lds"] if v == v]  # NaN (constant scores) never best
    damping, value = max(values, key=lambda dv: dv[1]) if values else (None, float("nan"))
    return damping, value, dict(r["lds"]).get(None, float("nan"))


def lds_table(results: list[dict], truth: dict, args) -> list[str]:
    by = {r["method"]: r for r in results}
    task = args.task
    unprojected = by.get("jacmem:ekfac")
    base = best(unprojected)[1] if unprojected and "error" not in unprojected else None
    lines = [
        f"**LDS** (`python -m benchmarks.attribution{' --quick' if args.quick else ''}`, {args.started}; "
        f"{args.machine}; {args.threads} threads). MLP {task['features']}-{task['hidden']}-{task['hidden']}-"
        f"{task['classes']} (tanh, biases, float64), {task['train']} training examples (10% of labels flipped), "
        f"{task['query']} queries (accuracy {truth.get('query_accuracy', float('nan')):.2f}), trained by full-batch "
        f"L-BFGS with weight decay {task['weight_decay']:g}; ground truth: {task['subsets']} retrainings on random "
        f"halves from the same initialisation. Dampings tried: the default, 10^k for k = "
        f"{math.log10(args.dampings[0]):g} … {math.log10(args.dampings[-1]):g} in steps of "
        f"{math.log10(args.dampings[1] / args.dampings[0]):g}, then the midpoints on each side of the best. "
        "× EK-FAC: LDS at best damping over jacmem EK-FAC's." + (f" {args.note}" if args.note else ""),
        "",
        "| method | LDS, best damping | damping | LDS, default damping | × EK-FAC | s per fit and scores (median) |",
        "|---|---|---|---|---|---|",
    ]
    for method in args.lds_methods:
        r = by.get(method)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {LDS_LABELS[method]} | {_failure(r)} | | | | |")
            continue
        damping, value, default = best(r)
        ratio = f"{value / base:.2f}" if base else "n/a"
        shown = "default" if damping is None else f"{damping:.2g}"
        if LDS_METHODS[method]["curvature"] == "identity":
            shown, default_shown = "–", "–"
        else:
            default_shown = f"{default:.3f}"
        lines.append(
            f"| {LDS_LABELS[method]} | {value:.3f} | {shown} | {default_shown} | {ratio} | "
            f"{r['seconds_per_damping']:.2f} |"
        )
    return [*lines, ""]


def speed_table(results: list[dict], args) -> list[str]:
    lines = [
        f"**Projected gradients at LM size** (`python -m benchmarks.attribution{' --quick' if args.quick else ''}"
        f"`, {args.started}; {args.threads} threads). HF GPT-2 at its default config (12 layers, d=768, "
        "vocabulary 50257 tied to the head, random weights), N=4, T=64; HF Llama (vocabulary 32000, d=512, 2 "
        "layers) under PEFT LoRA (r=8 on q_proj, v_proj; base frozen), N=8, T=128. The plain step: forward and "
        "backward (no update). Time: the method and a plain step of a copy alternated in one process "
        f"({args.repeats} pairs after a warm-up), median of the per-step ratios (min–max). Peak: the whole "
        "process's peak RSS, each in its own process, over the plain step's. Targets (issue 38): "
        f"≤ {TARGET_TIME}× in time, ≤ {TARGET_PEAK}× in peak." + (f" {args.note}" if args.note else ""),
        "",
        "| model | method | step (ms) | × plain time (min–max) | peak (MiB) | × plain peak | met |",
        "|---|---|---|---|---|---|---|",
    ]

    def met(model: str, method: str, ratio: float, peak: float | None) -> list[str]:
        if not method.startswith("jacmem"):
            return [""]
        return ["yes" if ratio <= TARGET_TIME and (peak or 1e9) <= TARGET_PEAK else "no"]

    lines += harness.timed_rows(
        results, args.speed_models, args.speed_methods, SPEED_LABELS, "plain forward and backward", (1, met), _failure
    )
    return [*lines, ""]


def lds_summary(results: list[dict], args) -> list[str]:
    """The LDS part's lines of BENCHMARKS.md."""
    by = {r["method"]: best(r)[1] for r in results if "error" not in r}
    parts = [f"{LDS_LABELS[m]} {v:.3f}" for m, v in by.items()]
    return [
        f"**LDS** at each method's best damping (`python -m benchmarks.attribution --parts lds`, {args.started}; "
        f"MLP, {args.task['train']} training examples, {args.task['subsets']} retrainings on random halves"
        f"{'; ' + args.note.rstrip('.') if args.note else ''}): " + "; ".join(parts) + "."
    ]


def speed_summary(results: list[dict], args) -> list[str]:
    """The speed part's lines of BENCHMARKS.md: jacmem's projection over a plain step."""
    plain = {r["model"]: r for r in results if r["method"] == "plain" and "error" not in r}
    parts = []
    for model in args.speed_models:
        t = next(
            (r for r in results if (r["model"], r["method"], r["paired"]) == (model, "jacmem:proj256", True)), None
        )
        m = next(
            (r for r in results if (r["model"], r["method"], r["paired"]) == (model, "jacmem:proj256", False)), None
        )
        if t is None:
            continue
        if "error" in t:
            parts.append(f"{model} {_failure(t)}")
            continue
        peak = (
            f"{m['peak_bytes'] / plain[model]['peak_bytes']:.2f}×"
            if m and "error" not in m and model in plain
            else "n/a"
        )
        parts.append(f"{model} {statistics.median(t['ratios']):.2f}× in time, {peak} in peak")
    return [
        f"**Projected gradients** (`BatchGradProjection({args.dim})`, Kronecker) over a plain forward and backward "
        f"({args.started}; whole GPT-2 with its 50257-token tied vocabulary, LLaMA-style with LoRA"
        f"{'; ' + args.note.rstrip('.') if args.note else ''}; targets ≤ {TARGET_TIME}× and ≤ {TARGET_PEAK}×): "
        + "; ".join(parts)
        + "."
    ]


PEERS_NOTE = (
    "Peers not run: LogIX (`logix-ai` on PyPI) requires Python < 3.11 (its only releases, 0.1.0 and 0.1.1) and "
    "does not install beside this Python 3.11. traker 0.3.2 installs (torch, numpy, tqdm) but its fast projector "
    "is `fast_jl`, a CUDA extension built with nvcc against the local CUDA (`traker[fast]`); on a CPU it falls "
    "back to a dense projection of the flattened gradient, and its scores follow TRAK's own recipe (an ensemble "
    "of checkpoints, margins), not a single model's loss, so it is not put beside the LDS above."
)


def main(argv=None) -> None:
    p = harness.parser(
        "attribution", __doc__, timeout=1800.0,
        parts=dict(nargs="+", default=["lds", "speed"], choices=["lds", "speed"]),
        lds_methods=dict(nargs="+", default=list(LDS_METHODS), choices=list(LDS_METHODS)),
        speed_models=dict(nargs="+", default=list(SPEED_MODELS), choices=list(SPEED_MODELS)),
        speed_methods=dict(nargs="+", default=list(SPEED_METHODS), choices=list(SPEED_METHODS)),
        dim=dict(type=int, default=256, help="projection size per parameter (speed part)"),
        threads=dict(type=int, default=2),
        details=dict(type=Path, help="where the tables go (default benchmarks/details/attribution.md)"),
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        harness.answer(args.child, child)
        return
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.task = QUICK_TASK if args.quick else TASK
    args.dampings = QUICK_DAMPINGS if args.quick else DAMPINGS
    out = ROOT / "out"
    markdown = args.markdown or (out / "attribution-quick.md" if args.quick else ROOT / "BENCHMARKS.md")
    details = args.details or (
        out / "attribution-quick-details.md" if args.quick else ROOT / "benchmarks" / "details" / "attribution.md"
    )
    info = harness.machine()
    args.machine = f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}"
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    common = dict(quick=args.quick, threads=args.threads)
    lds_results, speed_results, truth = [], [], {}

    def report(part: str) -> None:
        """Write ``part``'s blocks (the file's header first, where the details file is new)."""
        if part == "lds":
            table, lines = lds_table(lds_results, truth, args), lds_summary(lds_results, args)
        else:
            table, lines = [*speed_table(speed_results, args), PEERS_NOTE, ""], speed_summary(speed_results, args)
        if not details.exists():
            details.parent.mkdir(parents=True, exist_ok=True)
            details.write_text(HEADER + "\n")
        harness.write_block(details, "\n".join([MARKS[part][0], *table, MARKS[part][1]]), *MARKS[part])
        harness.write_block(markdown, "\n".join([MARKS[part][0], *lines, MARKS[part][1]]), *MARKS[part])

    if "lds" in args.parts:
        with tempfile.TemporaryDirectory() as workdir:
            task_file = str(Path(workdir) / "task.pt")
            truth = run_case(dict(common, part="truth", task=args.task, task_file=task_file), args.timeout)
            print(f"[truth] {truth.get('error') or truth}", file=sys.stderr, flush=True)
            if "error" in truth:
                raise SystemExit(f"ground truth failed: {truth['error']}")
            for method in args.lds_methods:
                case = dict(common, part="lds", method=method, task_file=task_file, dampings=args.dampings)
                r = run_case(case, args.timeout)
                lds_results.append(r)
                shown = _failure(r) if "error" in r else f"LDS {best(r)[1]:.3f} at damping {best(r)[0]}"
                print(f"[lds] {method}: {shown}", file=sys.stderr, flush=True)
                report("lds")
    if "speed" in args.parts:
        todo = []
        for model in args.speed_models:
            todo.append(dict(common, part="speed", model=model, method="plain", paired=False))
            for method in args.speed_methods:
                todo += [
                    dict(common, part="speed", model=model, method=method, paired=paired) for paired in (True, False)
                ]
        for case in todo:
            case.update(dim=args.dim, repeats=args.repeats if case["paired"] else 1)
            r = run_case(case, args.timeout)
            speed_results.append(r)
            kind = "paired" if case["paired"] else "memory"
            shown = harness.progress(r, case["paired"], _failure)
            print(f"[speed] {case['model']} {case['method']} {kind}: {shown}", file=sys.stderr, flush=True)
            report("speed")
    print(details.read_text())


if __name__ == "__main__":
    main()
