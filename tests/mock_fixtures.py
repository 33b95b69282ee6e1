"""Fixtures for the mock ComfyUI (``tests/mockcomfy``) and the fakes.

Importing this module puts ``tests/mockcomfy`` first on ``sys.path`` so
``import comfy.model_management`` finds the mock. Use the fixtures either
from ``tests/conftest.py`` (``pytest_plugins = ["mock_fixtures"]``) or by
importing them into a test module.

- ``mm``: the mock ``comfy.model_management``, freshly reset (one 24 GiB
  card ``cuda:0``, Linux semantics), reset again afterwards;
- ``sim``: its simulated machine (``mm.sim``);
- ``pool``: a fresh ``impl.Pool`` (Linux: ``process_local=False``, floor 0)
  so no test shares the default pool.  Test modules that want this one
  rather than conftest's import it (``from mock_fixtures import pool``).

``impl`` comes from ``tests/conftest.py``.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

MOCK_ROOT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "mockcomfy"
)
if MOCK_ROOT not in sys.path:
    sys.path.insert(0, MOCK_ROOT)

import comfy.controlnet as mock_controlnet  # noqa: E402
import comfy.model_management as _mm  # noqa: E402
import comfy.multigpu as mock_multigpu  # noqa: E402

#: the mock modules, for code that must not depend on import order
mock_mm = _mm
__all__ = ["mm", "mock_controlnet", "mock_mm", "mock_multigpu"]
__all__ += ["pool", "sim"]

@pytest.fixture
def mm():
    _mm.reset()
    yield _mm
    # finalizers of this test's entries must not reach the next test's list
    _mm.reset()
    gc.collect()


@pytest.fixture
def sim(mm):
    return mm.sim


@pytest.fixture
def pool(impl):
    p = impl.Pool(floor=0, process_local=False)
    yield p
    p.boundary()
