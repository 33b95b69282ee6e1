"""The patch docs/upstream/comfy-env.md proposes applies where the page
says: in ``src/`` of comfy-env 0.4.46's sdist from PyPI.

The sdist is downloaded with pip (``network`` marker: no network, no
cache, the test fails) into a cache under the system's temporary
directory, and used only when its SHA-256 is the one PyPI published for
comfy_env-0.4.46.tar.gz.  Only the files the patch touches are taken out
of the archive.  ``patch --dry-run --fuzz=0`` then applies the page's
diff there, hunk for hunk, without changing anything.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.network

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "upstream" / "comfy-env.md"
VERSION = "0.4.46"
SDIST = f"comfy_env-{VERSION}.tar.gz"
#: sha256 of comfy_env-0.4.46.tar.gz as PyPI serves it.
SDIST_SHA256 = (
    "bc00eb615942fe54d33289bf5195fa2c1711ffdafb7745225626de165b85dcd9"
)
TIMEOUT = 600


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir(fallback: Path) -> Path:
    """A cache that survives the run: a directory of this user's, mode
    0700, that is not a link; else `fallback` (this run only)."""
    path = Path(tempfile.gettempdir()) / f"comfy-standin-cache-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return fallback
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & 0o077):
        return fallback
    return path


def comfy_env_sdist(work: Path) -> Path:
    """comfy-env 0.4.46's sdist, checked; downloaded unless cached."""
    cache = cache_dir(work)
    cached = cache / SDIST
    try:
        if sha256(cached) == SDIST_SHA256:
            return cached
    except OSError:
        pass
    download = work / "download"
    download.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
         "--no-deps", "--disable-pip-version-check", "-d", str(download),
         f"comfy-env=={VERSION}"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    got = download / SDIST
    assert done.returncode == 0 and got.exists(), (
        f"pip could not download comfy-env {VERSION}'s sdist (this test "
        f"needs PyPI):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )
    assert sha256(got) == SDIST_SHA256, (
        f"PyPI's {SDIST} is not the file this test was written against"
    )
    if cache != work:
        staged = cache / f".{SDIST}.{os.getpid()}"
        shutil.copyfile(got, staged)
        os.replace(staged, cached)
    return got


def the_diff() -> str:
    blocks = re.findall(r"^```diff\n(.*?)^```$", PAGE.read_text(),
                        re.M | re.S)
    assert len(blocks) == 1, "docs/upstream/comfy-env.md: one diff block"
    return blocks[0]


def patched_paths(diff: str) -> list[str]:
    return sorted(set(re.findall(r"^\+\+\+ b/(\S+)$", diff, re.M)))


def unpack(sdist: Path, members: list[str], into: Path) -> None:
    """Only the named files of the archive, written under `into`."""
    with tarfile.open(sdist) as archive:
        for name in members:
            member = archive.getmember(name)
            assert member.isfile(), name
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            source = archive.extractfile(member)
            assert source is not None, name
            target.write_bytes(source.read())


def dry_run(diff: Path, directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["patch", "--dry-run", "--batch", "--fuzz=0", "-p1",
         "-d", str(directory), "-i", str(diff)],
        capture_output=True, text=True, timeout=60,
    )


@pytest.fixture(scope="module")
def sdist_tree(tmp_path_factory) -> tuple[Path, Path]:
    """(the sdist's top folder holding the patched files, the diff)."""
    work = tmp_path_factory.mktemp("comfy-env-sdist")
    diff_text = the_diff()
    paths = patched_paths(diff_text)
    assert paths == ["comfy_env/isolation/pool.py"], paths
    top = f"comfy_env-{VERSION}"
    unpack(comfy_env_sdist(work), [f"{top}/src/{p}" for p in paths],
           work / "tree")
    diff = work / "plugins.patch"
    diff.write_text(diff_text)
    return work / "tree" / top, diff


def test_the_patch_applies_in_src_of_the_sdist(sdist_tree):
    assert shutil.which("patch"), "the patch program is missing"
    top, diff = sdist_tree
    done = dry_run(diff, top / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checking file comfy_env/isolation/pool.py" in done.stdout
    assert "FAILED" not in done.stdout and "fuzz" not in done.stdout


def test_it_does_not_apply_at_the_root_of_the_sdist(sdist_tree):
    """What the page once said (patch -p1 at the root) fails: the check
    tells the two apart."""
    top, diff = sdist_tree
    assert dry_run(diff, top).returncode != 0


def test_the_page_says_where_it_applies():
    text = PAGE.read_text()
    assert "pip download --no-binary :all: --no-deps comfy-env==0.4.46" \
        in text
    assert f"cd comfy_env-{VERSION}/src" in text
    assert "patch -p1" in text
