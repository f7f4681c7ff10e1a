"""A pytest plugin that runs Opacus's own tests against jacmem: ``-p tests.support.opacus_swap``.

It swaps the import, nothing else: ``opacus.PrivacyEngine`` (and
``opacus.privacy_engine.PrivacyEngine``, where a test module may import it from) is
:class:`jacmem.privacy.PrivacyEngine` from before the first test module is imported, as
if each test had been written ``from jacmem.privacy import PrivacyEngine``.

``--hypothesis-profile=opacus-swap-quick`` draws 5 examples per property test (Opacus's
draw the default 100): the same tests, fewer draws, for the time of ``make test``.

Each engine a test made is detached when the test ends, so that one test's private
model does not stay open into the next: the count is per test, as with Opacus, whose
engines leave nothing behind in the process.
"""

from __future__ import annotations

import opacus
import opacus.privacy_engine
import pytest
from hypothesis import settings

from jacmem import privacy

settings.register_profile("opacus-swap-quick", max_examples=5)

_ENGINES: list[privacy.PrivacyEngine] = []


class PrivacyEngine(privacy.PrivacyEngine):
    """jacmem's engine, each instance remembered so that the test's end can detach it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _ENGINES.append(self)


def pytest_configure(config: pytest.Config) -> None:
    opacus.PrivacyEngine = PrivacyEngine
    opacus.privacy_engine.PrivacyEngine = PrivacyEngine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield
    while _ENGINES:
        _ENGINES.pop().detach()
