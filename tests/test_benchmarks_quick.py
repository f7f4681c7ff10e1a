"""The benchmark harness runs end to end (two tiny cases, each in its own process),
writes its table, and keeps the memory toolkit's section of BENCHMARKS.md."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_cases_write_report(tmp_path):
    md, png = tmp_path / "BENCHMARKS.md", tmp_path / "results.png"
    lean = "<!-- lean:start -->\n## Lean layers\nkept as it was\n<!-- lean:end -->"
    md.write_text("# old report\n\n" + lean + "\n")
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--models", "seed-cnn-64", "--only", r"^seed-cnn-64 (plain|jacmem:BatchL2Grad:auto)$"]
    proc = subprocess.run(
        cmd + ["--markdown", str(md), "--plot", str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # progress: one line per case on stderr
    assert re.search(r"\[1/2\] seed-cnn-64 plain: \d+ ms", proc.stderr), proc.stderr
    assert re.search(r"\[2/2\] seed-cnn-64 jacmem:BatchL2Grad:auto: \d+ ms \([\d.]+x plain\)", proc.stderr)
    text = md.read_text()
    assert "# old report" not in text and text.count(lean) == 1
    assert re.search(r"\| plain forward\+backward \| none \| \d+ \| 1\.00 \| 0 \| 0\.00 \|", text), text
    row = re.search(r"\| jacmem BatchL2Grad \(auto\) \| BatchL2Grad \| (\d+) \| ([\d.]+) \| (-?\d+) \| (-?[\d.]+) \|", text)
    assert row, text
    assert "| seed-cnn-64 | BatchL2Grad |" in text  # the targets table
    assert "Command: `python -m benchmarks --quick" in text and "torch " in text
    assert png.stat().st_size > 10_000
    assert (tmp_path / "results.json").exists()
