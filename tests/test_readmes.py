"""The READMEs tell the truth a student relies on first.

- README.md's first 60 lines answer, in this order: the two commands, where
  to start (Phase 00's guide, ``make jupyter``, ``labs/phase_00/``,
  ``make check-phase-00`` and what its score table looks like), the phase
  table, how grading works;
- the two commands are ``make demo`` and ``make test``, both real targets,
  and ``make test`` is what CI (``.ci/run``) runs;
- the points the README's phase table, each phase's README and the score
  table shown in README.md give are the graded suites' own: the suites are
  collected (``pytest --collect-only``, nothing graded) and their
  ``@pytest.mark.points`` marks summed, parametrized cases included, by the
  grading plugin itself;
- every phase folder has a README, the phase table lists every phase, and
  every relative link of the READMEs reaches a file, a folder or a heading.

Citations and ``mini_vllm`` paths in the READMEs are checked by
tests/upstream/test_phase_docs.py, with the phase documents.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

from mini_vllm.grading.plugin import results_of, score_table

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PHASES = sorted(p for p in (REPO / "phases").iterdir() if re.match(r"\d\d-", p.name))
READMES = [
    README,
    REPO / "tests" / "README.md",
    REPO / "mini_vllm" / "README.md",
    REPO / "mini_vllm" / "benchmarks" / "README.md",
    *(p / "README.md" for p in PHASES),
]
# The README's first screen: its intro, the two commands, where to start and
# the phase table, one row for each of the 20 phases, before how grading works.
FIRST_SCREEN = 62


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no '## {heading}' section"
    return m[1]


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


@cache
def collected() -> dict[str, dict]:
    """{node id: the grading plugin's entry} for every graded test, by collection only."""
    out = Path(tempfile.mkdtemp(prefix="mini_vllm-readmes-"))
    events, results = out / "events.jsonl", out / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "phases",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(REPO),
            "--results",
            str(results),
            "--no-score-table",
            "--grading-events",
            str(events),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (event,) = [
        e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "collected"
    ]
    shutil.rmtree(out)
    return event["tests"]


@cache
def lab_totals() -> dict[str, tuple[str, int, float]]:
    """{"03.2": (title, tests, points)} of the graded suites."""
    labs = results_of(collected(), "collect-only")["labs"]
    return {lab: (r["title"], r["tests"], r["total"]) for lab, r in labs.items()}


def test_the_first_screen_answers_in_order():
    lines = README.read_text(encoding="utf-8").splitlines()
    first = "\n".join(lines[:FIRST_SCREEN])
    wanted = [
        "## Two commands",
        "make demo",
        "make test",
        "## Where to start",
        "(phases/00-foundations/00-guide.md)",
        "make jupyter",
        "labs/phase_00/",
        "make check-phase-00",
        "```text\nlab ",
        "## The phases",
        "| phase | labs | points | time |",
        "## How grading works",
    ]
    at = 0
    for item in wanted:
        found = first.find(item, at)
        assert found >= 0, (
            f"README.md's first {FIRST_SCREEN} lines lack {item!r} after {first[:at][-80:]!r}"
        )
        at = found + len(item)


def test_the_two_commands_are_make_demo_and_make_test():
    (block,) = fenced(section(README.read_text(encoding="utf-8"), "Two commands"), "sh")
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make demo", "make test"], block
    ci = [
        line.strip()
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ci[-1] == "make test", f".ci/run ends with {ci[-1]!r}, not the README's test command"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("target", ["demo", "test"])
def test_the_two_commands_are_make_targets(target):
    run = subprocess.run(
        ["make", "-n", "--always-make", target], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def phase_rows(text: str) -> dict[str, list[str]]:
    """{"03": [cells]} of the README's phase table."""
    rows = {}
    for line in section(text, "The phases").splitlines():
        if m := re.match(r"\| \[(\d\d) [^]]*\]\(phases/(\d\d)-[\w-]+/\) \|", line):
            assert m[1] == m[2], line
            rows[m[1]] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


def test_the_phase_table_lists_every_phase_and_its_folder_readme():
    rows = phase_rows(README.read_text(encoding="utf-8"))
    assert sorted(rows) == [p.name[:2] for p in PHASES]
    missing = [p.name for p in PHASES if not (p / "README.md").is_file()]
    assert not missing, f"phase folders without a README.md: {missing}"


def phase_table_problems(text: str, totals: dict[str, tuple[str, int, float]]) -> list[str]:
    """Where the README's phase table disagrees with the suites' labs and points."""
    problems = []
    for phase, cells in phase_rows(text).items():
        labs = [lab for lab in totals if lab.startswith(phase + ".")]
        points = sum(totals[lab][2] for lab in labs)
        if cells[1:3] != [str(len(labs)), f"{points:g}"]:
            problems.append(
                f"README.md gives phase {phase} {cells[1]} labs and {cells[2]} points; "
                f"its suites have {len(labs)} labs worth {points:g}"
            )
    return problems


def phase_readme_problems(
    phase: Path, text: str, totals: dict[str, tuple[str, int, float]]
) -> list[str]:
    """Where a phase README's labs and points disagree with its suites."""
    name = phase.name
    mine = {lab: t for lab, t in totals.items() if lab.startswith(name[:2] + ".")}
    rows = re.findall(
        r"^\| \[(\d\d\.\d+)\]\((labs/lab-\d+-[\w-]+)/README\.md\) \|.*\| (\d+) \|$", text, re.M
    )
    problems = []
    if [lab for lab, _, _ in rows] != list(mine):
        problems.append(f"{name}/README.md lists labs {[r[0] for r in rows]}, not {list(mine)}")
    for lab, folder, points in rows:
        if not (phase / folder).is_dir():
            problems.append(f"{name}/README.md: no {folder}")
        if lab in mine and int(points) != mine[lab][2]:
            problems.append(
                f"{name}/README.md gives Lab {lab} {points} points; "
                f"its suite grades {mine[lab][2]:g}"
            )
    stated = re.findall(r"^## Labs: (\d+) points in all$", text, re.M)
    total = sum(t[2] for t in mine.values())
    if stated != [f"{total:g}"]:
        problems.append(
            f"{name}/README.md gives {stated} points in all; its suites grade {total:g}"
        )
    if f"make check-phase-{name[:2]}" not in text:
        problems.append(f"{name}/README.md does not give its check command")
    return problems


def test_the_phase_table_gives_each_phases_labs_and_points():
    problems = phase_table_problems(README.read_text(encoding="utf-8"), lab_totals())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("phase", PHASES, ids=lambda p: p.name[:2])
def test_each_phase_readme_gives_its_labs_points(phase):
    text = (phase / "README.md").read_text(encoding="utf-8")
    problems = phase_readme_problems(phase, text, lab_totals())
    assert not problems, "\n".join(problems)


def test_the_score_table_shown_is_the_graders_on_untouched_starters():
    (block,) = fenced(section(README.read_text(encoding="utf-8"), "Where to start"), "text")
    phase00 = {k: v for k, v in collected().items() if v["lab"].startswith("00.")}
    table = score_table(results_of(phase00, "untouched"))
    shown = [line.rstrip() for line in block.splitlines()]
    assert shown == [line.rstrip() for line in table.splitlines()], f"the grader prints\n{table}"


LINK_RE = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a markdown text's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(readme):
    text = readme.read_text(encoding="utf-8")
    broken = []
    for m in LINK_RE.finditer(text):
        target = m["target"]
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (readme.parent / path).resolve() if path else readme
        if not dest.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(dest.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{readme.relative_to(REPO)}: links that lead nowhere: {broken}"


# Suites as the checks see them, made up: phase 00 with two labs of 14 and 23.
MADE_UP = {"00.1": ("kv cache speedup", 6, 14.0), "00.2": ("kv memory", 9, 23.0)}


def test_the_checks_accept_a_true_readme():
    table = "## The phases\n\n| [00 foundations](phases/00-foundations/) | 2 | 37 | ~3 h |\n"
    assert phase_table_problems(table, MADE_UP) == []
    phase = REPO / "phases" / "00-foundations"
    text = (
        "## Labs: 37 points in all\n\n"
        "| [00.1](labs/lab-01-kv-cache-speedup/README.md) | x | 14 |\n"
        "| [00.2](labs/lab-02-kv-memory/README.md) | y | 23 |\n\nmake check-phase-00\n"
    )
    assert phase_readme_problems(phase, text, MADE_UP) == []


@pytest.mark.parametrize(
    "old, new, complaint",
    [
        ("| 23 |", "| 24 |", "gives Lab 00.2 24 points"),
        ("37 points in all", "38 points in all", "gives ['38'] points in all"),
        ("| [00.2](labs/lab-02-kv-memory/README.md) | y | 23 |\n", "", "lists labs ['00.1']"),
        ("lab-02-kv-memory", "lab-02-kv-memry", "no labs/lab-02-kv-memry"),
        ("make check-phase-00", "make check", "does not give its check command"),
    ],
)
def test_the_checks_reject_a_phase_readme_that_lies(old, new, complaint):
    phase = REPO / "phases" / "00-foundations"
    text = (
        "## Labs: 37 points in all\n\n"
        "| [00.1](labs/lab-01-kv-cache-speedup/README.md) | x | 14 |\n"
        "| [00.2](labs/lab-02-kv-memory/README.md) | y | 23 |\n\nmake check-phase-00\n"
    )
    problems = phase_readme_problems(phase, text.replace(old, new), MADE_UP)
    assert any(complaint in p for p in problems), problems


@pytest.mark.parametrize("cells", ["| 2 | 38 |", "| 3 | 37 |"])
def test_the_checks_reject_a_phase_table_that_lies(cells):
    table = f"## The phases\n\n| [00 foundations](phases/00-foundations/) {cells} ~3 h |\n"
    (problem,) = phase_table_problems(table, MADE_UP)
    assert "its suites have 2 labs worth 37" in problem


def test_the_link_check_knows_a_missing_heading():
    assert "how-grading-works" in anchors("## How grading works\n")
    assert "how-long-a-phase-takes" in anchors(README.read_text(encoding="utf-8"))
    assert "nowhere" not in anchors(README.read_text(encoding="utf-8"))
