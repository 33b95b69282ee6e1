"""The demo's story reads in order.

- A line comfy_standin logs during an eviction is printed under that
  eviction's row in "what it chose", never before the table of what
  ComfyUI saw (it happened during the choice); with --verbose the
  commands too.
- Every change of a worker model's receipt that a table shows was told
  in a line of the story since the model was last shown (a line of the
  story proper: not a table row, not a [log] or [wire] line): no model
  is reloaded behind the reader's back.
"""

from __future__ import annotations

import io
import re

import pytest

from comfy_standin import _demo

#: A worker model's row, in the model tables and in "what ComfyUI saw":
#: name, kind, size, receipt.
ROW = re.compile(r"^ {2,4}([AB]/\w+)\s+worker \w+\s+\S+ GiB\s+(\S+ GiB)")
EVICTION = re.compile(r"^ {4}(\S+)\s+asked ")
NAMED = re.compile(r"model '([^']+)'")
TAGGED = re.compile(r"^\s+\[(?:log|wire)\] ")


def story(impl: str, verbose: bool) -> list[str]:
    out = io.StringIO()
    assert _demo.run_demo(impl, out, show_status=False,
                          verbose=verbose) == 0, out.getvalue()
    return out.getvalue().splitlines()


@pytest.fixture(scope="module", params=[("c", False), ("reference", True)],
                ids=["c", "reference-verbose"])
def lines(request) -> list[str]:
    return story(*request.param)


def sections(lines: list[str]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for line in lines:
        if line.startswith("== "):
            parts.append([])
        parts[-1].append(line)
    return parts


def told_out_of_order(lines: list[str]) -> list[str]:
    """[log]/[wire] lines printed while a free_memory run is being shown
    before its choice (between "free_memory(" and "what it chose:"), or,
    in the choice, under the row of another model than the one they
    name."""
    wrong = []
    state, current = "idle", None
    for number, line in enumerate(lines):
        if "free_memory(" in line:
            state = "sorting"
        elif "what it chose:" in line:
            state, current = "choosing", None
        elif "free after:" in line or line.startswith("== "):
            state = "idle"
        found = EVICTION.match(line)
        if state == "choosing" and found:
            current = found.group(1)
            continue
        tagged = re.match(r"^\s+\[(?:log|wire)\] (.*)", line)
        if not tagged:
            continue
        if state == "idle":
            # a logged line printed just before a run belongs to it
            after = [s for s in lines[number + 1:] if not TAGGED.match(s)]
            if "[log]" in line and after and "free_memory(" in after[0]:
                wrong.append(line)
            continue
        if state == "sorting":
            wrong.append(line)
            continue
        named = NAMED.search(tagged.group(1)) or re.search(
            r"'model_id': '([^']+)'", tagged.group(1))
        if named is None or named.group(1) != current:
            wrong.append(f"{line!r} under {current!r}")
    return wrong


def untold_changes(lines: list[str]) -> list[str]:
    shown: dict[str, tuple[str, int]] = {}
    untold = []
    for number, line in enumerate(lines):
        row = ROW.match(line)
        if not row:
            continue
        name, receipt = row.groups()
        if name in shown and shown[name][0] != receipt:
            since = lines[shown[name][1] + 1:number]
            story_lines = [
                s for s in since
                if not ROW.match(s) and not TAGGED.match(s)
            ]
            if not any(name in s for s in story_lines):
                untold.append(f"{name}: {shown[name][0]} -> {receipt} at "
                              f"line {number + 1}: {line.strip()}")
        shown[name] = (receipt, number)
    return untold


def test_logged_lines_sit_under_the_eviction_they_belong_to(lines):
    assert told_out_of_order(lines) == []
    logged = [line for line in lines if "[log]" in line]
    # the demo does log: a worker gone (section 4), three deferrals (5)
    assert len(logged) >= 4, logged


def test_every_change_a_table_shows_is_told(lines):
    assert untold_changes(lines) == []


def test_section_5_says_it_loads_what_section_3_detached(lines):
    parts = {part[0]: part for part in sections(lines) if part}
    five = next(p for title, p in parts.items() if title.startswith("== 5."))
    run = next(i for i, line in enumerate(five) if "free_memory(" in line)
    before = "\n".join(five[:run])
    assert "registered again" in before
    assert "partially_load -> 2.00 GiB" in before
    assert any(ROW.match(line) and line.split()[0] == "A/unet"
               for line in five[:run]), "a table before the choice"
    assert any("node boundary: pool.boundary(mm) lists again" in line
               and "A/lora, A/unet" in line for line in five)


def test_the_checks_can_fail():
    """The two scanners find what they look for."""
    shuffled = [
        "== 4. x ==",
        "  [log] comfy_standin: the worker of model 'B/unet' is gone",
        "  free_memory(5.25 GiB, cuda:0): 4.25 GiB free before",
        "  what it chose:",
        "    B/unet     asked   1.00 GiB: partially_unload -> 3.00 GiB",
        "      [log] comfy_standin: model 'A/unet' deferred",
        "  free after: 4.25 GiB",
    ]
    assert told_out_of_order(shuffled) == [
        shuffled[1],
        f"{shuffled[5]!r} under 'B/unet'",
    ]
    assert told_out_of_order(
        ["  free_memory(1 GiB)", "  [log] model 'A/unet' x",
         "  what it chose:"]) == ["  [log] model 'A/unet' x"]
    reloaded = [
        "  A/unet     worker unet    4.00 GiB   0.00 GiB     0.00 GiB",
        "  [log] comfy_standin: model 'A/unet' deferred",
        "    A/unet     worker unet    4.00 GiB   2.00 GiB     2.00 GiB",
    ]
    assert len(untold_changes(reloaded)) == 1
    told = reloaded[:2] + ["  A/unet is loaded again"] + reloaded[2:]
    assert untold_changes(told) == []
