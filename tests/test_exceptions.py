"""Exceptions on the command paths (docs/semantics.md "Exceptions on the
command paths" and "Log lines"): only Exception is swallowed, and logged
with its type and message, the same lines in both implementations;
KeyboardInterrupt, SystemExit, GeneratorExit and any other BaseException
propagate from every method."""

from __future__ import annotations

import contextlib
import functools

import logging
from typing import Any

import pytest

SIZE = 10_000
BASE_EXCEPTIONS = [KeyboardInterrupt, SystemExit, GeneratorExit]


class Worker:
    """A worker whose send_command and is_alive do what the test says."""

    def __init__(self) -> None:
        self.alive: Any = True
        self.send_raises: BaseException | None = None
        self.die_on_send = False
        self.reply: Any = {}
        self.calls: list[str] = []

    def __repr__(self) -> str:
        return "<Worker>"

    def send_command(self, command: str, **kwargs: Any) -> Any:
        self.calls.append(command)
        if self.die_on_send:
            self.alive = False
            raise ConnectionResetError("worker pipe closed")
        if self.send_raises is not None:
            raise self.send_raises
        return self.reply

    def is_alive(self) -> bool:
        if isinstance(self.alive, BaseException):
            raise self.alive
        return self.alive


@pytest.fixture
def worker() -> Worker:
    return Worker()


@pytest.fixture
def s(impl, pool, worker):
    standin = impl.StandIn(worker, 1, "unet", SIZE, "cuda:0", "cpu",
                           pool=pool)
    impl.apply_echo(standin, 500, seq=3)
    return standin


def state(s) -> tuple[Any, ...]:
    loaded, seq, _, source = s.receipt()
    return loaded, seq, source, s.eviction_deferred, s.stale, s.bad_replies


def evict(s, method: str) -> Any:
    if method == "partially_unload":
        return s.partially_unload("cpu", 100)
    if method == "detach":
        return s.detach()
    return s.partially_load("cuda:0", 100)


METHODS = ["partially_unload", "detach", "partially_load"]


# ---- BaseException propagates ---------------------------------------------


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
@pytest.mark.parametrize("method", METHODS)
def test_base_exception_from_send_propagates_and_changes_nothing(
    impl, pool, s, worker, method, exc
):
    pressure: list[int] = []
    pool.on_pressure = pressure.append
    before = state(s)
    worker.send_raises = exc("stop")
    with pytest.raises(exc):
        evict(s, method)
    # No answer came: the receipt, the deferred flag and the counters are
    # as they were, nobody was told of pressure.
    assert state(s) == before
    assert pressure == []


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
@pytest.mark.parametrize("method", METHODS)
def test_base_exception_from_is_alive_propagates(
    impl, s, worker, method, exc
):
    before = state(s)
    worker.alive = exc("stop")
    with pytest.raises(exc):
        evict(s, method)
    assert state(s) == before
    assert worker.calls == []


@pytest.mark.parametrize("method", ["partially_unload", "detach"])
def test_base_exception_from_is_alive_after_a_failed_send(
    impl, s, worker, method
):
    class Flaky(Worker):
        def is_alive(self) -> bool:
            if self.calls:
                raise KeyboardInterrupt
            return True

    flaky = Flaky()
    flaky.send_raises = TimeoutError("worker busy")
    t = impl.StandIn(flaky, 1, "vae", SIZE, "cuda:0", "cpu", pool=s.pool)
    impl.apply_echo(t, 700)
    with pytest.raises(KeyboardInterrupt):
        evict(t, method)
    assert t.loaded_size() == 700
    assert not t.eviction_deferred


def test_base_exception_from_on_pressure_propagates(impl, pool, s, worker):
    def pressure(shortfall: int) -> None:
        raise KeyboardInterrupt

    pool.on_pressure = pressure
    worker.reply = {"freed": 10}
    with pytest.raises(KeyboardInterrupt):
        s.partially_unload("cpu", 100)
    assert s.loaded_size() == 490  # the good reply was applied first


