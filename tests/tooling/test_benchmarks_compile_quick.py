"""The torch.compile benchmark runs end to end in its smallest setting (the seed CNN at
batch 2, the aot_eager backend: plain, BatchL2Grad and ClipGrad steps, eager and
compiled, each in a process of its own), writes its block of BENCHMARKS.md and only it."""

import re

from benchmarks.compile import main


def test_quick_compile_block(tmp_path, capsys):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# report\n\n<!-- compile:start -->\nstale\n<!-- compile:end -->\n\nkept\n")
    main(["--quick", "--models", "cnn", "--markdown", str(md)])
    err = capsys.readouterr().err
    assert re.search(r"\[4/6\] cnn compiled BatchL2Grad: [\d.]+ s", err), err
    text = md.read_text()
    assert text.startswith("# report\n") and text.rstrip().endswith("kept") and "stale" not in text
    assert "fails" not in text
    for method in ("plain", "BatchL2Grad", "ClipGrad"):
        assert re.search(rf"\| {method} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", text), text
