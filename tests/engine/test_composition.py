"""The engines are composed, not subclassed (issue 37): first order and clipping each hold
one staging component; what they know of their block comes down to them in a context,
and they never call up into the block; the optimizer hands the clipping threshold down,
and the engine never calls into the optimizer."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest
import torch
from tests.support.privacy import FLAT, batch, net
from torch import nn

import jacmem
from jacmem.engine.block import Block
from jacmem.engine.clipping import ClippingEngine
from jacmem.engine.firstorder import FirstOrderEngine
from jacmem.engine.staging import Stager
from jacmem.privacy import PrivacyEngine

ROOT = pathlib.Path(jacmem.__file__).parent
#: the engines' modules, and what they hold
ENGINES = ["engine/base.py", "engine/staging.py", "engine/firstorder.py", "engine/clipping.py"]
#: the engines themselves (``base.py``'s :class:`~jacmem.engine.base.Passes` is the block's
#: own: it tells the block, which made it, that a pass ended)
ENGINE_FILES = {str(ROOT / path) for path in ENGINES[1:]} | {str(p) for p in (ROOT / "engine/secondorder").glob("*.py")}
#: what an engine module may not name: the block above it, the optimizer and the privacy layer
ABOVE = {"jacmem.engine.block", "jacmem.privacy", "jacmem.context", "torch.optim"}


def test_the_clipping_engine_holds_the_staging_rather_than_subclassing_first_order():
    assert not issubclass(ClippingEngine, FirstOrderEngine)
    assert not issubclass(FirstOrderEngine, ClippingEngine)
    for ext in (jacmem.BatchGrad(), jacmem.ClipGrad(1.0)):
        block = Block(ext).open()
        try:
            (engine,) = block.engines
            assert isinstance(engine.stager, Stager)
            assert engine.stager.engine is engine
        finally:
            block.close()


@pytest.mark.parametrize("path", ENGINES)
def test_no_engine_module_names_the_block_or_the_optimizer(path):
    """By the source: no import of the block, the privacy layer or torch.optim, and no
    name ``Block`` or ``optimizer``."""
    tree = ast.parse((ROOT / path).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & ABOVE
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"Block", "optimizer", "privacy"}


def _callers_of(files: set[str], run) -> list[tuple[str, str]]:
    """(the caller's file, the function called) for each call into code of ``files``
    while ``run()`` runs."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files and frame.f_back is not None:
            seen.append((frame.f_back.f_code.co_filename, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("ext", [jacmem.BatchGrad, jacmem.BatchL2Grad, lambda: jacmem.ClipGrad(FLAT)])
def test_no_engine_calls_up_into_the_block(ext):
    """A step's forward and backward in a block: the block calls the engines, never the
    other way (before, the engines called the block's ``name``, ``groups``, ``models``
    and ``shardings`` back)."""
    model, (X, y) = net(), batch()

    def step():
        with jacmem.extend(ext()):
            nn.functional.cross_entropy(model(X), y).backward()

    up = [(caller, called) for caller, called in _callers_of({sys.modules[Block.__module__].__file__}, step)]
    assert [c for c in up if c[0] in ENGINE_FILES] == []
    assert up, "the block ran no code: the check saw nothing"


def test_the_optimizer_hands_the_threshold_down():
    """A private step's backward runs no code of the privacy layer (before, the engine
    read the threshold from the optimizer's ``clip_threshold``, in every pass); the
    threshold is on the clip as a plain value, set by the optimizer, and a threshold set
    between steps clips the next step."""
    engine = PrivacyEngine()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = batch()
    model, opt, _ = engine.make_private(
        module=model, optimizer=opt, data_loader=torch.utils.data.DataLoader(list(zip(X, y)), batch_size=len(X)),
        noise_multiplier=0.0, max_grad_norm=FLAT, poisson_sampling=False,
    )  # fmt: skip
    try:
        clip = engine._private.clip
        assert clip.max_norm == FLAT and not callable(clip.max_norm)
        privacy = {sys.modules["jacmem.privacy"].__file__}
        assert _callers_of(privacy, lambda: nn.functional.cross_entropy(model(X), y).backward()) == []
        assert clip.held == FLAT
        opt.step()
        opt.zero_grad()
        opt.max_grad_norm = FLAT / 2
        assert clip.held is None and clip.max_norm == FLAT / 2
        nn.functional.cross_entropy(model(X), y).backward()
        assert clip.held == FLAT / 2
    finally:
        engine.detach()