def test_exception_from_on_pressure_is_logged(impl, pool, s, worker, caplog):
    def pressure(shortfall: int) -> None:
        raise RuntimeError("no siblings")

    pool.on_pressure = pressure
    worker.reply = {"freed": 10}
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        assert s.partially_unload("cpu", 100) == 10
    assert caplog.messages == [
        "comfy_standin: on_pressure(90) raised RuntimeError: no siblings "
        "(ignored)"
    ]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_pool_worker_gone_raising(impl, pool, s, worker, exc, caplog):
    def gone(w: Any) -> None:
        raise exc("pool broke")

    pool.worker_gone = gone
    worker.alive = False
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        if exc is RuntimeError:
            assert s.partially_unload("cpu", 100) == 500
        else:
            with pytest.raises(exc):
                s.partially_unload("cpu", 100)
    # The receipts are zeroed whatever the pool did.
    assert s.stale and s.loaded_size() == 0
    assert s.partially_unload("cpu", 100) == 0
    if exc is RuntimeError:
        assert caplog.messages == [
            "comfy_standin: the worker of model 'unet' is gone",
            "comfy_standin: pool.worker_gone() for model 'unet' raised "
            "RuntimeError: pool broke; receipts zeroed anyway",
        ]


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
def test_amount_whose_float_raises_base_exception(impl, s, worker, exc):
    class Amount:
        def __float__(self) -> float:
            raise exc("stop")

    with pytest.raises(exc):
        s.partially_unload("cpu", Amount())
    with pytest.raises(exc):
        s.partially_load("cuda:0", Amount())
    assert worker.calls == []
    assert s.loaded_size() == 500


def test_amount_whose_float_raises_exception_means_everything(
    impl, s, worker
):
    class Amount:
        def __float__(self) -> float:
            raise RuntimeError("no amount")

    worker.reply = lambda: None
    seen: list[Any] = []

    def send(command: str, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return {"freed": kwargs["bytes_to_free"]}

    worker.send_command = send  # type: ignore[method-assign]
    assert s.partially_unload("cpu", Amount()) == 500
    assert seen == [{"model_id": "unet", "bytes_to_free": 500}]
    assert s.loaded_size() == 0


# ---- is_alive raising an Exception: alive, on every path -------------------


def test_is_alive_raising_exception_in_partially_load_counts_as_alive(
    impl, s, worker, caplog
):
    worker.alive = RuntimeError("probe failed")
    worker.reply = {"loaded": 100, "resident": 600}
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        assert s.partially_load("cuda:0", 100) == 100
    assert s.loaded_size() == 600
    assert caplog.messages == [
        "comfy_standin: is_alive() of the worker of model 'unet' raised "
        "RuntimeError: probe failed; treating it as alive"
    ]


def test_is_alive_raising_after_a_failed_load_send_reraises_the_send(
    impl, s, worker
):
    worker.alive = RuntimeError("probe failed")
    worker.send_raises = TimeoutError("worker busy")
    with pytest.raises(TimeoutError, match="worker busy"):
        s.partially_load("cuda:0", 100)
    assert not s.stale


# ---- WorkerGoneError and its cause ------------------------------------------


class ReprId(str):
    """An id whose repr runs Python: a call made with an exception pending
    would fail (SystemError) or see the pending exception."""

    def __repr__(self) -> str:
        return "ReprId(" + str.__repr__(self) + ")"


def test_worker_gone_error_has_the_transport_error_as_cause(
    impl, pool, worker
):
    s = impl.StandIn(worker, 1, ReprId("m"), SIZE, "cuda:0", "cpu",
                     pool=pool)
    worker.die_on_send = True
    with pytest.raises(impl.WorkerGoneError) as info:
        s.partially_load("cuda:0", 100)
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert str(info.value.__cause__) == "worker pipe closed"
    assert "'m'" in str(info.value)
    assert s.stale


def test_worker_gone_error_without_a_send(impl, pool, worker):
    s = impl.StandIn(worker, 1, ReprId("m"), SIZE, "cuda:0", "cpu",
                     pool=pool)
    worker.alive = False
    with pytest.raises(impl.WorkerGoneError) as info:
        s.partially_load("cuda:0", 100)
    assert info.value.__cause__ is None
    with pytest.raises(impl.WorkerGoneError):
        s.partially_load("cuda:0", 100)  # stale now: no is_alive asked


# ---- a worker whose attributes raise ----------------------------------------


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit,
                                 RuntimeError])
