"""The benchmark models, each with its data: ``MODELS[name].build(quick)``.

Every builder is seeded, so each subprocess rebuilds the same model and batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def seed_cnn() -> nn.Module:
    """The CNN of BackPACK's "saving memory in convolutions" example (and of
    ``examples/plot_save_memory.py``): [N, 1, 28, 28] -> [N, 10], 462,762 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(128, 256, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, padding=1, stride=2),
        nn.Conv2d(256, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(64, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def mlp(width: int) -> nn.Module:
    """[N, 784] -> [N, 10], two hidden layers of ``width``."""
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus a skip (a 1x1 conv where the shape changes):
    [N, C_in, H, W] -> [N, C_out, H/stride, W/stride]"""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride=stride)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


def resnet(width: int) -> nn.Module:
    """A small ResNet: [N, 3, 32, 32] -> [N, 10]; BatchNorm in eval mode."""
    model = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        Block(width, width, 1),
        Block(width, 2 * width, 2),
        Block(2 * width, 2 * width, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    )
    for m in model.modules():  # BatchNorm uses its running statistics; the rest trains
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


def separable(width: int) -> nn.Module:
    """MobileNet-style: a 3x3 conv, then three depthwise 3x3 convs (``groups`` = channels),
    each followed by a pointwise 1x1 conv: [N, 3, 32, 32] -> [N, 10]."""
    layers = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU()]
    for c_in, c_out, stride in ((width, 2 * width, 1), (2 * width, 4 * width, 2), (4 * width, 4 * width, 1)):
        layers += [nn.Conv2d(c_in, c_in, 3, stride=stride, padding=1, groups=c_in), nn.ReLU()]
        layers += [nn.Conv2d(c_in, c_out, 1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 10))


class TransformerBlock(nn.Module):
    """Single-head self-attention and an MLP, each with a residual, all Linear on
    [N, T, d] -> [N, T, d]. LayerNorm without affine parameters."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        scores = self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5  # [N, T, T]
        x = x + self.o(scores.softmax(-1) @ self.v(h))
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Transformer(nn.Module):
    """[N, T, F] -> [N, 10]: an input projection, blocks, mean over T, a classifier."""

    def __init__(self, features: int, d: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.blocks = nn.Sequential(*[TransformerBlock(d) for _ in range(depth)])
        self.head = nn.Linear(d, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.embed(x)).mean(1))


class CausalLM(nn.Module):
    """HF GPT-2 (``GPT2LMHeadModel``, tied embeddings, default ``[1, T]`` position ids),
    random weights: token ids [N, T] -> logits [N, V, T], as ``nn.CrossEntropyLoss``
    takes them against the next tokens [N, T]."""

    def __init__(self, layers: int, d: int, heads: int, vocab: int, positions: int):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=positions,
            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
        )  # fmt: skip
        self.lm = GPT2LMHeadModel(config).eval()  # no dropout: every method computes the same function

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids).logits.transpose(1, 2)


def vit_tiny(quick: bool) -> nn.Module:
    """timm's ``vit_tiny_patch16_224`` at 32x32 with 4x4 patches, 10 classes, random
    weights (its own ``cls_token`` and ``pos_embed``; fused attention)."""
    import timm

    kwargs = dict(depth=1, embed_dim=16, num_heads=2) if quick else {}
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10, **kwargs
    ).eval()


def token_batch(shape: tuple[int, ...], vocab: int) -> tuple[Tensor, Tensor]:
    """Random token ids [N, T + 1]: the inputs, and the next tokens as targets."""
    ids = torch.randint(0, vocab, (shape[0], shape[1] + 1))
    return ids[:, :-1], ids[:, 1:]


