"""Shared fixtures: every test runs against both implementations.

``impl`` is the implementation module under test:

- ``"c"``: ``comfy_standin`` (the C type from ``comfy_standin._core``).
- ``"reference"``: ``comfy_standin._reference`` (pure Python).

Both expose StandIn, StandInModule, Ledger, apply_echo, apply_residency,
register, EchoError, WorkerGoneError, Pool and default_pool.

Markers (registered in pyproject.toml) say what a test needs beyond the
``test-core`` extra.  A test marked ``comfy_env`` needs comfy-env from
PyPI (the ``test-comfy-env`` extra): where it is missing the test FAILS
with a line saying so, it is never skipped; ``-m "not comfy_env"``
deselects those tests, and every other test file imports and runs
without comfy-env.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

# The mock comfy.model_management (tests/mockcomfy) and its fixtures.
pytest_plugins = ["mock_fixtures"]

IMPLEMENTATIONS = ("c", "reference")

#: What a test marked ``comfy_env`` is told when comfy-env is missing.
COMFY_ENV_MISSING = (
    "comfy-env is not installed ({error}): this test is marked comfy_env "
    "and needs it.  Install the test extras (python -m pip install "
    "'.[test]'), or leave these tests out with -m \"not comfy_env\"."
)


def comfy_env_version() -> str:
    """The installed comfy-env's version; fails the calling test (never
    skips it) with COMFY_ENV_MISSING when comfy-env cannot be imported."""
    try:
        importlib.import_module("comfy_env")
        return importlib.metadata.version("comfy-env")
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        pytest.fail(COMFY_ENV_MISSING.format(error=exc), pytrace=False)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A missing dependency is a failure of the test that needs it, said
    # before its fixtures import anything.
    if item.get_closest_marker("comfy_env") is not None:
        comfy_env_version()


@pytest.fixture
def comfy_env_installed_version() -> str:
    """comfy-env's version (the test fails when comfy-env is missing)."""
    return comfy_env_version()


def _c_implementation() -> ModuleType:
    """The C implementation; a build without its stand-in type fails."""
    core = importlib.import_module("comfy_standin._core")
    assert hasattr(core, "StandIn"), "comfy_standin._core has no StandIn"
    return importlib.import_module("comfy_standin")


def load_implementation(name: str) -> ModuleType:
    if name == "c":
        return _c_implementation()
    return importlib.import_module("comfy_standin._reference")


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The implementation module under test ("c" or "reference")."""
    return load_implementation(request.param)


@pytest.fixture
def both_impls() -> tuple[ModuleType, ModuleType]:
    """(C implementation, reference) for differential tests."""
    return _c_implementation(), load_implementation("reference")


class StubWorker:
    """The least a worker must be: alive, answers every command with an
    empty dict, and records what it was sent."""

    def __init__(self, name: str = "worker") -> None:
        self.name = name
        self.alive = True
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __repr__(self) -> str:
        return f"<StubWorker {self.name}>"

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((command, kwargs))
        return {}

    def is_alive(self) -> bool:
        return self.alive


@pytest.fixture
def make_worker() -> Callable[..., StubWorker]:
    """Factory of fresh ``StubWorker`` objects."""
    counter = itertools.count()

    def make(name: str | None = None) -> StubWorker:
        return StubWorker(name or f"worker-{next(counter)}")

    return make


@pytest.fixture
def pool(impl: ModuleType) -> Any:
    """A fresh pool of `impl`, process-local so the reserve is computed."""
    return impl.Pool(process_local=True)


@pytest.fixture
def make_standin(
    impl: ModuleType, pool: Any, make_worker: Callable[..., StubWorker]
) -> Callable[..., Any]:
    """Factory of stand-ins of `impl` over the `pool` fixture.

    ``make_standin(worker=None, generation=1, model_id=None, size=1000,
    **kw)``; a new StubWorker and a fresh id when not given."""
    ids = itertools.count()

    def make(
        worker: Any = None,
        generation: int = 1,
        model_id: str | None = None,
        size: int = 1000,
        **kwargs: Any,
    ) -> Any:
        kwargs.setdefault("pool", pool)
        return impl.StandIn(
            worker=worker if worker is not None else make_worker(),
            worker_generation=generation,
            model_id=model_id or f"model-{next(ids)}",
            model_size=size,
            load_device="cuda:0",
            offload_device="cpu",
            **kwargs,
        )

    return make