def test_worker_whose_getattr_raises(impl, pool, exc):
    class Hostile:
        def __getattr__(self, name: str) -> Any:
            raise exc(f"no {name}")

    with pytest.raises(exc, match="no send_command"):
        impl.StandIn(Hostile(), 1, "m", SIZE, "cuda:0", "cpu", pool=pool)


def test_worker_lacking_a_method_is_a_type_error(impl, pool):
    class Lacking:
        def send_command(self, *a: Any, **k: Any) -> None:
            return None

    with pytest.raises(TypeError, match="is_alive"):
        impl.StandIn(Lacking(), 1, "m", SIZE, "cuda:0", "cpu", pool=pool)


# ---- arguments -------------------------------------------------------------


def test_partially_unload_without_arguments_frees_everything(
    impl, s, worker
):
    worker.reply = {"freed": 500}
    assert s.partially_unload() == 500
    assert s.loaded_size() == 0


def test_partially_unload_with_comfyui_arguments(impl, s, worker):
    worker.reply = {"freed": 100}
    assert s.partially_unload("cpu", 100, force_patch_weights=False) == 100
    worker.reply = {"freed": 100}
    assert s.partially_unload(device_to="cpu", memory_to_free=100) == 100


@pytest.mark.parametrize("args, kwargs", [
    (("cpu", 100, False, "extra"), {}),
    (("cpu",), {"bogus": 1}),
    (("cpu",), {"device_to": "cpu"}),
])
def test_partially_unload_bad_arguments_free_nothing(
    impl, s, worker, caplog, args, kwargs
):
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        assert s.partially_unload(*args, **kwargs) == 0
    assert worker.calls == []
    assert s.loaded_size() == 500
    [message] = caplog.messages
    assert message.startswith(
        "comfy_standin: partially_unload of model 'unet' called with bad "
        "arguments: TypeError: "
    )
    assert message.endswith("; freed nothing")


@pytest.mark.parametrize("args, kwargs", [
    ((), {}),
    ((True,), {}),
    ((), {"unpatch_all": False}),
    ((), {"unpatch_weights": True}),
    ((1, 2, 3), {"anything": 4}),
])
def test_detach_ignores_its_arguments(impl, s, worker, args, kwargs):
    assert s.detach(*args, **kwargs) is s
    assert s.loaded_size() == 0
    assert worker.calls == ["model_to_device"]


# ---- log lines: the same in both implementations ---------------------------


def logged(caplog, action) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="comfy_standin"):
        action()
    return list(caplog.messages)


def test_log_deferred_unload_names_the_cause(impl, s, worker, caplog):
    worker.send_raises = TimeoutError("worker busy")
    assert logged(caplog, lambda: s.partially_unload("cpu", 100)) == [
        "comfy_standin: model_partial_unload of model 'unet' deferred: "
        "TimeoutError: worker busy"
    ]
    assert s.eviction_deferred


def test_log_deferred_detach_names_the_cause(impl, s, worker, caplog):
    worker.send_raises = TimeoutError()
    assert logged(caplog, s.detach) == [
        "comfy_standin: model_to_device of model 'unet' deferred: "
        "TimeoutError"
    ]


def test_log_bad_reply(impl, s, worker, caplog):
    worker.reply = {"freed": -1}
    lines = logged(caplog, lambda: s.partially_unload("cpu", 100))
    assert len(lines) == 2
    assert lines[0].startswith(
        "comfy_standin: bad reply for model 'unet': EchoError: "
        "reply['freed'] from model_partial_unload"
    )
    assert lines[1].startswith(
        "comfy_standin: model_partial_unload of model 'unet' deferred: "
        "EchoError: reply['freed'] from model_partial_unload"
    )
    assert s.bad_replies == 1


