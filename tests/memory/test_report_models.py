"""jacmem.memory.report on HF and timm models (tiny configs, random init): names the
modules, what each keeps and for which gradients, what a lean copy keeps, and what
checkpointing each repeated block saves; and the saved-tensor accounting against an
independent count through ``torch.autograd.graph.saved_tensors_hooks``."""

import copy
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from jacmem.memory import lean, report

pytestmark = pytest.mark.usefixtures("float64_default")


def _bert(dropout=0.1):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    return transformers.BertModel(cfg, add_pooling_layer=False).train()


def _vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5
    )


def test_report_on_hf_bert():
    model = _bert()
    ids = torch.randint(0, 50, (2, 16))
    r = report(model, ids)
    names = {m.name for m in r.modules}
    assert "encoder.layer.0.attention.self" in names and "encoder.layer.1.intermediate.intermediate_act_fn" in names
    rows = {m.name: m for m in r.modules}
    # the GELU keeps its input [2, 16, 64] for the input's gradient; the next Linear its output for its weight's
    assert rows["encoder.layer.0.intermediate.intermediate_act_fn"].kept_for == {"input": 2 * 16 * 64 * 8}
    assert rows["encoder.layer.0.output.dense"].kept_for == {"encoder.layer.0.output.dense.weight": 2 * 16 * 64 * 8}
    # lean: dropout keeps seeds, attention q, k, v and a log-sum-exp; measured on a copy
    assert r.lean_saved_bytes is not None and r.lean_saved_bytes < 0.7 * r.saved_bytes
    assert rows["encoder.layer.0.attention.self"].lean_bytes < rows["encoder.layer.0.attention.self"].bytes
    leaned = lean(copy.deepcopy(model))
    leaned(ids)  # the first pass learns which layers read which outputs
    assert r.lean_saved_bytes == report(leaned, ids, lean=False).saved_bytes
    assert type(model.encoder.layer[0].output.dense) is nn.Linear  # the model itself is untouched
    # checkpointing: both encoder layers, each keeping far more than its input
    blocks = {b.name: b for b in r.blocks}
    assert set(blocks) == {"encoder.layer.0", "encoder.layer.1"}
    b = blocks["encoder.layer.0"]
    assert b.input_bytes == 2 * 16 * 32 * 8 and b.checkpoint_saves == b.bytes - b.input_bytes > 0
    savers = r.savers(3)
    assert savers[0]["module"].endswith("attention.self") and savers[0]["lean_saves"] > 0
    text = r.table()
    assert "Largest savers" in text and "Checkpointing a repeated block" in text and "encoder.layer.0" in text
    assert "jacmem.memory.lean(model) keeps" in r.suggestions[0]


def test_report_on_timm_vit():
    model = _vit()
    x = torch.randn(2, 3, 16, 16)
    r = report(model, x)
    rows = {m.name: m for m in r.modules}
    tokens = 2 * 17  # 16 patches and the class token
    # fc2 keeps the GELU's output for its weight's gradient; a lean copy keeps none of it
    # (the GELU keeps its input anyway, and fc2 recomputes the output from it)
    assert rows["blocks.0.mlp.fc2"].kept_for == {"blocks.0.mlp.fc2.weight": tokens * 128 * 8}
    assert rows["blocks.0.mlp.fc2"].lean_bytes == 0
    assert r.saved_bytes - r.lean_saved_bytes >= 2 * tokens * 128 * 8
    assert {b.name for b in r.blocks} == {"blocks.0", "blocks.1"}
    assert any(s["module"] == "blocks.0.mlp.fc2" for s in r.savers(4))


def _independent_count(fn, *inputs, exclude=()):
    """Bytes of the distinct storages that the autograd graph still holds after
    ``fn(*inputs)``, leaving out parameters, buffers, the inputs and the outputs:
    every packed tensor wrapped in a box that only the graph refers to."""

    class Box:
        def __init__(self, t):
            self.t = t

    boxes = []

    def pack(t):
        box = Box(t)
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    skip = {t.untyped_storage().data_ptr() for t in [*exclude, *inputs, *outs]}
    storages = {}
    for ref in boxes:
        box = ref()
        if box is not None:
            s = box.t.untyped_storage()
            if s.data_ptr() not in skip:
                storages[s.data_ptr()] = s.nbytes()
    del out, outs
    return sum(storages.values())


def _cases():
    from benchmarks.lean import Llama, LoRALinear

    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten()
    ).eval()
    llama = Llama(dim=32, depth=1, heads=4, kv_heads=2, hidden=64).train()
    llama.blocks[0].q_proj = LoRALinear(llama.blocks[0].q_proj, rank=2)
    yield "cnn", cnn, torch.randn(2, 3, 10, 10)
    yield "llama", llama, torch.randn(2, 6, 32)
    yield "bert", _bert(dropout=0.1), torch.randint(0, 50, (2, 8))


@pytest.mark.parametrize("variant", ["stock", "lean"])
def test_saved_bytes_against_saved_tensors_hooks(variant):
    """report's saved_bytes equals an independent count, for stock and lean models in
    several requires_grad settings."""
    for name, model, x in _cases():
        model = lean(model) if variant == "lean" else model
        params = [*model.parameters(), *model.buffers()]
        settings = {"all": None, "frozen": False}
        for setting, flag in settings.items():
            if flag is not None:
                model.requires_grad_(False)
                for m in model.modules():
                    if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm2d)) or type(m).__name__ == "LoRALinear":
                        m.requires_grad_(True)
            xs = x.clone().requires_grad_() if x.is_floating_point() else x

            def fn(t):
                out = model(t)
                out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
                return F.softplus(out).sum()

            fn(xs)  # lean layers learn their readers
            torch.manual_seed(1)
            count = _independent_count(fn, xs, exclude=params)
            torch.manual_seed(1)
            assert report(fn, xs).saved_bytes == count > 0, (name, setting)
