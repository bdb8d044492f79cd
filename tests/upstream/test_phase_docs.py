"""The phase documents cite upstream and mini_vllm truthfully.

For every ``phases/*/*.md`` (each phase's README included) and the READMEs
outside ``phases/`` (``README_DOCS``):

- every ``vllm/<path>.py:<line>`` is in a checked form and holds at the
  installed pin. The single-line forms are UPSTREAM_PIN.md's, checked by the
  same code (imported from ``test_pin_map.py``):

  - ``` `Qual.name` (vllm/x.py:N) ```: line N holds ``class name`` or
    ``def name(``, and the syntax tree defines ``Qual.name`` there;
  - ``vllm/x.py:N (reads `text`)``: line N contains ``text``.

  The docs may also cite a range of lines, in two forms:

  - ``` `Qual.name` (vllm/x.py:A-B) ```: ``Qual.name`` is defined at line A
    and line B lies inside that definition, after A;
  - ``vllm/x.py:A-B (reads `text`)``: line A contains ``text``, A < B, and
    B lies inside the innermost ``class``/``def`` that contains A, so a
    range cannot wander out of the function it starts in.

  Any other ``vllm/x.py:N`` fails, and so does a line number on any other
  ``.py`` path (``scheduler.py:390``, ``mini_vllm/x.py:12``): the docs cite
  mini_vllm by path and symbol, never by line;
- every ``mini_vllm/...py`` path (and ``tests/``, ``labs/`` path to a ``.py``
  file) exists, and every back-quoted ``mini_vllm/.../`` folder exists;
- every ``` `Qual.name` (`mini_vllm/x.py`) ``` pair resolves: the file
  defines ``Qual.name`` (a ``class``/``def`` chain, read with ``ast``);
- every back-quoted dotted name ``` `mini_vllm.a.b` ``` imports (the longest
  importable module prefix, then attributes);
- every example is reproducible: a ```` ```python ```` block followed by a
  ```` ```text ```` block (optionally with a ``<details><summary>`` line
  between them) is run as ``python -c`` runs it, in a process forked from one
  that has only imported torch (tests/upstream/example_server.py), and must
  print exactly that text. A number quoted in a phase doc comes from such a pair.

The last tests feed the checker broken citations, so a checker that accepts
everything cannot pass.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

# Collected even where vllm is missing: the conftest then skips the
# `upstream` tests with a visible reason (or refuses to run at all under
# MINI_VLLM_REQUIRE_UPSTREAM). When vllm is installed but cannot be imported,
# skip the module, unless the pin is required, in which case fail loudly.
if importlib.util.find_spec("vllm") is None:
    vllm = None
elif os.environ.get("MINI_VLLM_REQUIRE_UPSTREAM"):
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm")

# The single-line citation forms and their checks are UPSTREAM_PIN.md's.
from . import test_pin_map as pin  # noqa: E402

pytestmark = pytest.mark.upstream

REPO_ROOT = Path(__file__).resolve().parents[2]
PHASE_DOCS = sorted(REPO_ROOT.glob("phases/**/*.md"))
README_DOCS = [
    REPO_ROOT / rel
    for rel in (
        "README.md",
        "tests/README.md",
        "mini_vllm/README.md",
        "mini_vllm/benchmarks/README.md",
    )
]
DOCS = PHASE_DOCS + README_DOCS
PHASE_03 = REPO_ROOT / "phases" / "03-continuous-batching-scheduler"
PHASE_03_FILES = (
    "00-guide.md",
    "01-deep-dive.md",
    "02-mini-build.md",
    "EXERCISES.md",
    "CHEATSHEET.md",
)
PHASE_02 = REPO_ROOT / "phases" / "02-paged-kv-cache"
PHASE_01 = REPO_ROOT / "phases" / "01-architecture-request-lifecycle"

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_QUAL = rf"{_IDENT}(?:\.{_IDENT})*"
_VLLM_PATH = r"vllm/[A-Za-z0-9_/]+\.py"
DEF_RANGE_RE = re.compile(
    rf"`(?P<qual>{_QUAL})`\s+\((?P<path>{_VLLM_PATH}):(?P<start>\d+)-(?P<end>\d+)\)"
)
READS_RANGE_RE = re.compile(
    rf"(?P<path>{_VLLM_PATH}):(?P<start>\d+)-(?P<end>\d+)\s+\(reads\s+`(?P<text>[^`]+)`\)"
)
# A line number on any .py path. Those starting with vllm/ are the citations
# checked above; any other is refused.
ANY_PY_LINE_RE = re.compile(r"(?<![\w./-])(?P<path>[\w./-]+\.py):\d+")
REPO_PY_PATH_RE = re.compile(r"(?<![\w./-])(?P<path>(?:mini_vllm|tests|labs)/[\w/.-]*?\.py)\b")
MINI_DIR_RE = re.compile(r"`(?P<path>mini_vllm(?:/[\w.-]+)*/)`")
MINI_SYMBOL_RE = re.compile(rf"`(?P<qual>{_QUAL})`\s+\(`(?P<path>mini_vllm/[\w/]+\.py)`\)")
MINI_DOTTED_RE = re.compile(rf"`(?P<name>mini_vllm(?:\.{_IDENT})+)`")
# An example: python code, then (perhaps behind a <details> line) what it prints.
EXAMPLE_RE = re.compile(
    r"```python\n(?P<code>.*?)```\s*\n(?:<details><summary>[^\n]*</summary>\s*\n)?"
    r"```text\n(?P<out>.*?)```",
    re.S,
)


def _rel(doc: Path) -> str:
    return str(doc.relative_to(REPO_ROOT))


def _where(doc: str, text: str, pos: int) -> str:
    return f"{doc}:{text.count(chr(10), 0, pos) + 1}"


# ------------------------------------------------------------ upstream lines


def _check_def_range(qual: str, rel: str, start: int, end: int) -> str | None:
    why = pin._check_def(qual, rel, start)
    if why:
        return why
    (last,) = [e for s, e in pin._upstream_defs(rel)[qual] if s == start]
    if not start < end <= last:
        return (
            f"{rel}:{start}-{end}: `{qual}` spans lines {start}-{last}; "
            f"the range must end inside it, after {start}"
        )
    return None


def _innermost_def(rel: str, line: int) -> tuple[str, int, int] | None:
    best = None
    for qual, spans in pin._upstream_defs(rel).items():
        for s, e in spans:
            if s <= line <= e and (best is None or s >= best[1]):
                best = (qual, s, e)
    return best


def _check_reads_range(rel: str, start: int, end: int, text: str) -> str | None:
    if not start < end:
        return f"{rel}:{start}-{end}: a range must run forward"
    why = pin._check_reads(rel, start, text)
    if why:
        return why
    inner = _innermost_def(rel, start)
    if inner is None:
        return f"{rel}:{start}-{end}: a range must start inside a class or def"
    qual, _, last = inner
    if end > last:
        return f"{rel}:{start}-{end} runs past the end of `{qual}` (its last line is {last})"
    return None


def check_upstream_citations(text: str, doc: str) -> tuple[list[str], int]:
    """(problems, number of checked citations) for the upstream lines in ``text``."""
    problems: list[str] = []
    covered: list[tuple[int, int]] = []
    n_checked = 0
    forms = [
        (pin.DEF_CITE_RE, lambda m: pin._check_def(m["qual"], m["path"], int(m["line"]))),
        (pin.READS_CITE_RE, lambda m: pin._check_reads(m["path"], int(m["line"]), m["text"])),
        (
            DEF_RANGE_RE,
            lambda m: _check_def_range(m["qual"], m["path"], int(m["start"]), int(m["end"])),
        ),
        (
            READS_RANGE_RE,
            lambda m: _check_reads_range(m["path"], int(m["start"]), int(m["end"]), m["text"]),
        ),
    ]
    for regex, check in forms:
        for m in regex.finditer(text):
            covered.append(m.span("path"))
            n_checked += 1
            why = check(m)
            if why:
                problems.append(f"{_where(doc, text, m.start())}: {why}")
    for m in ANY_PY_LINE_RE.finditer(text):
        if any(a <= m.start("path") < b for a, b in covered):
            continue
        if m["path"].startswith("vllm/"):
            problems.append(
                f"{_where(doc, text, m.start())}: {m.group()} is cited in an unchecked form; write "
                "`Qual.name` (path:N), path:N (reads `text`), or a range in one of those forms"
            )
        else:
            problems.append(
                f"{_where(doc, text, m.start())}: {m.group()}: only upstream files are cited by "
                "line, with their full vllm/ path; cite mini_vllm by path and symbol"
            )
    return problems, n_checked


# --------------------------------------------------------------- mini_vllm


@cache
def _mini_defs(rel: str) -> frozenset[str]:
    """Qualified names of the classes and functions a repo file defines."""
    path = REPO_ROOT / rel
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found.add(prefix + child.name)
                visit(child, prefix + child.name + ".")
            elif not isinstance(child, ast.expr):
                visit(child, prefix)

    visit(tree, "")
    return frozenset(found)


def _resolve_dotted(name: str) -> str | None:
    """None if ``name`` imports (module prefix, then attributes); else why not."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        modname = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name is not None and (modname == e.name or modname.startswith(e.name + ".")):
                continue
            raise
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"`{name}`: {modname} has no {'.'.join(parts[cut:])!r}"
            obj = getattr(obj, attr)
        return None
    return f"`{name}`: no importable module prefix"


