"""The torch.compile benchmark runs end to end in its smallest setting (the seed CNN at
batch 8, the aot_eager backend: plain, BatchL2Grad and ClipGrad steps, eager and
compiled, alternated in one process), writes its block of BENCHMARKS.md and only it,
and counts what Dynamo made: one graph for the plain copy, one for the jacmem steps
(ClipGrad reuses BatchL2Grad's), no graph break and no recompile."""

import re

import pytest

from benchmarks.compile import main

pytestmark = pytest.mark.slow  # whole benchmark processes: `make test-slow`


def test_quick_compile_block(tmp_path, capsys):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# report\n\n<!-- compile:start -->\nstale\n<!-- compile:end -->\n\nkept\n")
    main(["--quick", "--models", "seed-cnn-64", "--markdown", str(md), "--repeats", "2"])
    err = capsys.readouterr().err
    assert re.search(r"\[1/1\] seed-cnn-64: eager plain [\d.]+ s, compiled plain .*compiled ClipGrad [\d.]+ s", err), (
        err
    )
    text = md.read_text()
    assert text.startswith("# report\n") and text.rstrip().endswith("kept") and "stale" not in text
    assert "fails" not in text and "2 rounds" in text and "No graph breaks in the compiled steps." in text
    for method, graphs in (("plain", 1), ("BatchL2Grad", 1), ("ClipGrad", 0)):
        row = rf"\| {method} \|( [\d.]+ \|){{5}} {graphs} \| 0 \| 0 \|"
        assert re.search(row, text), text