@dataclass(frozen=True)
class Bench:
    """One benchmark problem: a model, a batch shape and a description."""

    description: str
    make: Callable[[bool], nn.Module]
    input_shape: Callable[[bool], tuple[int, ...]]  # quick -> [N, ...]
    #: extensions that jacmem runs here with each strategy, not only with auto
    #: (``--all-strategies``: all of them, everywhere)
    compare_strategies: tuple[str, ...] = ()
    #: ``(quick, [N, ...]) -> (X, y)``: the batch; by default Gaussian inputs and 10 classes
    data: Callable[[bool, tuple[int, ...]], tuple[Tensor, Tensor]] | None = None

    def build(self, quick: bool, batch: int | None = None) -> tuple[nn.Module, Tensor, Tensor]:
        """(model, X, y), the same in every process; ``batch`` overrides N."""
        torch.manual_seed(0)
        model = self.make(quick)
        shape = self.input_shape(quick)
        shape = (batch or shape[0], *shape[1:])
        if self.data is not None:
            return (model, *self.data(quick, shape))
        X = torch.randn(shape)
        y = torch.randint(0, 10, (X.shape[0],))
        return model, X, y


def _freeze_batchnorm(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.requires_grad_(False)
    return model


def _resnet(quick: bool) -> nn.Module:
    model = resnet(4 if quick else 16)
    if not has_batchnorm_derivative():
        _freeze_batchnorm(model)
    return model


def has_batchnorm_derivative() -> bool:
    from jacmem.derivatives import REGISTRY

    return nn.BatchNorm2d in REGISTRY


MODELS: dict[str, Bench] = {
    "seed-cnn-64": Bench(
        "seed CNN (4 convs 1-128-256-64-32, MaxPool, Linear 32-10), [64, 1, 28, 28]",
        lambda quick: seed_cnn(),
        lambda quick: (4 if quick else 64, 1, 28, 28),
    ),
    "seed-cnn-256": Bench(
        "seed CNN, [256, 1, 28, 28]",
        lambda quick: seed_cnn(),
        lambda quick: (8 if quick else 256, 1, 28, 28),
        compare_strategies=("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"),
    ),
    "mlp": Bench(
        "MLP 784-512-512-10 with ReLU, [128, 784]",
        lambda quick: mlp(16 if quick else 512),
        lambda quick: (4 if quick else 128, 784),
    ),
    "resnet": Bench(
        "ResNet-style CNN: conv, 3 residual blocks (16-32-32 channels) with BatchNorm in eval mode, [64, 3, 32, 32]",
        _resnet,
        lambda quick: (4 if quick else 64, 3, 32, 32),
    ),
    "depthwise": Bench(
        "MobileNet-style CNN: conv 3-32, three depthwise 3x3 convs (32, 64, 128 channels, one "
        "group each) with pointwise 1x1 convs, [64, 3, 32, 32]",
        lambda quick: separable(4 if quick else 32),
        lambda quick: (4 if quick else 64, 3, 32, 32),
        compare_strategies=("BatchGrad",),  # the three per-sample conv strategies on groups
    ),
    "transformer": Bench(
        "transformer-style: Linear embed 32-128, 2 blocks (attention q/k/v/o and MLP 128-512-128, "
        "residuals), [64, T=64, 32]",
        lambda quick: Transformer(8 if quick else 32, 16 if quick else 128, 1 if quick else 2),
        lambda quick: (4 if quick else 64, 8 if quick else 64, 8 if quick else 32),
        compare_strategies=("BatchL2Grad",),  # ghost norm versus per-sample gradients
    ),
    "gpt2": Bench(
        "HF GPT-2 (transformers' GPT2LMHeadModel, random init): 4 layers, d=256, 4 heads, vocabulary "
        "2048, tied embeddings, default position ids, next-token loss; [16, T=128] token ids",
        lambda quick: CausalLM(1, 16, 2, 64, 16) if quick else CausalLM(4, 256, 4, 2048, 128),
        lambda quick: (2, 8) if quick else (16, 128),
        data=lambda quick, shape: token_batch(shape, 64 if quick else 2048),
    ),
    "vit-tiny": Bench(
        "timm ViT-tiny (vit_tiny_patch16_224, random init) at 32x32, patch 4: 12 blocks, d=192, 3 heads, "
        "65 tokens; [32, 3, 32, 32]",
        vit_tiny,
        lambda quick: (2, 3, 32, 32) if quick else (32, 3, 32, 32),
    ),
}