def test_log_bad_load_reply(impl, s, worker, caplog):
    # partially_load raises the EchoError, after the same line as the
    # eviction paths (issue 8 defect 11: C raised it without the line).
    worker.reply = {"loaded": -1}

    def load() -> None:
        with pytest.raises(impl.EchoError):
            s.partially_load("cuda:0", 100)

    lines = logged(caplog, load)
    assert len(lines) == 1
    assert lines[0].startswith(
        "comfy_standin: bad reply for model 'unet': EchoError: "
        "reply['loaded'] from model_partial_load"
    )
    assert s.bad_replies == 1


#: The field each command's reply is read for first.
REPLY_KEY = {
    "partially_unload": "freed",
    "detach": "seq",
    "partially_load": "loaded",
}


def key_raising(name: str, exc: type[BaseException]) -> str:
    """A str-subclass key equal to `name` in hash: looking `name` up in a
    dict holding it runs its __eq__, which raises `exc`."""

    class Key(str):
        def __hash__(self) -> int:
            return str.__hash__(self)

        def __eq__(self, other: object) -> bool:
            raise exc("lookup")

    return Key(name)


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
@pytest.mark.parametrize("method", METHODS)
def test_base_exception_from_the_reply_lookup_changes_nothing(
    impl, s, worker, caplog, method, exc
):
    # C's partially_load counted a bad reply for a KeyboardInterrupt out
    # of the reply lookup; the reference did not.  No reply was read:
    # nothing is counted, logged or written.
    worker.reply = {key_raising(REPLY_KEY[method], exc): 5}
    before = state(s)

    def run() -> None:
        with pytest.raises(exc, match="lookup"):
            evict(s, method)

    assert logged(caplog, run) == []
    assert state(s) == before


@pytest.mark.parametrize("method", METHODS)
def test_exception_from_the_reply_lookup_is_a_bad_reply(
    impl, s, worker, method
):
    worker.reply = {key_raising(REPLY_KEY[method], RuntimeError): 5}
    if method == "partially_load":
        with pytest.raises(
            impl.EchoError, match="looking it up raised"
        ) as info:
            evict(s, method)
        assert isinstance(info.value.__cause__, RuntimeError)
    else:
        evict(s, method)
        assert s.eviction_deferred
    assert s.bad_replies == 1


@pytest.mark.parametrize("method", ["partially_unload", "detach"])
def test_log_worker_gone(impl, s, worker, caplog, method):
    worker.die_on_send = True
    assert logged(caplog, lambda: evict(s, method)) == [
        "comfy_standin: the worker of model 'unet' is gone"
    ]


def test_log_is_alive_raising(impl, s, worker, caplog):
    worker.alive = ValueError("")
    worker.send_raises = TimeoutError("busy")
    assert logged(caplog, lambda: s.partially_unload("cpu", 100)) == [
        "comfy_standin: is_alive() of the worker of model 'unet' raised "
        "ValueError; treating it as alive",
        "comfy_standin: is_alive() of the worker of model 'unet' raised "
        "ValueError; treating it as alive",
        "comfy_standin: model_partial_unload of model 'unet' deferred: "
        "TimeoutError: busy",
    ]


