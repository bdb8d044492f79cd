"""UPSTREAM_PIN.md agrees with the installed upstream pin and with mini_vllm.

What is checked:

- the installed vllm is 0.22.1 and its ``_version.py`` records commit
  ``g0decac0d9``; UPSTREAM_PIN.md states the full 40-digit commit;
- the symbol map (the table under "## Symbol map") is well formed: every row
  matches the strict four-column format, and no mini_vllm symbol appears in
  two rows;
- each row's mini_vllm symbol imports, and is *defined* at that path (a
  re-export does not count), in one of the core modules listed in CORE_MODULES;
- each row's upstream line holds ``class <Name>`` or ``def <name>(`` for the
  last part of the row's upstream symbol, and the upstream module's syntax
  tree has a definition with that qualified name starting on that line. A
  row whose note begins with ``inline (no def upstream)`` is different: its
  line must contain the note's first back-quoted text, and must lie inside
  the definition of the row's upstream symbol;
- every other ``vllm/<path>.py:<line>`` anywhere in the file is in one of two
  checked forms. One is a back-quoted qualified name followed by
  ``(vllm/x.py:N)``, checked as a definition like the rows are. The other is
  ``vllm/x.py:N (reads `text`)``, where line N must contain the text. A line
  citation in any other form fails the test, so the prose cannot drift unnoticed;
- coverage: every public class, function and method defined in
  CORE_MODULES has a row.

Coverage rules (what counts as "public" for the last check):

- the source is read with ``ast``. Only what is written in the module counts,
  so imports, re-exports and dataclass-generated methods (``__init__``,
  ``__eq__``, ...) never count;
- top-level ``class`` and ``def`` statements, and ``def`` statements directly
  in a top-level class body (methods, staticmethods, classmethods), count;
- a name starting with ``_`` does not count, so private helpers and dunders
  are exempt;
- properties (``@property`` and ``@x.setter``/``getter``/``deleter``) do not
  count: they read as attributes. Functions nested inside functions, module
  constants, dataclass fields and enum members do not count either;
- the exempt symbols MAY still have rows (the map lists properties and the
  private methods that have an upstream twin), and such rows are checked like
  any other.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
from functools import cache
from pathlib import Path

import pytest

from mini_vllm.grading.diff_upstream import INLINE_MARK, ROW_RE, TABLE_HEADER, Row, definitions

# Collected even where vllm is missing: the conftest then skips the
# `upstream` tests with a visible reason (or refuses to run at all under
# MINI_VLLM_REQUIRE_UPSTREAM). When vllm is installed but cannot be imported,
# skip the module, unless the pin is required, in which case fail loudly.
if importlib.util.find_spec("vllm") is None:
    vllm = None
elif os.environ.get("MINI_VLLM_REQUIRE_UPSTREAM"):
    import vllm
else:
    vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.upstream

PIN_VERSION = "0.22.1"
PIN_COMMIT = "0decac0d96c42b49572498019f0a0e3600f50398"
PIN_COMMIT_ID = "g" + PIN_COMMIT[:9]  # what the wheel's _version.py records

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN_DOC = REPO_ROOT / "UPSTREAM_PIN.md"

# The modules whose every public symbol must be mapped (paths under mini_vllm/).
CORE_MODULES = (
    "request.py",
    "sampling_params.py",
    "config.py",
    "outputs.py",
    "engine/__init__.py",
    "metrics/stats.py",
    "core/kv_cache_utils.py",
    "core/block_pool.py",
    "core/kv_cache_manager.py",
    "core/sched/output.py",
    "core/sched/request_queue.py",
    "core/sched/utils.py",
    "core/sched/interface.py",
    "core/sched/scheduler.py",
    "core/sched/async_scheduler.py",
    "spec_decode/metrics.py",
    "utils/hashing.py",
    "structured_output/__init__.py",
    "structured_output/backend_types.py",
    "structured_output/backend_xgrammar.py",
    "structured_output/request.py",
    "structured_output/utils.py",
    "multimodal/inputs.py",
    "core/encoder_cache_manager.py",
)

# The map's row format (ROW_RE, Row) and the ast walk are shared with the
# `diff` tool, so the two cannot read the table differently.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_QUAL = rf"{_IDENT}(?:\.{_IDENT})*"
_PATH = r"vllm/[A-Za-z0-9_/]+\.py"
# Checked citation forms in prose and notes. Whitespace may include a line break.
DEF_CITE_RE = re.compile(rf"`(?P<qual>{_QUAL})`\s+\((?P<path>{_PATH}):(?P<line>\d+)\)")
READS_CITE_RE = re.compile(rf"(?P<path>{_PATH}):(?P<line>\d+)\s+\(reads\s+`(?P<text>[^`]+)`\)")
ANY_CITE_RE = re.compile(rf"{_PATH}:\d+")


def _module_name(rel: str) -> str:
    name = "mini_vllm." + rel.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


CORE_MODULE_NAMES = {_module_name(rel): rel for rel in CORE_MODULES}


# ---------------------------------------------------------------- helpers


@cache
def _doc_text() -> str:
    return PIN_DOC.read_text(encoding="utf-8")


@cache
def _parse_table() -> tuple[tuple[Row, ...], tuple[tuple[int, int], ...]]:
    """The map's rows, and the (start, end) doc line span the table occupies."""
    lines = _doc_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == TABLE_HEADER]
    assert len(starts) == 1, (
        f"expected exactly one table headed {TABLE_HEADER!r}, found {len(starts)}"
    )
    start = starts[0]
    assert re.fullmatch(r"\|(?: *-+ *\|){4}", lines[start + 1].strip()), (
        f"UPSTREAM_PIN.md:{start + 2}: the header must be followed by a |---|---|---|---| line"
    )
    rows: list[Row] = []
    bad: list[str] = []
    end = start + 2
    while end < len(lines) and lines[end].startswith("|"):
        text = lines[end].rstrip()
        m = ROW_RE.match(text)
        if m is None:
            bad.append(f"UPSTREAM_PIN.md:{end + 1}: {text}")
        else:
            rows.append(
                Row(
                    lineno=end + 1,
                    mini=m["mini"],
                    upstream=m["up"],
                    path=m["path"],
                    line=int(m["line"]),
                    note=m["note"].strip(),
                )
            )
        end += 1
    assert not bad, "rows not in the strict format:\n" + "\n".join(bad)
    assert rows, "the symbol map is empty"
    return tuple(rows), ((start, end),)


