"""tests/phase_times.py files each honesty check, doc example and notebook
under its phase."""

from __future__ import annotations

import ast
from pathlib import Path

from phase_times import phase_and_column

HERE = Path(__file__).parent


def test_every_honesty_check_and_notebook_has_a_column():
    tree = ast.parse((HERE / "test_labs_honest.py").read_text())
    checks = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test_")
        and [a.arg for a in node.args.args][:1] == ["phase"]
    ]
    assert len(checks) == 4, checks
    columns = {phase_and_column(f"tests/test_labs_honest.py::{name}[03]") for name in checks}
    assert columns == {("03", "reference"), ("03", "starters"), ("03", "solved")}
    doc = "tests/upstream/test_phase_docs.py::test_examples_print_what_the_docs_say"
    assert phase_and_column(f"{doc}[phases/12-structured-outputs/00-guide.md:40]") == (
        "12",
        "docs",
    )
    for notebook in sorted((HERE.parent / "notebooks").glob("phase-*.ipynb")):
        nodeid = f"notebooks/{notebook.name}::{notebook.name}"
        assert phase_and_column(nodeid) == (notebook.name[6:8], "notebook"), nodeid
    # Lab 19.3's served runs, by the names tests/test_capstone.py gives them.
    capstone = (HERE / "test_capstone.py").read_text()
    for name, column in [
        ("test_solved_copy_answers_as_the_reference", "solved"),
        ("test_untouched_starters_fail_the_run", "starters"),
    ]:
        assert f"def {name}(" in capstone, name
        assert phase_and_column(f"tests/test_capstone.py::{name}") == ("19", column)
    assert (
        phase_and_column("tests/test_capstone.py::test_phases_are_read_from_the_environment")
        is None
    )
    assert phase_and_column("tests/test_labs_honest.py::test_every_phase_x") is None
    assert phase_and_column("tests/test_grading.py::test_markers_must_pair_up") is None
