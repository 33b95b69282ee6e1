"""Shared fixtures: every test runs against both implementations.

``impl`` is the implementation module under test:

- ``"c"``: ``comfy_standin`` (the C type from ``comfy_standin._core``).
- ``"reference"``: ``comfy_standin._reference`` (pure Python).

Both expose StandIn, Ledger, apply_echo, apply_residency, register,
EchoError, WorkerGoneError, Pool and default_pool.

Markers (registered in pyproject.toml) say what a test needs beyond the
``test-core`` extra.  A test marked ``comfy_env`` needs comfy-env from
PyPI (the ``test-comfy-env`` extra): where it is missing the test FAILS
with a line saying so, it is never skipped; ``-m "not comfy_env"``
deselects those tests, and every other test file imports and runs
without comfy-env.  A test marked ``comfyui`` (deselected unless asked
for with ``-m comfyui``) needs a ComfyUI tree named by
``COMFY_STANDIN_COMFYUI``: unset, the test fails saying so.

A fixture that runs something whose log explains a failure (ComfyUI's
own) appends ``(title, read)`` to ``request.node.logs_on_failure``; a
failed test's report then carries each log as a section of its own.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

# The mock comfy.model_management (tests/mockcomfy) and its fixtures; the
# stress modes (--stress=gc|threads, tests/stress.py).
pytest_plugins = ["mock_fixtures", "stress"]

IMPLEMENTATIONS = ("c", "reference")

#: What a test marked ``comfy_env`` is told when comfy-env is missing.
COMFY_ENV_MISSING = (
    "comfy-env is not installed ({error}): this test is marked comfy_env "
    "and needs it.  Install the test extras (python -m pip install "
    "'.[test]'), or leave these tests out with -m \"not comfy_env\"."
)


#: What a test marked ``comfyui`` is told when no ComfyUI tree is named.
COMFYUI_MISSING = (
    "COMFY_STANDIN_COMFYUI is not set: this test is marked comfyui and "
    "starts ComfyUI's own main.py.  Set it to a ComfyUI folder (it is "
    "copied, never written: COMFY_STANDIN_COMFYUI=/path/to/ComfyUI) and "
    "run pytest with the Python that runs that ComfyUI (with comfy-env "
    "and comfy-standin installed), or name that Python in "
    "COMFY_STANDIN_COMFYUI_PYTHON; or leave these tests out (they are, "
    "unless -m comfyui asks for them)."
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
    if (item.get_closest_marker("comfyui") is not None
            and not os.environ.get("COMFY_STANDIN_COMFYUI")):
        pytest.fail(COMFYUI_MISSING, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, read in getattr(item, "logs_on_failure", ()):
            try:
                text = read()
            except Exception as exc:  # noqa: BLE001 - said in its place
                text = f"(could not be read: {exc!r})"
            report.sections.append((title, text))


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
