"""The FSDP2 benchmark's table (its processes take a minute even in quick mode, so the
suite checks the table alone; ``python -m benchmarks.fsdp --quick`` runs them): each
setting a row with medians and ranges, the ratio to one process's private step, and a
setting that failed a row that says so."""

from types import SimpleNamespace

from benchmarks import fsdp


def test_rows_ratios_and_a_failure():
    args = SimpleNamespace(quick=True, started="now", load_before="0 0 0", repeats=2, note="")
    one = dict(label="one process, 1 thread", ranks=1, threads=1, plain=[0.01, 0.03], private=[0.02, 0.04], ratio=2.0)
    sharded = dict(one, label="FSDP2, 2 ranks × 1 thread", ranks=2, private=[0.03, 0.05], ratio=1.5)
    failed = dict(one, label="DDP, 2 ranks × 1 thread", ranks=2, error="exit 1: gloo")
    lines = fsdp.table([one, failed, sharded], args)
    assert lines[0] == fsdp.START and lines[-1] == fsdp.END
    assert "| one process, 1 thread | 30 (20–40) | 20 (10–30) | 2.00 | 1.00 |" in lines
    assert "| DDP, 2 ranks × 1 thread | fails: exit 1: gloo | | | |" in lines
    assert "| FSDP2, 2 ranks × 1 thread | 40 (30–50) | 20 (10–30) | 1.50 | 1.33 |" in lines
