"""``python -m comfy_standin selfcheck``: the C type and the reference
agree on a small scripted history (loads, echoes, a census, evictions, a
refusal, a bad reply, a report and a dead worker)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from ._text import json_text

MiB = 1 << 20


class ScriptedWorker:
    """Answers each command with the next scripted reply (a dict, or an
    exception to raise)."""

    def __init__(self) -> None:
        self.alive = True
        self.replies: list[Any] = []
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def __repr__(self) -> str:
        return "<scripted worker>"

    def send_command(self, command: str, **kwargs: Any) -> dict[str, Any]:
        self.sent.append((command, kwargs))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def is_alive(self) -> bool:
        return self.alive


def history(impl: Any) -> list[tuple[str, Any]]:
    """Runs the script on `impl`; returns (step, observation) pairs."""
    pool = impl.Pool(floor=300 * MiB, process_local=False)
    w = ScriptedWorker()
    s = impl.StandIn(worker=w, worker_generation=1, model_id="unet-0",
                     model_size=1000 * MiB, load_device="cuda:0",
                     offload_device="cpu", kind="unet", pool=pool)
    trace: list[tuple[str, Any]] = []

    def step(name: str, action: Callable[[], Any], *replies: Any) -> None:
        w.replies[:] = list(replies)
        try:
            result: Any = action()
            if result is s.model:
                result = "model"
        except Exception as exc:  # noqa: BLE001 - part of the trace
            result = type(exc).__name__
        loaded, seq, _, source = s.receipt()
        trace.append((name, (
            result, loaded, seq, source, s.eviction_deferred,
            s.bad_replies, str(s.device),
            pool.worker_charges().get(w), [c for c, _ in w.sent],
        )))
        w.sent.clear()

    step("load", lambda: s.partially_load("cuda:0", 1e32),
         {"loaded": 600 * MiB, "resident": 600 * MiB, "seq": 1})
    step("echo", lambda: impl.apply_echo(s, resident=500 * MiB, seq=2))
    step("old census", lambda: impl.apply_residency(
        {"unet-0": s}, [{"id": "unet-0", "seq": 1, "resident": 900 * MiB}]))
    step("census", lambda: impl.apply_residency(
        {"unet-0": s}, [{"id": "unet-0", "seq": 3, "resident": 700 * MiB}]))
    step("bad census", lambda: impl.apply_residency(
        {"unet-0": s}, [{"id": "unet-0", "seq": 4, "resident": -5}]))
    step("unload", lambda: s.partially_unload("cpu", 250.5 * MiB),
         {"freed": 256 * MiB, "resident": 444 * MiB, "seq": 4})
    step("refused", lambda: s.partially_unload("cpu", 100 * MiB),
         TimeoutError("lock busy"))
    step("bad reply", lambda: s.partially_unload("cpu", 100 * MiB),
         {"freed": True})
    step("report", lambda: pool.report(w, {"held": 800 * MiB}))
    step("in flight", lambda: pool.begin_call(w))
    step("idle", lambda: pool.end_call(w))
    step("detach", lambda: s.detach(), {"device": "cpu", "seq": 6})
    step("detach again", lambda: s.detach())
    step("reload", lambda: s.partially_load("cuda:0", 300 * MiB),
         {"loaded": 300 * MiB})
    w.alive = False
    step("gone unload", lambda: s.partially_unload("cpu", 10 * MiB))
    step("gone load", lambda: s.partially_load("cuda:0", 1e32))
    return trace


def _paint(text: str, code: str, color: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if color else text


def run(out: Any, mode: str = "text", color: bool = False,
        verbose: bool = False) -> int:
    """mode: "text", "quiet" (the verdict line only) or "json"."""
    cs = importlib.import_module("comfy_standin")
    reference = importlib.import_module("comfy_standin._reference")
    text = mode == "text"
    if text:
        print(f"comfy_standin {cs.__version__} from {cs.__file__}",
              file=out)
        print(f"C core: {cs._core.__file__}", file=out)
    # The script provokes a refusal, a bad reply and a dead worker on
    # purpose; their warnings are expected, not news.
    logger = logging.getLogger("comfy_standin")
    was_disabled, logger.disabled = logger.disabled, True
    try:
        c_trace = history(cs)
        ref_trace = history(reference)
    finally:
        logger.disabled = was_disabled
    bad = 0
    steps = []
    for (name, c_obs), (_, r_obs) in zip(c_trace, ref_trace, strict=True):
        same = c_obs == r_obs
        bad += not same
        steps.append({"step": name, "agree": same, "c": c_obs,
                      "reference": r_obs})
        if text:
            mark = (_paint("ok  ", "32", color) if same
                    else _paint("DIFF", "31;1", color))
            shown = c_obs if verbose else c_obs[:4]
            print(f"  [{mark}] {name:<13} {shown}", file=out)
            if not same:
                print(f"         reference: {r_obs}", file=out)
    if len(c_trace) != len(ref_trace):
        bad += 1
    if bad:
        verdict = (f"selfcheck: C and reference DISAGREE on {bad} of "
                   f"{len(c_trace)} steps")
    else:
        verdict = (f"selfcheck: C and reference agree on all "
                   f"{len(c_trace)} steps")
    if mode == "json":
        print(json_text({
            "version": cs.__version__, "module": cs.__file__,
            "core": cs._core.__file__, "ok": not bad, "steps": steps,
        }, indent=2), file=out)
    else:
        print(verdict, file=out)
    return 1 if bad else 0