def check_mini_references(text: str, doc: str) -> tuple[list[str], int]:
    """(problems, number checked) for the repo paths and mini_vllm symbols in ``text``."""
    problems: list[str] = []
    n_checked = 0
    for m in REPO_PY_PATH_RE.finditer(text):
        n_checked += 1
        if not (REPO_ROOT / m["path"]).is_file():
            problems.append(f"{_where(doc, text, m.start())}: {m['path']} does not exist")
    for m in MINI_DIR_RE.finditer(text):
        n_checked += 1
        if not (REPO_ROOT / m["path"]).is_dir():
            problems.append(f"{_where(doc, text, m.start())}: folder {m['path']} does not exist")
    for m in MINI_SYMBOL_RE.finditer(text):
        n_checked += 1
        rel, qual = m["path"], m["qual"]
        if not (REPO_ROOT / rel).is_file():
            problems.append(f"{_where(doc, text, m.start())}: {rel} does not exist")
        elif qual not in _mini_defs(rel):
            problems.append(f"{_where(doc, text, m.start())}: {rel} defines no `{qual}`")
    for m in MINI_DOTTED_RE.finditer(text):
        n_checked += 1
        why = _resolve_dotted(m["name"])
        if why:
            problems.append(f"{_where(doc, text, m.start())}: {why}")
    return problems, n_checked


