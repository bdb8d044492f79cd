"""A mini_vllm symbol beside upstream vLLM's, at the pin (project tooling, not the mirror).

``python -m mini_vllm.grading diff Scheduler.schedule`` finds the symbol in
UPSTREAM_PIN.md's symbol map, reads both definitions with ``ast`` (upstream
from the installed wheel's files: vllm is never imported) and prints them side
by side with line numbers; ``>`` marks the cited upstream line (for an
"inline" row, a line inside the enclosing def shown). Then: where to look.
``--impl labs`` puts the student's starter on the left: the latest
``labs/phase_NN/*.py`` (``$MINI_VLLM_LABS_DIR`` overrides ``labs/``) that
defines the symbol; if none does, the student inherits the reference's.
The map's format and ``definitions`` are shared with tests/upstream/test_pin_map.py.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import itertools
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN_DOC = REPO_ROOT / "UPSTREAM_PIN.md"
PIN_COMMIT_ID = "g0decac0d9"  # what the pinned wheel's vllm/_version.py records

TABLE_HEADER = "| mini_vllm symbol | upstream symbol | upstream file:line | note |"
INLINE_MARK = "inline (no def upstream)"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_QUAL = rf"{_IDENT}(?:\.{_IDENT})*"
_PATH = r"vllm/[A-Za-z0-9_/]+\.py"
ROW_RE = re.compile(
    rf"^\| `(?P<mini>mini_vllm\.{_QUAL})` \| `(?P<up>{_QUAL})` "
    rf"\| `(?P<path>{_PATH}):(?P<line>[1-9][0-9]*)` \|(?P<note>[^|]*)\|$"
)


@dataclass(frozen=True)
class Row:
    lineno: int  # in UPSTREAM_PIN.md, for messages
    mini: str
    upstream: str
    path: str
    line: int
    note: str

    @property
    def inline(self) -> bool:
        return self.note.startswith(INLINE_MARK)


def symbol_map(text: str) -> list[Row]:
    """The well-formed rows of the table headed TABLE_HEADER (the test rejects the others)."""
    rows, in_table = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() == TABLE_HEADER:
            in_table = True
        elif in_table and not line.startswith("|"):
            break
        elif in_table and (m := ROW_RE.match(line.rstrip())):
            rows.append(Row(n, m["mini"], m["up"], m["path"], int(m["line"]), m["note"].strip()))
    return rows


def definitions(tree: ast.AST) -> dict[str, list[ast.AST]]:
    """Qualified name -> its class/def nodes, also inside ``if``/``try`` blocks."""
    out: dict[str, list[ast.AST]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(prefix + child.name, []).append(child)
                visit(child, prefix + child.name + ".")
            elif not isinstance(child, ast.expr):
                visit(child, prefix)

    visit(tree, "")
    return out


def _find(path: Path, qual: str, line: int | None = None) -> ast.AST | None:
    """The definition of ``qual`` in ``path`` (the one spanning ``line``, if given)."""
    nodes = definitions(ast.parse(path.read_text(encoding="utf-8"), str(path))).get(qual, [])
    nodes = [n for n in nodes if line is None or n.lineno <= line <= n.end_lineno]
    return nodes[0] if nodes else None


def _mini_file(symbol: str) -> tuple[Path, str]:
    """(the .py file defining a mini_vllm symbol, the symbol's name inside it)."""
    parts = symbol.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        base = REPO_ROOT.joinpath(*parts[:cut])
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f, ".".join(parts[cut:])
    raise LookupError(f"no module file for {symbol}")


def _vllm_root() -> Path | None:
    """The folder holding the installed vllm package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def _labs_def(qual: str) -> tuple[Path, ast.AST] | None:
    """The student's definition of ``qual`` in a labs starter, latest phase first."""
    labs = Path(os.environ.get("MINI_VLLM_LABS_DIR") or REPO_ROOT / "labs")
    for f in sorted(labs.glob("phase_*/*.py"), reverse=True):
        try:
            if node := _find(f, qual):
                return f, node
        except SyntaxError as e:
            print(
                f"warning: skipped {f}: it does not parse (line {e.lineno}: {e.msg})",
                file=sys.stderr,
            )
    return None


def _show(path: Path) -> str:
    root = next((r for r in (_vllm_root(), REPO_ROOT) if r and path.is_relative_to(r)), None)
    return str(path.relative_to(root)) if root else str(path)


def _column(
    title: str, path: Path, node: ast.AST, mark: int | None = None
) -> tuple[str, list[str]]:
    """A header ``title  file:start-end`` and the numbered source lines (decorators included)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    span = range(start, node.end_lineno + 1)
    body = [f"{'>' if n == mark else ' '}{n:>5}  {lines[n - 1].expandtabs()}" for n in span]
    return f"{title}  {_show(path)}:{start}-{node.end_lineno}", body


def side_by_side(
    left: tuple[str, list[str]], right: tuple[str, list[str]], width: int
) -> list[str]:
    col = max(20, (width - 3) // 2)

    def fit(s: str) -> str:
        return s if len(s) <= col else s[: col - 1] + "…"

    def fit_head(s: str) -> str:  # keep the title and the end of `file:start-end`
        title, where = s.split("  ", 1)
        return s if len(s) <= col else f"{title}  …{where[len(s) - col + 1 :]}"

    out = [fit_head(left[0]).ljust(col) + " │ " + fit_head(right[0]), "─" * col + "─┼─" + "─" * col]
    for a, b in itertools.zip_longest(left[1], right[1], fillvalue=""):
        out.append((fit(a).ljust(col) + " │ " + fit(b)).rstrip())
    return out


def differences(name: str, doc: str) -> list[str]:
    """First lines of the "Deliberate differences" bullets that quote ``name`` (or ``X.name``)."""
    section = doc.split("\n## Deliberate differences", 1)[-1].split("\n## ", 1)[0]
    quoted = re.compile(rf"`(?:[\w.]*\.)?{re.escape(name)}`")
    return [
        b.splitlines()[0]
        for b in re.split(r"\n(?=- )", section)
        if b.startswith("- ") and quoted.search(b)
    ]


def _fail(*lines: str) -> int:
    print("\n".join(lines), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mini_vllm.grading diff", description=__doc__.splitlines()[0]
    )
    p.add_argument("symbol", help="e.g. Scheduler.schedule, check_stop, or a full mini_vllm path")
    p.add_argument(
        "--impl",
        choices=("ref", "labs"),
        default="ref",
        help="left: the reference, or the student's code",
    )
    p.add_argument("--width", type=int, help="total width (default: the terminal's)")
    args = p.parse_args(argv)

    vllm_root = _vllm_root()
    if vllm_root is None:
        return _fail("error: the pinned upstream vllm is not installed; run `make upstream` first.")
    if PIN_COMMIT_ID not in (vllm_root / "vllm" / "_version.py").read_text(encoding="utf-8"):
        print(
            f"warning: the installed vllm is not the pin ({PIN_COMMIT_ID}); lines may be off.",
            file=sys.stderr,
        )

    doc = PIN_DOC.read_text(encoding="utf-8")
    rows = symbol_map(doc)
    hits = [r for r in rows if r.mini == args.symbol or r.mini.endswith("." + args.symbol)]
    if len(hits) > 1:
        return _fail(
            f"{args.symbol!r} matches {len(hits)} rows of the symbol map; name one of:",
            *(f"  {r.mini}" for r in hits),
        )
    if not hits:
        k = args.symbol.count(".") + 1  # compare like with like: `Class.method` with `Class.method`
        names = sorted({".".join(r.mini.split(".")[-k:]) for r in rows} | {r.mini for r in rows})
        close = difflib.get_close_matches(args.symbol, names, n=5, cutoff=0.6)
        return _fail(
            f"{args.symbol!r} is not in UPSTREAM_PIN.md's symbol map.",
            f"Did you mean: {', '.join(close)}?" if close else "Try a full mini_vllm.… path.",
        )
    (row,) = hits

    mini_path, qual = _mini_file(row.mini)
    mini_node = _find(mini_path, qual)
    up_path = vllm_root / row.path
    up_node = _find(up_path, row.upstream, row.line) if up_path.is_file() else None
    if mini_node is None or up_node is None:
        where = (
            f"{_show(mini_path)}: {qual}"
            if mini_node is None
            else f"{row.path}:{row.line}: {row.upstream}"
        )
        return _fail(f"error: UPSTREAM_PIN.md:{row.lineno} is stale: no definition at {where}")

    out: list[str] = []
    left = _column("reference", mini_path, mini_node)
    if args.impl == "labs":
        if found := _labs_def(qual):
            left = _column("student", *found)
        else:
            out += [
                f"No labs starter defines {qual}: the student's code inherits the reference's, "
                "shown left.",
                "",
            ]
    right = _column("upstream 0.22.1", up_path, up_node, mark=row.line)
    out += side_by_side(left, right, args.width or shutil.get_terminal_size((120, 24)).columns)

    out += [
        "",
        "Where to look",
        f"  upstream  {row.path}:{row.line}  ({row.upstream}; `>` marks the cited line)",
    ]
    out += [f"            {up_path}:{row.line}"] + ([f"  note      {row.note}"] if row.note else [])
    if bullets := differences(qual.rsplit(".", 1)[-1], doc):
        out += ['  UPSTREAM_PIN.md, "Deliberate differences":'] + [f"    {b}" for b in bullets]
    try:
        print("\n".join(out))
    except BrokenPipeError:  # `| head` stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
