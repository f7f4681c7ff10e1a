"""The DP benchmark runs end to end in its smallest setting (the seed CNN at batch 8:
the ordinary step's memory process, then jacmem's paired and memory processes), writes
its block of BENCHMARKS.md and only it; an engine that refuses a model is a row that
says so."""

import re
from types import SimpleNamespace

import pytest

from benchmarks import dp

pytestmark = pytest.mark.slow  # whole benchmark processes: `make test-slow`


def test_quick_dp_block(tmp_path, capsys):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# report\n\n<!-- dp:start -->\nstale\n<!-- dp:end -->\n\nkept\n")
    dp.main(["--quick", "--models", "seed-cnn-256", "--only", r"plain|jacmem", "--markdown", str(md)])
    err = capsys.readouterr().err
    assert re.search(r"\[1/3\] seed-cnn-256 plain memory: peak [+-]\d+ MiB", err), err
    assert re.search(r"\[2/3\] seed-cnn-256 jacmem paired: \d+ ms, [\d.]+x an SGD step \(1 pairs\)", err), err
    text = md.read_text()
    assert text.startswith("# report\n") and text.rstrip().endswith("kept") and "stale" not in text
    assert re.search(r"\| seed-cnn-256 \| jacmem \| \d+ \| [\d.]+ \| (yes|no) \| -?\d+ \| (-?[\d.]+|n/a) \|", text), (
        text
    )
    assert "fails" not in text


def test_a_refusing_engine_is_a_row_not_a_crash():
    args = SimpleNamespace(
        models=["gpt2"], quick=True, started="now", load_before="0 0 0", threads=2, repeats=1, seconds=0.0, note=""
    )
    refused = dict(model="gpt2", engine="opacus:ghost", paired=True, error="ValueError: tied weights")
    lines = dp.table([refused, dict(refused, paired=False)], args)
    assert "| gpt2 | Opacus 1.6 ghost clipping | fails: tied weights | | | | |" in lines


def test_the_main_benchmark_selects_the_dp_section(monkeypatch):
    """``python -m benchmarks --dp [--quick]`` runs this section alone."""
    from benchmarks import run

    calls = []
    monkeypatch.setattr(dp, "main", calls.append)
    run.main(["--dp", "--quick"])
    run.main(["--dp"])
    assert calls == [["--quick"], []]