def _rows() -> tuple[Row, ...]:
    return _parse_table()[0]


def _vllm_dir() -> Path:
    assert vllm is not None
    return Path(os.path.dirname(vllm.__file__))


def _upstream_file(rel: str) -> Path:
    # rel starts with "vllm/"; the package dir is .../site-packages/vllm.
    return _vllm_dir().parent / rel


@cache
def _upstream_lines(rel: str) -> tuple[str, ...]:
    path = _upstream_file(rel)
    assert path.is_file(), f"{rel} does not exist in the installed vllm ({path})"
    return tuple(path.read_text(encoding="utf-8").splitlines())


@cache
def _upstream_defs(rel: str) -> dict[str, tuple[tuple[int, int], ...]]:
    """qualified name -> ((def line, end line), ...) for classes and functions."""
    tree = ast.parse("\n".join(_upstream_lines(rel)) + "\n", filename=rel)
    # lineno is the `class`/`def` line itself, not a decorator's.
    return {
        qual: tuple((n.lineno, n.end_lineno) for n in nodes)
        for qual, nodes in definitions(tree).items()
    }


def _check_def(qual: str, rel: str, line: int) -> str | None:
    """None if ``rel:line`` is where ``qual`` is defined; else why not."""
    lines = _upstream_lines(rel)
    if not 1 <= line <= len(lines):
        return f"{rel}:{line} is past the end of the file ({len(lines)} lines)"
    text = lines[line - 1]
    name = qual.rsplit(".", 1)[-1]
    if not re.search(rf"\b(class {re.escape(name)}\b|def {re.escape(name)}\()", text):
        return (
            f"{rel}:{line} should hold `class {name}` or `def {name}(`, but reads: {text.strip()!r}"
        )
    spans = _upstream_defs(rel).get(qual, ())
    if line not in {s for s, _ in spans}:
        where = ", ".join(str(s) for s, _ in spans) or "nowhere"
        return f"{rel}:{line} holds a `{name}`, but `{qual}` is defined at line(s) {where} of {rel}"
    return None


def _check_reads(rel: str, line: int, expected: str) -> str | None:
    lines = _upstream_lines(rel)
    if not 1 <= line <= len(lines):
        return f"{rel}:{line} is past the end of the file ({len(lines)} lines)"
    text = lines[line - 1]
    if expected not in text:
        return f"{rel}:{line} should contain {expected!r}, but reads: {text.strip()!r}"
    return None


