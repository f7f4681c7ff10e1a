"""Run laplace-torch's own test suite twice, side by side, with its curvlinops backends and with jacmem's
swapped in (the plugin ``tests/support/laplace_swap.py``), and compare the outcomes.

laplace-torch's tests ship in neither its wheel nor its sdist, so they come from a clone
of its repository, whose path is the argument::

    git clone https://github.com/aleximmer/Laplace laplace-src
    python tools/laplace_suite.py laplace-src [-k "curvlinops or Curvlinops or Jacmem"] [--jacmem-only]

The clone's ``tests/`` folder is copied into a temporary folder and run there, so that the
installed laplace-torch is the one tested (not the clone's ``laplace/`` package). Tests
that need ``pytest-mock`` are skipped where it is not installed. The report lists the
tests that pass with curvlinops and fail with jacmem, and the counts of both runs. A
parametrization by backend shows ``JacmemGGN`` in the swapped run's ids, hence
``Jacmem`` beside ``Curvlinops`` in a ``-k`` selection.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def outcomes(junit: Path) -> dict[str, str]:
    """{``file::test``: "passed", "failed" or "skipped"} from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname").replace(".", "/") + ".py"
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        result[f"{path}::{case.get('name')}"] = outcome
    return result


def _stock_id(node: str) -> str:
    """The curvlinops run's id of a swapped test: a parametrization shows the backend's name."""
    return node.replace("JacmemGGN", "CurvlinopsGGN").replace("JacmemEF", "CurvlinopsEF")


def start(folder: Path, swap: bool, pytest_args: list[str]) -> tuple[subprocess.Popen, Path]:
    """laplace's tests in ``folder``, with jacmem's backends where ``swap``: the pytest
    process and its JUnit XML."""
    junit = folder / f"junit-{'jacmem' if swap else 'curvlinops'}.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")])}
    plugins = ["-p", "laplace_swap"] if swap else []
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, "-o", "junit_family=xunit1",
        f"--junitxml={junit}", "tests", *pytest_args,
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, cwd=folder, stdout=subprocess.DEVNULL), junit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("clone", type=Path, help="a clone of laplace-torch's repository")
    parser.add_argument("--jacmem-only", action="store_true", help="run only the swapped suite")
    args, pytest_args = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copytree(args.clone / "tests", folder / "tests")
        runs = [start(folder, swap, pytest_args) for swap in (True, False)[: 1 if args.jacmem_only else 2]]
        for process, _ in runs:  # both at once
            process.wait()
        jacmem, stock = [outcomes(junit) for _, junit in runs] + [{}] * args.jacmem_only
    for name, result in (("curvlinops", stock), ("jacmem", jacmem)):
        if result:
            counts = {k: sum(v == k for v in result.values()) for k in ("passed", "failed", "skipped")}
            print(f"{name}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if stock:
        lost = sorted(t for t, v in jacmem.items() if v == "failed" and stock.get(_stock_id(t)) == "passed")
        print(f"pass with curvlinops, fail with jacmem ({len(lost)}):", *lost, sep="\n  ")


if __name__ == "__main__":
    main()
