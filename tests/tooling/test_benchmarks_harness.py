"""The harness's shared pieces that every timed benchmark (lm, dp, attribution) uses: the
paired timing loop, a failed case's cell, and the rows of a timed table."""

from benchmarks import harness


def test_paired_steps_alternate_plain_and_step():
    """Each step is timed right after a plain one; at least ``repeats`` pairs, more within
    ``seconds`` (at most ten times as many); no plain step: times alone."""
    calls = []
    times, ratios = harness.paired_steps(lambda: calls.append("step"), lambda: calls.append("plain"), 3)
    assert calls == ["plain", "step"] * 3 and len(times) == len(ratios) == 3
    times, ratios = harness.paired_steps(lambda: None, None, 2, seconds=60.0)
    assert len(times) == 20 and ratios == []


def test_a_failure_cell_says_fails_unless_the_case_declined():
    assert harness.failure(dict(error="ValueError: a | b")) == "fails: a / b"
    assert harness.failure(dict(error="skipped: 7 GiB"), declined=("skipped",)) == "skipped: 7 GiB"
    assert harness.failure(dict(error="RuntimeError: not run: big"), declined=("not run",)) == "not run: big"
    assert harness.failure(dict(error="RuntimeError: not run: big")) == "fails: not run: big"


def test_timed_rows_give_plain_method_and_failure_rows():
    results = [
        dict(model="m", method="plain", paired=False, peak_bytes=100 * 2**20),
        dict(model="m", method="a", paired=True, time_s=0.02, ratios=[1.5, 1.1, 1.2]),
        dict(model="m", method="a", paired=False, peak_bytes=150 * 2**20),
        dict(model="m", method="b", paired=True, time_s=0.01, ratios=[1.0]),
        dict(model="m", method="c", paired=True, error="ValueError: no"),
    ]
    seen = []

    def extra(model, method, ratio, peak):
        seen.append((method, ratio, peak))
        return ["x"]

    rows = harness.timed_rows(
        results, ["m"], ["a", "b", "c", "d"], dict(a="A", b="B", c="C"), "plain", (1, extra), harness.failure
    )
    assert rows == [
        "| m | plain | | 1 | 100 | 1 | |",
        "| m | A | 20 | 1.20 (1.10–1.50) | 150 | 1.50 | x |",
        "| m | B | 10 | 1.00 (1.00–1.00) | n/a | n/a | x |",
        "| m | C | fails: no | | | | |",
    ]
    assert seen == [("a", 1.2, 1.5), ("b", 1.0, None)]
