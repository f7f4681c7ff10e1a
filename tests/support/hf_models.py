"""Tiny random-init HF GPT-2, BERT, LLaMA and timm ViT models in float64, each with a
batch of ``N`` samples (tests/integration/test_transformers.py, tests/engine/test_host_syncs.py),
the three HF models with PEFT's LoRA adapters (tests/integration/test_lora.py), and the
three HF language models at their real vocabularies with tied input and output
embeddings (tests/integration/test_tied_lm.py, tests/extensions/test_tied_ghost.py);
and a T5 encoder classifier, whose relative attention bias runs without the batch axis
(tests/extensions/test_clipping.py, tests/engine/test_reliability.py)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")  # the dev extra installs it: see the README
timm = pytest.importorskip("timm")

DT = torch.float64
N, T, V = 3, 5, 23


class Logits(nn.Module):
    """An HF model as the loss sees it: ids [N, T] -> logits [N, C, T] (token models) or
    [N, C] (sequence classifiers)."""

    def __init__(self, model: nn.Module, per_token: bool):
        super().__init__()
        self.model, self.per_token = model, per_token

    def forward(self, ids: Tensor) -> Tensor:
        logits = self.model(ids).logits
        return logits.transpose(1, 2) if self.per_token else logits


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=8, n_head=2, vocab_size=V, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    return Logits(transformers.GPT2LMHeadModel(config), per_token=True)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=8, num_attention_heads=2, intermediate_size=12, vocab_size=V,
        max_position_embeddings=8, num_labels=3,
    )  # fmt: skip
    return Logits(transformers.BertForSequenceClassification(config), per_token=False)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=12,
        vocab_size=V, max_position_embeddings=8, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Logits(transformers.LlamaForCausalLM(config), per_token=True)


def vit() -> nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=4, num_classes=3, depth=2,
        embed_dim=8, num_heads=2,
    )  # fmt: skip


def tokens(classes: int | None):
    X = torch.randint(0, V, (N, T))
    return X, torch.randint(0, classes or V, (N,) if classes else (N, T))


MODELS = {
    "gpt2": (gpt2, lambda: tokens(None)),
    "bert": (bert, lambda: tokens(3)),
    "llama": (llama, lambda: tokens(None)),
    "vit": (vit, lambda: (torch.randn(N, 3, 8, 8, dtype=DT), torch.randint(0, 3, (N,)))),
}


def build(name: str):
    torch.manual_seed(0)
    make, data = MODELS[name]
    model = make().to(DT).eval()  # no dropout: the loop must compute the same function
    X, y = data()
    return model, X, y


#: the attention projections LoRA adapts in each HF model (GPT-2's fused ``c_attn`` is a
#: Conv1D, whose weight is stored [in, out]: PEFT's ``fan_in_fan_out``)
LORA_TARGETS = {"gpt2": ["c_attn"], "bert": ["query", "value"], "llama": ["q_proj", "v_proj"]}


#: each model's token embedding, which PEFT wraps in a ``lora.Embedding``
EMBEDDINGS = {"gpt2": "wte", "bert": "word_embeddings", "llama": "embed_tokens"}


def build_lora(name: str, embedding: bool = False):
    """:func:`build`'s model with its HF model swapped for PEFT's LoRA model on it (rank 2,
    no dropout), on the attention projections and, with ``embedding``, the token
    embedding: only the adapters train. PEFT starts ``lora_B`` (``lora_embedding_B``) at
    zero, which would make ``lora_A``'s gradients zero; here it is random, so that both
    are tested."""
    peft = pytest.importorskip("peft")
    model, X, y = build(name)
    targets = LORA_TARGETS[name] + ([EMBEDDINGS[name]] if embedding else [])
    config = peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets,
        fan_in_fan_out=name == "gpt2",
    )  # fmt: skip
    model.model = peft.get_peft_model(model.model, config).to(DT)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_B" in pname or "lora_embedding_B" in pname:
                p.normal_()
    return model, X, y


#: the real vocabularies of the tied language models
VOCAB = {"gpt2": 50257, "bert": 30522, "llama": 32000}


class MaskedLM(nn.Module):
    """HF BERT's masked-LM head as the loss sees it: X [N, 2, T] (token ids, then token
    type ids, so that the per-sample loop slices both) -> logits [N, V, T]. Position ids
    are BERT's default, one ``[1, T]`` row broadcast over the batch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, X: Tensor) -> Tensor:
        return self.model(input_ids=X[:, 0], token_type_ids=X[:, 1]).logits.transpose(1, 2)


def tied_lm(name: str, d: int = 16, t: int = 8, vocab: int | None = None) -> nn.Module:
    """``name``'s one-layer language model at its real vocabulary (:data:`VOCAB`, or ``vocab``), width
    ``d``, up to ``t`` positions, its token embedding tied to its output head: GPT-2's
    ``wte``/``lm_head``, BERT's ``word_embeddings``/``cls.predictions.decoder`` (with token
    type embeddings: see :class:`MaskedLM`), LLaMA's ``embed_tokens``/``lm_head``
    (``tie_word_embeddings=True``). Random init, float32: the caller sets the dtype."""
    v = vocab or VOCAB[name]
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1, n_embd=d, n_head=2, vocab_size=v, n_positions=t, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(config)
        tied = model.lm_head.weight is model.transformer.wte.weight
    elif name == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=1, hidden_size=d, num_attention_heads=2, intermediate_size=24, vocab_size=v,
            max_position_embeddings=t, type_vocab_size=2,
        )  # fmt: skip
        model = transformers.BertForMaskedLM(config)
        tied = model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=d, num_attention_heads=2, num_key_value_heads=1, intermediate_size=24,
            vocab_size=v, max_position_embeddings=t, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied, f"{name}: the embeddings are not tied"
    return MaskedLM(model) if name == "bert" else Logits(model, per_token=True)


class T5Classifier(nn.Module):
    """HF T5's encoder (one layer, its relative attention bias an nn.Embedding called on
    [T, T] bucket ids, with no batch axis, its output broadcast over the batch), then a
    mean over positions and a Linear: token ids [N, T] -> [N, 3]."""

    def __init__(self):
        super().__init__()
        config = transformers.T5Config(
            vocab_size=50, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, dropout_rate=0.0,
        )  # fmt: skip
        self.encoder, self.head = transformers.T5EncoderModel(config), nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.encoder(input_ids=ids).last_hidden_state.mean(1))
