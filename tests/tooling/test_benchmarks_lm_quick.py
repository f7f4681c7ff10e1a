"""The real-size language-model benchmark runs end to end in its smallest setting (tiny
GPT-2, tied embeddings: the plain step's memory process, then ClipGrad's paired and
memory processes), writes its block of BENCHMARKS.md and only it; a peer that refuses a
model, and torch.func over its memory budget, are rows that say so."""

import re
from types import SimpleNamespace

import pytest

from benchmarks import lm

pytestmark = pytest.mark.slow  # whole benchmark processes: `make test-slow`


def test_quick_lm_block(tmp_path, capsys):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# report\n\n<!-- lm:start -->\nstale\n<!-- lm:end -->\n\nkept\n")
    lm.main(["--quick", "--models", "gpt2", "--methods", "jacmem:ClipGrad", "--markdown", str(md)])
    err = capsys.readouterr().err
    assert re.search(r"\[1/3\] gpt2 plain memory: peak \d+ MiB", err), err
    assert re.search(r"\[2/3\] gpt2 jacmem:ClipGrad paired: \d+ ms, [\d.]+x plain \(1 pairs\)", err), err
    text = md.read_text()
    assert text.startswith("# report\n") and text.rstrip().endswith("kept") and "stale" not in text
    row = r"\| gpt2 \| jacmem `ClipGrad` in the block \| \d+ \| [\d.]+ \([\d.]+–[\d.]+\) \| \d+ \| [\d.]+ \| ≤ 1.2 \| (yes|no) \|"
    assert re.search(row, text), text
    assert "fails" not in text


def test_refusals_and_skips_are_rows():
    args = SimpleNamespace(
        models=["gpt2"], methods=["opacus:ghost", "torch.func"], quick=True, started="now", machine="cpu",
        load_before="0 0 0", threads=2, repeats=1, func_gib=6.0, note="",
    )  # fmt: skip
    refused = dict(model="gpt2", method="opacus:ghost", paired=True, error="NotImplementedError: tied weights")
    skipped = dict(model="gpt2", method="torch.func", paired=True, error="skipped: needs 7.5 GiB")
    lines = lm.table([refused, skipped], args)
    assert "| gpt2 | private step, Opacus 1.6 ghost clipping | fails: tied weights | | | | | |" in lines
    assert "| gpt2 | `torch.func` vmap(grad), clipped sum | skipped: needs 7.5 GiB | | | | | |" in lines
