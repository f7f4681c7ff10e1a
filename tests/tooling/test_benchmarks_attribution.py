"""The attribution benchmark (issue 38): its LDS is the Spearman correlation that scipy
computes, with the sign that makes helpful scores predict lower losses; its tables say what
failed; and, in its smallest setting, it runs end to end in processes of its own."""

import re
from types import SimpleNamespace

import pytest
import torch

from benchmarks import attribution


def test_spearman_is_scipys():
    stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(30, 4, generator=gen, dtype=torch.float64),
        torch.randn(30, 4, generator=gen, dtype=torch.float64),
    )
    b[:, 1] = a[:, 1] ** 3 + 0.1 * b[:, 1]  # one column strongly rank-correlated
    ours = attribution.spearman(a, b)
    theirs = torch.tensor([stats.spearmanr(a[:, j].numpy(), b[:, j].numpy()).statistic for j in range(4)])
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-12, atol=1e-12)


def test_lds_reads_a_positive_score_as_a_lower_loss():
    """Losses that fall exactly with the summed scores of a half give an LDS of 1; the
    scores negated give -1 (a sign error cannot pass)."""
    gen = torch.Generator().manual_seed(1)
    n, q, m = 20, 3, 16
    scores = torch.randn(q, n, generator=gen, dtype=torch.float64)
    masks = torch.rand(m, n, generator=gen) < 0.5
    losses = 2.0 - masks.double() @ scores.T  # [M, q]: a helpful example lowers the loss
    assert attribution.lds(scores, masks, losses) == pytest.approx(1.0)
    assert attribution.lds(-scores, masks, losses) == pytest.approx(-1.0)


def _args(**extra):
    return SimpleNamespace(
        quick=True, started="now", machine="cpu", threads=1, repeats=1, task=attribution.QUICK_TASK,
        dampings=[1e-3, 1e-1], lds_methods=list(attribution.LDS_METHODS), speed_models=["gpt2"],
        speed_methods=list(attribution.SPEED_METHODS), dim=256, note="", **extra,
    )  # fmt: skip


def test_tables_give_best_damping_ratio_and_failures():
    results = [
        dict(method="jacmem:ekfac", lds=[(None, 0.4), (1e-3, 0.5), (1e-1, float("nan"))], seconds_per_damping=0.1),
        dict(method="jacmem:ekfac:proj256", lds=[(None, 0.3), (1e-3, 0.2), (1e-1, 0.35)], seconds_per_damping=0.1),
        dict(method="kronfluence:ekfac", error="ModuleNotFoundError: No module named 'kronfluence'"),
    ]
    lines = attribution.lds_table(results, dict(query_accuracy=0.9), _args())
    assert "| jacmem EK-FAC | 0.500 | 0.001 | 0.400 | 1.00 | 0.10 |" in lines
    assert "| jacmem EK-FAC, Kronecker-projected to 256 | 0.350 | 0.1 | 0.300 | 0.70 | 0.10 |" in lines
    assert "| kronfluence 1.0.1 EK-FAC | fails: No module named 'kronfluence' | | | | |" in lines
    speed = [
        dict(model="gpt2", method="plain", paired=False, peak_bytes=100 * 2**20),
        dict(model="gpt2", method="jacmem:proj256", paired=True, time_s=0.5, ratios=[1.1, 1.2, 1.4]),
        dict(model="gpt2", method="jacmem:proj256", paired=False, peak_bytes=130 * 2**20),
        dict(model="gpt2", method="kronfluence:covariance", paired=True, error="RuntimeError: not run: too big"),
    ]
    lines = attribution.speed_table(speed, _args())
    assert attribution.speed_summary(speed, _args())[0].endswith("gpt2 1.20× in time, 1.30× in peak.")
    assert "| gpt2 | jacmem `BatchGradProjection(256)`, Kronecker | 500 | 1.20 (1.10–1.40) | 130 | 1.30 | no |" in lines
    assert "| gpt2 | kronfluence 1.0.1 covariance pass (`nn.Linear` parts) | not run: too big | | | | |" in lines


@pytest.mark.slow  # whole benchmark processes: `make test-slow`
def test_quick_attribution_end_to_end(tmp_path, capsys):
    md, details = tmp_path / "BENCHMARKS.md", tmp_path / "attribution.md"
    md.write_text(
        "# report\n\n<!-- attribution-lds:start -->\nstale\n<!-- attribution-lds:end -->\n"
        "<!-- attribution-speed:start -->\nstale\n<!-- attribution-speed:end -->\n\nkept\n"
    )
    attribution.main(
        [
            "--quick", "--threads", "1", "--lds-methods", "jacmem:ekfac", "jacmem:identity",
            "--speed-models", "llama-lora", "--speed-methods", "jacmem:proj256",
            "--markdown", str(md), "--details", str(details),
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert re.search(r"\[lds\] jacmem:ekfac: LDS -?[\d.]+ at damping", err), err
    assert re.search(r"\[speed\] llama-lora jacmem:proj256 paired: \d+ ms, [\d.]+x plain", err), err
    text = md.read_text()
    assert text.startswith("# report\n") and text.rstrip().endswith("kept") and "stale" not in text
    assert re.search(r"\*\*LDS\*\* at each method's best damping .*: jacmem EK-FAC -?[\d.]+; jacmem identity", text)
    assert re.search(r"llama-lora [\d.]+× in time, [\d.]+× in peak\.", text), text
    tables = details.read_text()
    assert re.search(r"\| jacmem EK-FAC \| -?[\d.]+ \| (default|[\d.e+-]+) \| -?[\d.]+ \| 1.00 \| [\d.]+ \|", tables)
    assert re.search(r"\| llama-lora \| jacmem `BatchGradProjection\(256\)`, Kronecker \| \d+ \| [\d.]+ \(", tables)
    assert "fails" not in tables
