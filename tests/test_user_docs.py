"""What a user reads first says what is true.

- The README's first screen serves a ComfyUI user (the "For ComfyUI
  users" path comes before anything for developers), and its "Develop and
  test" section has exactly two set-up commands, which .ci/run runs
  character for character.
- One version: pyproject.toml, ``__version__`` and CHANGELOG.md's newest
  release agree, and CHANGELOG.md states the version policy.
- One platform statement: the classifiers, cibuildwheel's builds,
  requires-python, the README's "Platforms" and the pages that describe
  Windows or macOS code paths say the same thing.
- The glossary defines the words the docs use.
"""

from __future__ import annotations

import re
from pathlib import Path

import comfy_standin

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()
CI = (ROOT / ".ci" / "run").read_text()

#: The platform statement, word for word wherever platforms are stated.
SUPPORTED = ("Supported and tested: Linux on x86_64, CPython 3.10 to "
             "3.13.")
DESIGNED = "never compiled or run"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (to the next ``## ``)."""
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text,
                      re.M | re.S)
    assert found, f"no '## {heading}' section"
    return found.group(1)


def flat(text: str) -> str:
    """Prose with line breaks, blockquote marks and runs of spaces made
    one space."""
    return " ".join(re.sub(r"^> ?", "", text, flags=re.M).split())


def setup_commands() -> list[str]:
    body = section(README, "Develop and test")
    block = re.search(r"```sh\n(.*?)```", body, re.S)
    assert block, "no sh block in Develop and test"
    return [line for line in block.group(1).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


# -- README ---------------------------------------------------------------


def test_the_first_screen_serves_a_comfyui_user():
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[0] == "For ComfyUI users", headings
    assert headings.index("For ComfyUI users") < headings.index(
        "Develop and test")
    before = README.split("## For ComfyUI users", 1)[0]
    assert len(before.splitlines()) <= 20, "the path starts on screen one"
    path = section(README, "For ComfyUI users")
    # the steps, in order: install, switch on, restart, check, turn off,
    # uninstall (uninstall-node before pip uninstall)
    steps = ["-m pip install", "install-node", "Restart ComfyUI",
             "status --url", "uninstall-node", "pip uninstall"]
    places = [path.find(step) for step in steps]
    assert -1 not in places, dict(zip(steps, places, strict=True))
    assert places == sorted(places), dict(zip(steps, places, strict=True))
    assert "docs/troubleshooting.md" in path
    # nothing to install in a pack's environment, nothing for developers
    assert "pack/env/bin/python" not in README
    assert "pytest" not in path and "[test]" not in path


def test_develop_and_test_has_exactly_two_setup_commands():
    commands = setup_commands()
    assert commands == [
        "python -m pip install . && python -m comfy_standin demo",
        "python -m pip install '.[test]' && python -m pytest",
    ]
    body = flat(section(README, "Develop and test"))
    assert "fresh virtual environment" in body
    assert "never ComfyUI's own" in body


def test_ci_runs_the_readme_commands_character_for_character():
    for command in setup_commands():
        assert f'bash -c "{command}"' in CI, command


def test_the_test_core_recipe_is_the_one_ci_runs():
    recipe = ("python -m pip install '.[test-core]' && python -m pytest "
              "-m \"not comfy_env\"")
    assert recipe in README
    assert '-m "not comfy_env"' in CI and "[test-core]" in CI


def test_the_results_are_in_the_user_part():
    """The live page's screenshot and the regret outcome (what the board
    changes, measured) are told before the developer's part."""
    assert "](docs/img/vram-page.png)" in README
    outcome = section(README, "Does the live board change what ComfyUI "
                              "evicts?")
    assert "bench/bench_regret.py" in outcome
    assert "[docs/regret.md](docs/regret.md)" in outcome
    assert README.index("## Does the live board change") < README.index(
        "## Develop and test")


def test_getting_it_says_what_a_user_needs():
    body = flat(section(README, "Getting it"))
    for fact in ("Linux", "CPython 3.10 to 3.13", "python3-dev",
                 "C compiler", "cibuildwheel", "python -m build",
                 "wheel"):
        assert fact in body, fact
    assert "[CHANGELOG.md](CHANGELOG.md)" in body


# -- version and changelog ------------------------------------------------


def project_version() -> str:
    found = re.search(r'^version = "([^"]+)"$', PYPROJECT, re.M)
    assert found
    return found.group(1)


def test_one_version():
    assert comfy_standin.__version__ == project_version()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\d+\.\d+\.\d+)\b", changelog, re.M)
    assert releases and releases[0] == project_version(), releases
    headings = re.findall(r"^## (.+)$", changelog, re.M)
    assert headings[:2] == ["Version policy", "Unreleased"], headings


def test_the_version_policy_says_what_a_number_promises():
    policy = flat(section((ROOT / "CHANGELOG.md").read_text(),
                          "Version policy"))
    for word in ("MAJOR.MINOR.PATCH", "public surface", "0.x",
                 "From 1.0", "board", "comfy-env"):
        assert word in policy, word


# -- platforms ------------------------------------------------------------


def test_packaging_metadata_claims_exactly_the_supported_platforms():
    classifiers = re.findall(r'^\s+"([^"]+ :: [^"]+)",$', PYPROJECT, re.M)
    systems = [c for c in classifiers if c.startswith("Operating System")]
    assert systems == ["Operating System :: POSIX :: Linux"]
    versions = sorted(c.rsplit(" :: ", 1)[1] for c in classifiers
                      if re.fullmatch(r"Programming Language :: Python :: "
                                      r"3\.\d+", c))
    assert tuple(versions) == PYTHONS
    assert 'requires-python = ">=3.10"' in PYPROJECT
    build = re.search(r'^build = "([^"]+)"$', PYPROJECT, re.M)
    assert build and build.group(1).split() == [
        f"cp{v.replace('.', '')}-*" for v in PYTHONS]


def test_the_readme_states_the_platforms():
    body = flat(section(README, "Platforms"))
    assert body.startswith(SUPPORTED)
    assert DESIGNED in body
    for word in ("Windows", "WDDM", "macOS", "aarch64", "free-threaded"):
        assert word in body, word


def test_every_page_with_other_platforms_says_the_same():
    for name in ("reserve.md", "board.md", "probe.md"):
        text = flat((ROOT / "docs" / name).read_text())
        assert SUPPORTED in text, name
        assert DESIGNED in text, name
        assert "(../README.md#platforms)" in text, name


# -- glossary -------------------------------------------------------------


def test_the_glossary_defines_the_words_the_docs_use():
    """Its entries are the words ComfyUI's and comfy-env's maintainers
    already use; the project's own words are defined, in bold, inside
    them."""
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    terms = re.findall(r"^## (.+)$", glossary, re.M)
    assert terms == ["board", "census", "charge", "echo", "LoadedModel",
                     "patcher", "pool", "receipt", "reserve"]
    assert terms == sorted(terms, key=str.lower), "alphabetical"
    defined = set(re.findall(r"\*\*(\w[\w -]*)\*\*", glossary))
    wanted = {
        "host", "worker", "stand-in", "node boundary", "supremum", "peak",
        "held", "floor", "unlisted bytes", "tag", "heartbeat", "WDDM",
        "generation", "stale", "graveyard", "eviction deferred",
    }
    assert wanted <= defined, wanted - defined