def _resolve_mini(symbol: str) -> tuple[str, object]:
    """Import the longest importable module prefix of ``symbol``, then getattr
    the rest. Returns (module name, object), or fails naming the symbol."""
    parts = symbol.split(".")
    for cut in range(len(parts), 0, -1):
        modname = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name is not None and (modname == e.name or modname.startswith(e.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise
        for attr in parts[cut:]:
            try:
                # Class __dict__ first, so properties/staticmethods come back raw.
                obj = (
                    vars(obj)[attr]
                    if isinstance(obj, type) and attr in vars(obj)
                    else getattr(obj, attr)
                )
            except (AttributeError, KeyError):
                pytest.fail(
                    f"mini_vllm symbol {symbol!r} does not exist: {modname} has no "
                    f"{'.'.join(parts[cut:])!r}"
                )
        return modname, obj
    pytest.fail(f"mini_vllm symbol {symbol!r} does not exist: no importable module prefix")


def _defining_function(obj: object):
    if isinstance(obj, property):
        return obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    return obj


def _mini_public_symbols() -> dict[str, str]:
    """symbol -> kind, per the coverage rules in the module docstring."""
    found: dict[str, str] = {}
    for modname, rel in CORE_MODULE_NAMES.items():
        path = REPO_ROOT / "mini_vllm" / rel
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not node.name.startswith("_"):
                    found[f"{modname}.{node.name}"] = "function"
            elif isinstance(node, ast.ClassDef):
                if node.name.startswith("_"):
                    continue
                found[f"{modname}.{node.name}"] = "class"
                for item in node.body:
                    if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    if item.name.startswith("_") or _is_property(item):
                        continue
                    found[f"{modname}.{node.name}.{item.name}"] = "method"
    return found


def _is_property(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Name) and dec.id in ("property", "cached_property"):
            return True
        if isinstance(dec, ast.Attribute) and dec.attr in (
            "setter",
            "getter",
            "deleter",
            "cached_property",
        ):
            return True
    return False


# ------------------------------------------------------------------ tests


def test_installed_vllm_is_the_pin():
    from vllm import _version

    assert vllm.__version__ == PIN_VERSION, (
        f"installed vllm is {vllm.__version__}, the pin is {PIN_VERSION}"
    )
    commit_id = _version.__commit_id__
    assert commit_id is not None and commit_id.startswith(PIN_COMMIT_ID), (
        f"installed vllm records commit {commit_id!r}; the pin is {PIN_COMMIT} ({PIN_COMMIT_ID})"
    )
    # The same file, read as text: the version module is where the wheel says.
    version_py = (_vllm_dir() / "_version.py").read_text(encoding="utf-8")
    assert f"'{PIN_COMMIT_ID}'" in version_py


def test_doc_states_the_full_commit_and_version():
    text = _doc_text()
    assert PIN_COMMIT in text, f"UPSTREAM_PIN.md must state the full commit {PIN_COMMIT}"
    assert PIN_COMMIT_ID in text
    assert f"vllm=={PIN_VERSION}" in text
    # No other 40-hex commit may creep in beside it.
    others = set(re.findall(r"\b[0-9a-f]{40}\b", text)) - {PIN_COMMIT}
    assert not others, f"UPSTREAM_PIN.md names other commits: {sorted(others)}"
    # The doc's version and commit agree with what this test pins.
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    assert f"vllm.__version__ == '{PIN_VERSION}'" in makefile
    nodeps = (REPO_ROOT / "tests" / "upstream" / "requirements-nodeps.txt").read_text(
        encoding="utf-8"
    )
    assert f"vllm=={PIN_VERSION}" in nodeps.split()


def test_table_rows_are_unique_and_core_only():
    rows = _rows()
    seen: dict[str, int] = {}
    dupes = []
    for row in rows:
        if row.mini in seen:
            dupes.append(f"{row.mini} (UPSTREAM_PIN.md:{seen[row.mini]} and :{row.lineno})")
        seen[row.mini] = row.lineno
    assert not dupes, "symbols mapped twice: " + ", ".join(dupes)
    outside = [
        f"UPSTREAM_PIN.md:{r.lineno}: {r.mini}"
        for r in rows
        if not any(r.mini.startswith(m + ".") for m in CORE_MODULE_NAMES)
    ]
    assert not outside, "rows for symbols outside the core modules:\n" + "\n".join(outside)


def test_every_row_names_an_existing_mini_symbol():
    problems = []
    for row in _rows():
        modname, obj = _resolve_mini(row.mini)
        fn = _defining_function(obj)
        rest = row.mini[len(modname) + 1 :]
        got_mod = getattr(fn, "__module__", None)
        got_qual = getattr(fn, "__qualname__", None)
        if modname not in CORE_MODULE_NAMES:
            # e.g. mini_vllm.core.sched.Scheduler through a package import
            problems.append(f"{row.mini}: resolved through {modname}, not a core module")
        elif (got_mod, got_qual) != (modname, rest):
            problems.append(
                f"{row.mini}: found, but defined as {got_mod}.{got_qual} (a re-export or alias?)"
            )
    assert not problems, "\n".join(problems)


def test_every_row_cites_the_upstream_definition():
    problems = []
    for row in _rows():
        where = f"UPSTREAM_PIN.md:{row.lineno} ({row.mini})"
        if row.inline:
            quoted = re.findall(r"`([^`]+)`", row.note)
            if not quoted:
                problems.append(
                    f"{where}: an inline row needs the expected text back-quoted in its note"
                )
                continue
            why = _check_reads(row.path, row.line, quoted[0])
            if why is None:
                spans = _upstream_defs(row.path).get(row.upstream, ())
                if not any(start < row.line <= end for start, end in spans):
                    why = f"{row.path}:{row.line} is not inside `{row.upstream}`"
        else:
            why = _check_def(row.upstream, row.path, row.line)
        if why:
            problems.append(f"{where}: {why}")
    assert not problems, "\n".join(problems)


def test_the_clamp_row_is_the_inline_threshold_line():
    (row,) = [r for r in _rows() if r.mini.endswith("Scheduler._clamp_new_tokens")]
    assert row.inline, "_clamp_new_tokens has no upstream def: its note must start with " + repr(
        INLINE_MARK
    )
    assert row.upstream == "Scheduler.schedule"
    assert row.path == "vllm/v1/core/sched/scheduler.py"
    assert "long_prefill_token_threshold" in _upstream_lines(row.path)[row.line - 1]


def test_every_line_citation_in_the_doc_is_checked():
    """Prose and notes may cite upstream lines only in the two checked forms."""
    text = _doc_text()
    lines = text.splitlines(keepends=True)
    ((start, end),) = _parse_table()[1]
    # Blank out the table's file:line column (checked by the row tests), keep its notes.
    masked_lines = []
    for i, line in enumerate(lines):
        if start + 2 <= i < end:
            m = ROW_RE.match(line.rstrip())
            if m:
                line = (
                    line[: m.start("path")]
                    + " " * (m.end("line") - m.start("path"))
                    + line[m.end("line") :]
                )
        masked_lines.append(line)
    masked = "".join(masked_lines)

    covered: list[tuple[int, int]] = []
    problems = []
    n_checked = 0
    for m in DEF_CITE_RE.finditer(masked):
        covered.append(m.span("path"))
        n_checked += 1
        why = _check_def(m["qual"], m["path"], int(m["line"]))
        if why:
            problems.append(f"UPSTREAM_PIN.md:{masked.count(chr(10), 0, m.start()) + 1}: {why}")
    for m in READS_CITE_RE.finditer(masked):
        covered.append(m.span("path"))
        n_checked += 1
        text_expected = m["text"]
        why = _check_reads(m["path"], int(m["line"]), text_expected)
        if why:
            problems.append(f"UPSTREAM_PIN.md:{masked.count(chr(10), 0, m.start()) + 1}: {why}")
    for m in ANY_CITE_RE.finditer(masked):
        if not any(a <= m.start() < b for a, b in covered):
            problems.append(
                f"UPSTREAM_PIN.md:{masked.count(chr(10), 0, m.start()) + 1}: {m.group()} is cited "
                "in an unchecked form; write `Qual.name` (path:N) or path:N (reads `text`)"
            )
    assert not problems, "\n".join(problems)
    assert n_checked > 0


def test_every_public_core_symbol_is_mapped():
    mapped = {row.mini for row in _rows()}
    missing = sorted(
        f"{sym} ({kind})" for sym, kind in _mini_public_symbols().items() if sym not in mapped
    )
    assert not missing, (
        "public mini_vllm symbols with no row in UPSTREAM_PIN.md's symbol map "
        "(add a row citing the upstream class/def):\n" + "\n".join(missing)
    )