# ------------------------------------------------------------------ tests


def test_phase_03_docs_are_there():
    missing = [name for name in PHASE_03_FILES if not (PHASE_03 / name).is_file()]
    assert not missing, f"missing from {PHASE_03.relative_to(REPO_ROOT)}: {missing}"


def test_phase_02_docs_are_there():
    missing = [name for name in PHASE_03_FILES if not (PHASE_02 / name).is_file()]
    assert not missing, f"missing from {PHASE_02.relative_to(REPO_ROOT)}: {missing}"


def test_phase_01_docs_are_there():
    missing = [name for name in PHASE_03_FILES if not (PHASE_01 / name).is_file()]
    assert not missing, f"missing from {PHASE_01.relative_to(REPO_ROOT)}: {missing}"


def test_the_phase_01_deep_dive_and_mini_build_cite_throughout():
    _, n = check_upstream_citations(
        (PHASE_01 / "01-deep-dive.md").read_text(encoding="utf-8"), "01-deep-dive.md"
    )
    assert n >= 60, f"the Phase 01 deep dive has only {n} checked upstream citations"
    _, n = check_mini_references(
        (PHASE_01 / "02-mini-build.md").read_text(encoding="utf-8"), "02-mini-build.md"
    )
    assert n >= 20, f"Phase 01's 02-mini-build.md checks only {n} mini_vllm references"


def test_the_phase_02_deep_dive_cites_upstream_throughout():
    _, n = check_upstream_citations(
        (PHASE_02 / "01-deep-dive.md").read_text(encoding="utf-8"), "01-deep-dive.md"
    )
    assert n >= 60, f"the Phase 02 deep dive has only {n} checked upstream citations"


