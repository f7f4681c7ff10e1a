"""BENCHMARKS.md stays a summary a reader takes in at once (at most 250 lines); the long
tables live under benchmarks/details/, and every details file it links exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_md_is_a_summary_whose_links_resolve():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\((benchmarks/details/[\w.-]+\.md)\)", text)
    assert links, "BENCHMARKS.md links no details file"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing
