"""`python -m mini_vllm.grading diff`: a mini_vllm symbol beside upstream's at the pin.

Checked: the two columns' headers and the ``def`` lines for a plain row; the
marked line for an inline row; ambiguous and unknown symbols (exit 2, with the
candidates or close matches); ``--impl labs`` with a student override from a
throwaway labs dir, and the fallback to the reference; the error without vllm.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest

# Same pattern as test_pin_map.py: collected even where vllm is missing (the
# conftest then skips `upstream` tests visibly, or refuses under
# MINI_VLLM_REQUIRE_UPSTREAM); skipped if vllm is installed but won't import.
if importlib.util.find_spec("vllm") is None:
    vllm = None
elif os.environ.get("MINI_VLLM_REQUIRE_UPSTREAM"):
    import vllm
else:
    vllm = pytest.importorskip("vllm")

from mini_vllm.grading import diff_upstream  # noqa: E402

pytestmark = pytest.mark.upstream

REPO_ROOT = Path(__file__).resolve().parents[2]
MINI_SCHEDULER = "mini_vllm/core/sched/scheduler.py"
UP_SCHEDULER = "vllm/v1/core/sched/scheduler.py"


def _mini_def_line(rel: str, qual: str) -> int:
    tree = ast.parse((REPO_ROOT / rel).read_text(encoding="utf-8"))
    (node,) = diff_upstream.definitions(tree)[qual]
    return node.lineno


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = diff_upstream.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _split(line: str) -> tuple[str, str]:
    left, _, right = line.partition(" │ ")
    return left, right


def test_reference_beside_upstream_for_schedule(capsys):
    rc, out, _ = _run(capsys, "Scheduler.schedule", "--width", "160")
    assert rc == 0
    lines = out.splitlines()
    assert all(len(line) <= 160 for line in lines)
    mini_line = _mini_def_line(MINI_SCHEDULER, "Scheduler.schedule")
    left_head, right_head = _split(lines[0])
    assert left_head.strip().startswith(f"reference  {MINI_SCHEDULER}:{mini_line}-")
    assert right_head.startswith(f"upstream 0.22.1  {UP_SCHEDULER}:329-")
    # The first body line holds both defs, with their line numbers; `>` marks the cited one.
    left, right = _split(lines[2])
    assert left.split()[:3] == [str(mini_line), "def", "schedule(self)"]
    assert right.startswith(">  329") and "def schedule(self)" in right
    tail = out[out.index("Where to look") :]
    assert f"{UP_SCHEDULER}:329" in tail and "_clamp_new_tokens` is a named method" in tail


def test_inline_row_shows_the_enclosing_def_and_marks_the_cited_line(capsys):
    rc, out, _ = _run(capsys, "_clamp_new_tokens", "--width", "200")
    assert rc == 0
    lines = out.splitlines()
    mini_line = _mini_def_line(MINI_SCHEDULER, "Scheduler._clamp_new_tokens")
    left_head, right_head = _split(lines[0])
    assert left_head.strip().startswith(f"reference  {MINI_SCHEDULER}:{mini_line}-")
    assert right_head.startswith(
        f"upstream 0.22.1  {UP_SCHEDULER}:329-"
    )  # all of Scheduler.schedule
    marked = [right for _, right in map(_split, lines[2:]) if right.startswith(">")]
    assert len(marked) == 1
    assert marked[0].startswith(">  390") and "long_prefill_token_threshold" in marked[0]
    assert "inline (no def upstream)" in out


def test_ambiguous_symbol_lists_the_rows(capsys):
    rc, out, err = _run(capsys, "add_request")
    assert rc == 2 and out == ""
    for cls in (
        "core.sched.request_queue.FCFSRequestQueue",
        "core.sched.request_queue.PriorityRequestQueue",
        "core.sched.scheduler.Scheduler",
    ):
        assert f"mini_vllm.{cls}.add_request" in err
    assert "name one of" in err


def test_unknown_symbol_suggests_close_matches(capsys):
    rc, out, err = _run(capsys, "Scheduler.shedule")
    assert rc == 2 and out == ""
    assert "not in UPSTREAM_PIN.md's symbol map" in err
    assert "Did you mean: Scheduler.schedule" in err


def test_full_path_and_narrow_width(capsys):
    rc, out, _ = _run(capsys, "mini_vllm.core.sched.utils.check_stop", "--width", "70")
    assert rc == 0
    table = out[: out.index("Where to look")].splitlines()
    assert all(len(line) <= 70 for line in table)
    assert "…" in out  # long lines are truncated, not wrapped
    assert table[0].split(" │ ")[1].startswith("upstream 0.22.1  …") and table[0].endswith(
        ":94-130"
    )


def test_impl_labs_shows_the_students_override(capsys, tmp_path, monkeypatch):
    starter = tmp_path / "phase_03" / "scheduler.py"
    starter.parent.mkdir()
    starter.write_text(
        "from mini_vllm.core.sched import scheduler as _reference\n\n\n"
        "class Scheduler(_reference.Scheduler):\n"
        "    def schedule(self):\n"
        "        return 'the student was here'\n",
        encoding="utf-8",
    )
    (tmp_path / "phase_03" / "utils.py").write_text(
        "def check_stop(request, max_model_len):\n    return True\n"
    )
    monkeypatch.setenv("MINI_VLLM_LABS_DIR", str(tmp_path))

    rc, out, _ = _run(capsys, "Scheduler.schedule", "--impl", "labs", "--width", "160")
    assert rc == 0
    lines = out.splitlines()
    left_head, right_head = _split(lines[0])
    assert left_head.startswith("student  ") and left_head.strip().endswith(
        "/phase_03/scheduler.py:5-6"
    )
    assert right_head.startswith(f"upstream 0.22.1  {UP_SCHEDULER}:329-")
    assert "the student was here" in _split(lines[3])[0]

    rc, out, _ = _run(capsys, "check_stop", "--impl", "labs", "--width", "160")
    assert (
        rc == 0
        and out.startswith("student  ")
        and _split(out)[0].strip().endswith("phase_03/utils.py:1-2")
    )


def test_impl_labs_falls_back_to_the_reference(capsys, tmp_path, monkeypatch):
    (tmp_path / "phase_03").mkdir()
    (tmp_path / "phase_03" / "scheduler.py").write_text(
        "class Scheduler:\n    def schedule(self):\n        pass\n"
    )
    (tmp_path / "phase_03" / "broken.py").write_text("def oops(:\n")  # a student's half-edit
    monkeypatch.setenv("MINI_VLLM_LABS_DIR", str(tmp_path))

    rc, out, err = _run(capsys, "Scheduler.update_from_output", "--impl", "labs", "--width", "160")
    assert rc == 0
    assert "inherits the reference's" in out
    mini_line = _mini_def_line(MINI_SCHEDULER, "Scheduler.update_from_output")
    header = next(line for line in out.splitlines() if " │ " in line)
    assert _split(header)[0].strip().startswith(f"reference  {MINI_SCHEDULER}:{mini_line}-")
    assert "broken.py" in err and "does not parse" in err


def test_without_vllm_names_make_upstream(capsys, monkeypatch):
    monkeypatch.setattr(diff_upstream, "_vllm_root", lambda: None)
    rc, out, err = _run(capsys, "Scheduler.schedule")
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "make upstream" in err
