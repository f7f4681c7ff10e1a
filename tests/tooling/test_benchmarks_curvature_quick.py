"""The curvature benchmark on real architectures (issue 16) runs end to end in its
smallest setting: the tiny HF BERT classifier, DiagGGNExact from jacmem and from
laplace-torch's curvlinops backend, each in a process of its own, beside a plain step.
A library that cannot do a case shows "fails: <reason>" in its cells, never a number."""

import re

import pytest

from benchmarks.second_order import main

pytestmark = pytest.mark.slow  # whole benchmark processes: `make test-slow`


pytest.importorskip("laplace")
pytest.importorskip("transformers")

TIME_MB = r"[\d.]+ \| -?\d+"  # seconds | MB


@pytest.mark.heavy
def test_quick_curvature_block(tmp_path, capsys):
    md = tmp_path / "BENCHMARKS.md"
    main(
        [
            "--quick",
            "--models",
            "bert",
            "--only",
            r"^bert (plain -|(jacmem|curvlinops) DiagGGNExact)$",
            "--markdown",
            str(md),
        ]
    )
    err = capsys.readouterr().err
    assert re.search(r"\[1/3\] bert plain -: [\d.]+ s, -?\d+ MB", err), err
    assert re.search(r"\[2/3\] bert jacmem DiagGGNExact: ([\d.]+ s, -?\d+ MB|\w+Error: .+)", err), err
    assert re.search(r"\[3/3\] bert curvlinops DiagGGNExact: [\d.]+ s, -?\d+ MB", err), err
    text = md.read_text()
    assert "**HF BertForSequenceClassification (random init, eval): 2 layers, d=16," in text
    header = (
        "| extension | jacmem s | jacmem MB | BackPACK s | BackPACK MB | laplace curvlinops s | laplace curvlinops MB "
        "| laplace ASDL s | laplace ASDL MB | jacmem × plain | jacmem / BackPACK time | jacmem / laplace curvlinops time "
        "| jacmem / laplace ASDL time |"
    )
    assert header in text, text
    jacmem = rf"({TIME_MB}|fails: [^|]+ \| )"
    ratio = r"([\d.]+|n/a)"  # n/a where jacmem fails
    row = (
        rf"\| DiagGGNExact \| {jacmem} \| n/a \| n/a \| {TIME_MB} \| n/a \| n/a \| {ratio} \| n/a \| {ratio} \| n/a \|"
    )
    assert re.search(row, text), text
    assert (
        "| KFAC | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |" in text
    )  # not run: said so
