"""Every attribute name the stand-in looks up on a caller's object, on the
pool, on the package and on ``logging`` is an interned str.

Why it matters: the type attribute cache of Python 3.10 and 3.11 keeps a
reference to each name it caches (up to 4096 entries).  A name made fresh
on each call (``PyObject_GetAttrString``, ``PyObject_CallMethod``, a
``str.split``) stays alive there until its slot is reused: heap churn on
every eviction call, and what made the leak check (tests/test_leaks.py)
fail in CI at 25-36 B per iteration.

Each spy below records the names it is asked for that are not the interned
copy; ``sys.intern(name) is name`` is False for a fresh copy of a name some
code already interned (every name here is an identifier in Python source).
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import comfy_standin
import pytest

FRESH: list[str] = []


def _note(name: str) -> None:
    if type(name) is str and sys.intern(name) is not name:
        FRESH.append(name)


class Spy:
    """Mixin: records fresh attribute names."""

    def __getattribute__(self, name: str) -> Any:
        _note(name)
        return super().__getattribute__(name)


class SpyModule(types.ModuleType):
    def __getattribute__(self, name: str) -> Any:
        _note(name)
        return super().__getattribute__(name)


class SpyLogger(logging.Logger):
    def __getattribute__(self, name: str) -> Any:
        _note(name)
        return super().__getattribute__(name)


class Worker(Spy):
    def __init__(self) -> None:
        self.alive = True
        self.reply: Any = {"freed": 10}

    def __repr__(self) -> str:
        return "<Worker>"

    def send_command(self, command: str, **kwargs: Any) -> Any:
        return self.reply

    def is_alive(self) -> bool:
        return self.alive


@pytest.fixture
def spied(monkeypatch):
    """The logging module, the comfy_standin logger and the package, each
    with a spying class for the test's duration."""
    FRESH.clear()
    logger = logging.getLogger("comfy_standin")
    package = comfy_standin
    monkeypatch.setattr(logging, "__class__", SpyModule)
    monkeypatch.setattr(logger, "__class__", SpyLogger)
    monkeypatch.setattr(package, "__class__", SpyModule)
    yield FRESH
    FRESH.clear()


def spy_pool(impl):
    class SpyPool(Spy, impl.Pool):
        pass

    return SpyPool(process_local=True)


def test_the_spy_sees_a_fresh_name(spied):
    # The check itself can fail: a name made at run time is recorded.
    w = Worker()
    getattr(w, "".join(["is_", "alive"]))
    assert spied == ["is_alive"]


def test_eviction_paths_look_up_interned_names(impl, spied, caplog):
    pool = spy_pool(impl)
    w = Worker()
    s = impl.StandIn(w, 1, "unet", 10_000, "cuda:0", "cpu", pool=pool)
    impl.apply_echo(s, 500, seq=1)
    shortfalls = []
    pool.on_pressure = shortfalls.append
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        # bad arguments: a warning on the comfy_standin logger
        assert s.partially_unload("cpu", 1, False, 4, 5) == 0
        # a reply short of the ask: the pool's on_pressure hears of it
        assert s.partially_unload("cpu", 100) == 10
        # the worker dies: pool.worker_gone, and a warning
        w.alive = False
        w.reply = {}
        s.partially_unload("cpu", 100)
    assert shortfalls == [90]
    assert any("is gone" in m for m in caplog.messages)
    assert any("bad arguments" in m for m in caplog.messages)
    assert spied == []


def test_the_default_pool_is_found_by_an_interned_name(impl, spied):
    s = impl.StandIn(Worker(), 1, "unet", 10_000, "cuda:0", "cpu")
    assert s.partially_unload("cpu", 1) >= 0
    assert spied == []


def test_the_pid_lookup_uses_interned_names(impl, spied):
    pool = spy_pool(impl)

    class Process(Spy):
        pid = 4242

    class PidWorker(Worker):
        def __init__(self) -> None:
            super().__init__()
            self._process = Process()

    w = PidWorker()
    impl.StandIn(w, 1, "unet", 10_000, "cuda:0", "cpu", pool=pool)
    pool.update_readings({"devices": [{"processes": {4242: 7}}]})
    assert spied == []
