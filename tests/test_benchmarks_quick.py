"""The benchmark harness runs end to end (two tiny cases, each in its own process),
writes its table, and keeps the other benchmarks' sections of BENCHMARKS.md."""

import re

from benchmarks.run import main


def test_quick_cases_write_report(tmp_path, capsys):
    md, png = tmp_path / "BENCHMARKS.md", tmp_path / "results.png"
    lean = "<!-- lean:start -->\n## Lean layers\nkept as it was\n<!-- lean:end -->"
    other = "<!-- secondorder:start -->\n## Second order\n| a | b |\n<!-- secondorder:end -->"
    md.write_text("# old report\n\n" + lean + "\n\nstale text\n\n" + other + "\n")
    only = r"^seed-cnn-64 (plain|jacmem:BatchL2Grad:auto)$"
    main(["--quick", "--models", "seed-cnn-64", "--only", only, "--markdown", str(md), "--plot", str(png)])
    err = capsys.readouterr().err
    # progress: one line per case on stderr
    assert re.search(r"\[1/2\] seed-cnn-64 plain: \d+ ms", err), err
    assert re.search(r"\[2/2\] seed-cnn-64 jacmem:BatchL2Grad:auto: \d+ ms \([\d.]+x plain\)", err), err
    text = md.read_text()
    assert "# old report" not in text and "stale text" not in text
    assert text.count(lean) == 1 and text.count(other) == 1
    assert re.search(r"\| plain forward\+backward \| none \| \d+ \| 1\.00 \| 0 \| 0\.00 \|", text), text
    row = r"\| jacmem BatchL2Grad \(auto\) \| BatchL2Grad \| \d+ \| [\d.]+ \| -?\d+ \| -?[\d.]+ \|"
    assert re.search(row, text), text
    assert "| seed-cnn-64 | BatchL2Grad |" in text  # the targets table
    assert "Command: `python -m benchmarks --quick" in text and "torch " in text
    assert png.stat().st_size > 10_000
    assert (tmp_path / "results.json").exists()
