"""The benchmark harness runs end to end (two tiny cases, each in its own process),
writes its table, and keeps the other benchmarks' sections of BENCHMARKS.md."""

import re

import pytest

from benchmarks.run import main

pytestmark = pytest.mark.slow  # whole benchmark processes: `make test-slow`


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
    details = (tmp_path / "details" / "seed-cnn-64.md").read_text()  # every method, and what auto chose
    assert re.search(r"\| plain forward\+backward \| none \| \d+ \| 1\.00 \| 0 \| 0\.00 \|", details), details
    row = r"\| jacmem BatchL2Grad \(auto\) \| BatchL2Grad \| \d+ \| [\d.]+ \| -?\d+ \| -?[\d.]+ \|"
    assert re.search(row, details), details
    assert "ctx.explain()" in details and "ctx.explain()" not in text
    # the summary's peers table links the details and gives jacmem's time spread
    assert re.search(
        r"\| \[seed-cnn-64\]\(benchmarks/details/seed-cnn-64\.md\) \| BatchL2Grad \| \d+ \(\d+–\d+\) \|", text
    )
    assert "| seed-cnn-64 | BatchL2Grad |" in text  # the targets table
    assert "Command: `python -m benchmarks --quick" in text and "torch " in text
    assert png.stat().st_size > 10_000
    assert (tmp_path / "results.json").exists()


def test_cpu_time_and_memory_come_from_two_processes(monkeypatch):
    """On CPU a full run times a case with glibc keeping freed memory, and takes its peak
    from a second, unpaired process in which glibc returns memory at once."""
    from benchmarks import harness

    calls = []

    def fake_run_case(case, timeout, env=None):
        calls.append((case, env))
        if env is harness.TIME_MALLOC:
            return dict(case, time_s=1.0, paired_ratio=1.5, rss_setup=1, rss_peak=9, extra_bytes=8)
        return dict(case, time_s=9.0, paired_ratio=None, rss_setup=2, rss_peak=5, extra_bytes=3)

    monkeypatch.setattr(harness, "run_case", fake_run_case)
    case = dict(
        model="m",
        method="jacmem:BatchGrad:auto",
        quick=False,
        device="cpu",
        threads=2,
        warmup=1,
        repeats=7,
        seconds=4.0,
    )
    result = harness.measure(case, timeout=10)
    assert [env for _, env in calls] == [harness.TIME_MALLOC, harness.MEMORY_MALLOC]
    assert calls[1][0]["paired"] is False and calls[1][0]["repeats"] == 2
    assert (result["time_s"], result["paired_ratio"], result["extra_bytes"]) == (1.0, 1.5, 3)

    calls.clear()
    harness.measure(dict(case, device="cuda"), timeout=10)
    assert [env for _, env in calls] == [None]  # one process: max_memory_allocated counts live tensors


def test_a_child_peak_is_its_own(tmp_path):
    """A case's peak memory is that of its own process, even where the process that
    starts it has used far more (Linux carries ``ru_maxrss`` over ``exec``)."""
    import torch

    from benchmarks import harness

    ballast = torch.ones(800 * 2**20 // 4)  # 800 MiB, touched
    case = dict(model="seed-cnn-64", method="plain", quick=True, device="cpu", threads=1)
    case.update(warmup=1, repeats=1, seconds=0.0, paired=False)
    result = harness.run_case(case, timeout=300, env=harness.MEMORY_MALLOC)
    assert harness.peak_rss_bytes() - result["rss_peak"] > 500 * 2**20, (harness.peak_rss_bytes(), result)
    del ballast