def test_the_phase_02_mini_build_names_its_symbols():
    _, n = check_mini_references(
        (PHASE_02 / "02-mini-build.md").read_text(encoding="utf-8"), "02-mini-build.md"
    )
    assert n >= 20, f"Phase 02's 02-mini-build.md checks only {n} mini_vllm references"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_upstream_citations_hold_at_the_pin(doc: Path):
    problems, _ = check_upstream_citations(doc.read_text(encoding="utf-8"), _rel(doc))
    assert not problems, "\n".join(problems)


def test_the_deep_dive_cites_upstream_throughout():
    _, n = check_upstream_citations(
        (PHASE_03 / "01-deep-dive.md").read_text(encoding="utf-8"), "01-deep-dive.md"
    )
    assert n >= 60, f"the deep dive has only {n} checked upstream citations"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_mini_vllm_references_resolve(doc: Path):
    problems, _ = check_mini_references(doc.read_text(encoding="utf-8"), _rel(doc))
    assert not problems, "\n".join(problems)


def test_the_mini_build_names_its_symbols():
    _, n = check_mini_references(
        (PHASE_03 / "02-mini-build.md").read_text(encoding="utf-8"), "02-mini-build.md"
    )
    assert n >= 20, f"02-mini-build.md checks only {n} mini_vllm references"