def test_log_cause_whose_str_raises(impl, s, worker, caplog):
    class Odd(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    worker.send_raises = Odd()
    assert logged(caplog, lambda: s.partially_unload("cpu", 100)) == [
        "comfy_standin: model_partial_unload of model 'unet' deferred: "
        "Odd: <str() failed>"
    ]


def test_log_lines_are_identical_across_implementations(both_impls, caplog):
    """One scenario of every line, run on both: the texts must match."""

    def run(impl) -> list[str]:
        pool = impl.Pool(process_local=True)

        def pressure(shortfall: int) -> None:
            raise LookupError("x")

        pool.on_pressure = pressure
        w = Worker()
        s = impl.StandIn(w, 1, "m", SIZE, "cuda:0", "cpu", pool=pool)
        impl.apply_echo(s, 500)
        lines = []
        w.send_raises = TimeoutError("worker busy")
        lines += logged(caplog, lambda: s.partially_unload("cpu", 100))
        lines += logged(caplog, s.detach)
        w.send_raises = None
        w.reply = {"nope": 1}
        lines += logged(caplog, lambda: s.partially_unload("cpu", 100))
        lines += logged(caplog, lambda: s.partially_unload(1, 2, 3, 4))
        w.alive = RuntimeError("probe")
        w.reply = {"freed": 1}
        lines += logged(caplog, lambda: s.partially_unload("cpu", 100))
        w.alive = False
        lines += logged(caplog, lambda: s.partially_unload("cpu", 100))
        return lines

    def comparable(line: str) -> str:
        # The texts of EchoError and of Python's own argument TypeError are
        # each implementation's; the line around them must match.
        for cut in ("EchoError: ", "TypeError: "):
            if cut in line:
                head, _, tail = line.partition(cut)
                return head + cut + "..." + tail[tail.rfind(";"):] * (
                    ";" in tail
                )
        return line

    c, reference = both_impls
    c_lines = [comparable(line) for line in run(c)]
    assert c_lines == [comparable(line) for line in run(reference)]
    assert len(c_lines) == 10


class _RaisingHandler(logging.Handler):
    """A log handler that raises `error` on the line containing `on`."""

    def __init__(self, error: BaseException, on: str) -> None:
        super().__init__()
        self.error, self.on = error, on
        self.raised = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.on in record.getMessage():
            self.raised += 1
            raise self.error


@contextlib.contextmanager
def raising_handler(error: BaseException, on: str = ""):
    logger = logging.getLogger("comfy_standin")
    handler = _RaisingHandler(error, on)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)],
                         ids=["KeyboardInterrupt", "SystemExit"])
@pytest.mark.parametrize("path", ["deferred", "bad reply", "gone",
                                  "is_alive", "bad arguments"])
def test_a_log_handlers_base_exception_propagates_from_the_call(
    impl, s, worker, error, path
):
    """A log handler that raises KeyboardInterrupt or SystemExit: it
    propagates from the call that logged, at the line, in both
    implementations (never later, from an unrelated line of the program),
    and what the line reports was written before it."""
    lines = {"deferred": "deferred", "bad reply": "bad reply",
             "gone": "is gone", "is_alive": "treating it as alive",
             "bad arguments": "bad arguments"}
    if path == "deferred":
        worker.send_raises = TimeoutError("worker busy")
    elif path == "bad reply":
        worker.reply = {"freed": "lots"}
    elif path == "gone":
        worker.alive = False
    elif path == "is_alive":
        worker.alive = RuntimeError("probe")
        worker.reply = {"freed": 100, "resident": 400, "seq": 4}
    # The call made from C (list.extend over map over a partial), so no
    # Python frame runs between its return and extend() keeping the
    # answer: an exception raised at the interpreter's next check, after
    # the call returned, would leave the answer there.
    bad = path == "bad arguments"
    call = functools.partial(s.partially_unload,
                             *(("cpu", 100, False) if bad else ("cpu",)))
    answers: list[int] = []
    with raising_handler(error, lines[path]) as handler:
        with pytest.raises(type(error)):
            answers.extend(map(call, ["x" if bad else 100]))
        assert handler.raised == 1
        assert answers == []  # raised by the call, not after it
        # Nothing is left to fire later.
        for _ in range(1000):
            pass
    loaded, seq, _, source = s.receipt()
    if path == "deferred":
        assert s.eviction_deferred and (loaded, seq) == (500, 3)
    elif path == "bad reply":
        assert s.eviction_deferred and s.bad_replies == 1
        assert (loaded, seq) == (500, 3)
    elif path == "gone":
        assert s.stale and (loaded, source) == (0, "worker gone")
    else:
        assert (loaded, seq, s.eviction_deferred) == (500, 3, False)
