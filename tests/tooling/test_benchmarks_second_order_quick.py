"""The second-order benchmark runs end to end in its smallest setting: the MLP at width
16 and batch 4, DiagGGNExact only (a plain step, a process timing jacmem and BackPACK
alternately, and one memory process per library); it writes its block, and only it."""

import re

import pytest

from benchmarks.second_order import main

pytestmark = pytest.mark.slow  # whole benchmark processes: `make test-slow`


def test_quick_second_order_block(tmp_path, capsys):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# report\n\n<!-- secondorder:start -->\nstale\n<!-- secondorder:end -->\n\nkept\n")
    main(["--quick", "--models", "mlp", "--only", r"^mlp (plain -|\w+ DiagGGNExact)$", "--markdown", str(md)])
    err = capsys.readouterr().err
    assert re.search(r"\[2/4\] mlp pair DiagGGNExact: jacmem [\d.]+ s, BackPACK [\d.]+ s, paired ratio [\d.]+", err), (
        err
    )
    assert re.search(r"\[3/4\] mlp jacmem DiagGGNExact: [\d.]+ s, -?\d+ MB", err), err
    text = md.read_text()
    assert text.startswith("# report\n") and text.rstrip().endswith("kept") and "stale" not in text
    assert "error" not in text
    assert "**MLP 784-16-16-10, ReLU, cross-entropy, batch 4** (plain forward+backward: " in text
    row = r"\| DiagGGNExact \| [\d.]+ \| [\d.]+ \| [\d.]+ \| -?\d+ \| -?\d+ \| (-?[\d.]+|n/a) \|"
    assert re.search(row, text), text
    assert "| KFAC | n/a | n/a | n/a | n/a | n/a | n/a |" in text  # not run: said so


def test_quick_language_model_rows(tmp_path, capsys):
    """GPT-2 on its own shifted LM loss (quick: vocabulary 500): jacmem's row with its time
    over a plain step's, a peer's failure and a case not run are each said so."""
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("<!-- secondorder:start -->\n<!-- secondorder:end -->\n")
    main(
        [
            "--quick",
            "--models",
            "gpt2",
            "--only",
            r"^gpt2 (plain -|jacmem DiagGGNMC|asdl DiagGGNMC)$",
            "--markdown",
            str(md),
        ]
    )
    text = md.read_text()
    assert "**HF GPT2LMHeadModel (random init, eval), tied `lm_head`/`wte` (the default): " in text, text
    assert re.search(
        r"\| DiagGGNMC \| [\d.]+ \| -?\d+ \| n/a \| n/a \| fails: [^|]+ \|  \| [\d.]+ \| n/a \| n/a \|", text
    ), text