def _examples() -> list[tuple[str, int, str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in EXAMPLE_RE.finditer(text):
            found.append((_rel(doc), text.count("\n", 0, m.start()) + 1, m["code"], m["out"]))
    return found


EXAMPLES = _examples()

# The examples that run only in the deep tier (`make test-deep`): each costs
# 10-60 s of a quiet core (a real model generating, a benchmark, or importing the
# pinned upstream where only a probe of upstream needs it), together
# about a third of all the examples' time. Keyed by doc and line, as the test
# ids are; test_every_deep_example_exists fails when a doc edit moves one.
DEEP_EXAMPLES = {
    "phases/00-foundations/00-guide.md:43",
    "phases/03-continuous-batching-scheduler/01-deep-dive.md:466",
    "phases/06-sampling-logits-processors/00-guide.md:455",
    "phases/06-sampling-logits-processors/EXERCISES.md:218",
    "phases/08-speculative-decoding/00-guide.md:315",
    "phases/08-speculative-decoding/EXERCISES.md:92",
    "phases/12-structured-outputs/00-guide.md:50",
    "phases/12-structured-outputs/01-deep-dive.md:320",
    "phases/12-structured-outputs/EXERCISES.md:22",
    "phases/18-performance/02-mini-build.md:174",
}


def test_the_docs_have_examples():
    assert len(EXAMPLES) >= 15, f"only {len(EXAMPLES)} runnable examples in the phase docs"


def test_every_deep_example_exists():
    ids = {f"{d}:{n}" for d, n, _, _ in EXAMPLES}
    assert DEEP_EXAMPLES <= ids, f"no example starts at {sorted(DEEP_EXAMPLES - ids)}"


@pytest.mark.parametrize(
    "doc, line, code, expected",
    [
        pytest.param(
            *e, id=f"{e[0]}:{e[1]}", marks=[pytest.mark.deep] * (f"{e[0]}:{e[1]}" in DEEP_EXAMPLES)
        )
        for e in EXAMPLES
    ],
)
def test_examples_print_what_the_docs_say(doc, line, code, expected, example_server):
    returncode, stdout, stderr = example_server(code)
    assert returncode == 0, f"{doc}:{line}: the example fails:\n{stderr[-3000:]}"
    assert stdout.rstrip() == expected.rstrip(), (
        f"{doc}:{line}: the example prints something else now; update the text block.\n"
        f"--- the doc says\n{expected}--- it prints\n{stdout}"
    )


@pytest.fixture(scope="module")
def example_server(tmp_path_factory):
    """run(code) -> (exit code, stdout, stderr) of ``code`` run as ``python -c``
    would, in a process forked from tests/upstream/example_server.py (torch
    already imported: 1.4 s saved on each example)."""
    server = subprocess.Popen(
        [sys.executable, "-c", (Path(__file__).parent / "example_server.py").read_text()],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    folder = tmp_path_factory.mktemp("example")
    out, err = folder / "stdout", folder / "stderr"

    def run(code: str, timeout: float = 300) -> tuple[int, str, str]:
        server.stdin.write(json.dumps({"code": code, "out": str(out), "err": str(err)}) + "\n")
        server.stdin.flush()
        pid = int(server.stdout.readline())
        if not select.select([server.stdout], [], [], timeout)[0]:
            os.killpg(pid, signal.SIGKILL)
            server.stdout.readline()
            pytest.fail(f"the example ran past {timeout:.0f} s")
        returncode = int(server.stdout.readline())
        return returncode, out.read_text(), err.read_text()

    yield run
    server.stdin.close()
    server.wait(30)


def test_the_example_server_runs_code_as_python_c_does(example_server):
    # What an example could see of its process, and how it ends: each must
    # be what a fresh `python -c` gives, or the docs' examples would not be
    # what a reader who pastes one gets.
    probe = (
        "import atexit, sys, threading, time\n"
        "print(__name__, sys.argv, repr(sys.path[0]), hash('block'), sys.stdout.isatty())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mini_vllm', 'vllm')))\n"
        "atexit.register(print, 'atexit ran')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread joined'))).start()\n"
        "def f(): pass\n"
        "print(f.__module__, sys.modules['__main__'].__dict__.get('f') is f, input.__module__)\n"
    )
    for code in (probe, probe + "raise SystemExit(3)\n", probe + "1 / 0\n"):
        fresh = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        returncode, stdout, stderr = example_server(code)
        assert (returncode, stdout) == (fresh.returncode, fresh.stdout)
        assert stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


# ---------------------------------------------- the checker rejects lies


GOOD = (
    "`Scheduler.schedule` (vllm/v1/core/sched/scheduler.py:329), "
    "vllm/v1/core/sched/scheduler.py:390 (reads `long_prefill_token_threshold`), "
    "`Scheduler._preempt_request` (vllm/v1/core/sched/scheduler.py:929-949), "
    "vllm/v1/core/sched/scheduler.py:456-487 (reads `SchedulingPolicy.PRIORITY`)."
)


def test_the_checker_accepts_true_citations():
    problems, n = check_upstream_citations(GOOD, "good")
    assert (problems, n) == ([], 4)


@pytest.mark.parametrize(
    "bad, complaint",
    [
        ("`Scheduler.schedule` (vllm/v1/core/sched/scheduler.py:330)", "should hold"),
        ("`Scheduler.update_from_output` (vllm/v1/core/sched/scheduler.py:329)", "should hold"),
        ("`Request.schedule` (vllm/v1/core/sched/scheduler.py:329)", "is defined at"),
        (
            "vllm/v1/core/sched/scheduler.py:391 (reads `long_prefill_token_threshold <`)",
            "should contain",
        ),
        ("vllm/v1/core/sched/scheduler.py:99999 (reads `x`)", "past the end"),
        ("vllm/v1/core/sched/scheduler.py:390", "unchecked form"),
        ("see vllm/v1/core/sched/scheduler.py:390-397", "unchecked form"),
        (
            "`Scheduler._preempt_request` (vllm/v1/core/sched/scheduler.py:929-951)",
            "must end inside",
        ),
        (
            "vllm/v1/core/sched/scheduler.py:945-955 (reads `if self.log_stats`)",
            "runs past the end",
        ),
        ("vllm/v1/core/sched/scheduler.py:397-390 (reads `max_model_len`)", "run forward"),
        ("upstream inlines it at scheduler.py:390", "only upstream files"),
        ("mini_vllm/core/sched/scheduler.py:120", "only upstream files"),
    ],
)
def test_the_checker_rejects_false_citations(bad, complaint):
    problems, _ = check_upstream_citations(bad, "bad")
    assert problems and complaint in problems[0], problems


@pytest.mark.parametrize(
    "bad, complaint",
    [
        ("mini_vllm/core/sched/schedular.py", "does not exist"),
        ("`Scheduler._preempt` (`mini_vllm/core/sched/scheduler.py`)", "defines no"),
        ("`mini_vllm.core.sched.scheduler.Scheduler.no_such_method`", "has no"),
        ("`mini_vllm/no_such_folder/`", "does not exist"),
    ],
)
def test_the_checker_rejects_false_mini_references(bad, complaint):
    problems, _ = check_mini_references(bad, "bad")
    assert problems and complaint in problems[0], problems
