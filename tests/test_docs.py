"""The documentation stands alone: every file a doc, docstring, comment or
test cites is in the tree, nothing cites a document the repository does
not ship, and README's index lists every page of docs/."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What is scanned: docs, sources, tests, build files.
SUFFIXES = {".md", ".py", ".pyi", ".c", ".h", ".build", ".toml",
            ".options"}

#: Documents that are not in the repository (spelled in pieces so this
#: file does not cite them itself).
FORBIDDEN = [
    "DESIGN" + ".md",
    "COMFYUI" + "_FACTS",
    "STYLE" + ".md",
    "../" + "shared",
    "/work/" + "shared",
    "seed, inac" + "curacy",
    "seeds/" + "000_",
]

TOP = ("docs", "src", "include", "tests", "bench", "python", "examples",
       "tools")
# e.g. docs/glossary.md, src/ledger.c, tests/c, python/comfy_standin
# (a template such as tests/c/stubs/stub_<kind>.c is not a citation)
PREFIXED = re.compile(
    r"(?<![\w/.$~{-])((?:" + "|".join(TOP) + r")/[\w./-]*\w)"
    r"(?![\w/<{*-]|\.[\w/<{*])"
)
BARE_MD = re.compile(
    r"(?<![\w/.$~{-])([\w-]+\.md)(?![\w/<{*-]|\.[\w/<{*])"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
URL = re.compile(r"\b(?:https?|file)://\S+")


def files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached",
             "--others", "--exclude-standard"],
            capture_output=True, check=True,
        ).stdout.decode()
        # A path once, even mid-merge (an unmerged file is listed once
        # per stage).
        names = sorted({n for n in out.split("\0") if n})
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (an unpacked sdist): walk, skipping what a
        # build or a virtual environment leaves.
        skip = {".git", "build", "dist", "__pycache__", ".mypy_cache"}
        names = [
            str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.parts)
            and not any(part.startswith(("venv", ".venv", "build-"))
                        for part in p.parts)
        ]
    # Top-level files and the project's own folders (not a build or
    # virtual-environment folder someone made in the checkout).
    found = [ROOT / n for n in names
             if "/" not in n or n.split("/", 1)[0] in TOP]
    return sorted(p for p in found if p.suffix in SUFFIXES and p.is_file())


FILES = files()


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def exists(citing: Path, target: str) -> bool:
    target = target.split("#", 1)[0].rstrip("/.")
    if not target:
        return True
    bases = [ROOT, citing.parent]
    if target.endswith(".md") and "/" not in target:
        bases.append(ROOT / "docs")
    return any((base / target).exists() for base in bases)


def prose(path: Path) -> list[tuple[int, str]]:
    """The lines of `path` that are prose: every line of a doc, C file or
    build file; of a Python file its comments and docstrings (a string
    in code, such as a file name under ``tmp_path``, names a file the
    code makes, not one it cites)."""
    text = path.read_text()
    if path.suffix not in (".py", ".pyi"):
        return list(enumerate(text.splitlines(), 1))
    lines = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            lines.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                first = body[0].lineno
                lines += [(first + i, line) for i, line in enumerate(
                    body[0].value.value.splitlines())]
    return lines


def citations(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose(path):
        line = URL.sub("", line)
        for pattern in (PREFIXED, BARE_MD):
            found += [(number, m.group(1)) for m in pattern.finditer(line)]
        if path.suffix == ".md":
            found += [(number, m.group(1)) for m in LINK.finditer(line)
                      if ":" not in m.group(1)]
    return found


def test_the_scan_sees_the_tree():
    names = {rel(p) for p in FILES}
    assert {"README.md", "docs/architecture.md", "src/standin.c",
            "python/comfy_standin/_demo.py", "tests/test_docs.py"} <= names


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_every_cited_file_exists(path):
    missing = [f"{rel(path)}:{n}: {target}"
               for n, target in citations(path)
               if not exists(path, target)]
    assert missing == []


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_nothing_cites_documents_outside_the_repository(path):
    text = path.read_text()
    bad = [
        f"{rel(path)}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if any(word in line for word in FORBIDDEN)
    ]
    assert bad == []


def test_the_checks_can_fail(tmp_path):
    """The scanner finds a missing file and a forbidden citation."""
    page = ROOT / "docs" / "architecture.md"
    assert not exists(page, "docs/no-such-page.md")
    assert not exists(page, "missing.md")
    assert exists(page, "glossary.md") and exists(page, "src/ledger.c")
    sample = tmp_path / "x.py"
    sample.write_text('"""See docs/nowhere.md and src/gone.c."""\n'
                      'x = "docs/made.md"  # see tests/c/stubs/stub_<k>.c\n'
                      '# and NEWS.md\n')
    assert [t for _, t in citations(sample)] == ["NEWS.md",
                                                 "docs/nowhere.md",
                                                 "src/gone.c"]


def test_readme_indexes_every_doc_page():
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert {"architecture.md", "glossary.md", "comfyui.md",
            "semantics.md"} <= set(pages)
    unlisted = [p for p in pages if f"(docs/{p})" not in readme]
    assert unlisted == []


def test_glossary_defines_every_term_the_demo_names():
    from comfy_standin import _demo

    glossary = (ROOT / "docs" / "glossary.md").read_text()
    # A heading, or a word defined in bold inside an entry.
    defined = set(re.findall(r"^## (\w[\w ]*)$", glossary, re.M)) | set(
        re.findall(r"\*\*(\w[\w -]*)\*\*", glossary))
    assert set(_demo.GLOSSARY) <= defined, set(_demo.GLOSSARY) - defined
