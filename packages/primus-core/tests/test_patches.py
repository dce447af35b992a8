"""The patch-table check the backends' compat tests run: it names a missing test, a test that does not exist and
a compat function no patch lists."""

from __future__ import annotations

import types

from primus.core.contracts.patches import Patch, table_problems


def test_table_problems_names_each_gap(tmp_path):
    (tmp_path / "test_compat.py").write_text("def test_listed():\n    pass\n")
    compat = types.ModuleType("fake_compat")
    exec("def listed(): pass\ndef forgotten(): pass\ndef check_version(): pass\n", compat.__dict__)
    compat.PATCHES = (
        Patch("compat.listed", "an engine function", "why", "test_compat.py::test_listed"),
        Patch("compat.untested", "another", "why", ""),
        Patch("compat.ghost", "another", "why", "test_compat.py::test_ghost"),
    )
    assert table_problems(compat, tmp_path, exempt=("check_version",)) == [
        "compat.untested: no test",
        "compat.ghost: test_compat.py::test_ghost does not exist",
        "fake_compat.forgotten is not in PATCHES",
    ]
