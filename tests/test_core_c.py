"""The C unit tests of the core (tests/c/test_ledger.c), run from pytest so
the README's one test command covers them.  Under CI's sanitizer pass the
program is built with ASan/UBSan (CS_TEST_CFLAGS)."""

import re

from cbuild import ROOT, SRC, compile_c, run_c_test


def test_ledger_core_c(tmp_path):
    binary = compile_c(
        [SRC / "ledger.c", ROOT / "tests" / "c" / "test_ledger.c"],
        tmp_path / "test_ledger",
        defines=("_GNU_SOURCE",),
    )
    output = run_c_test(binary)
    match = re.search(r"(\d+) checks, (\d+) failed", output)
    assert match, output
    assert int(match.group(1)) > 1000
    assert int(match.group(2)) == 0
