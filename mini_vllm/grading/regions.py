"""Lab regions: find them in the reference, write starters, splice code back in.

A lab region is a block of the reference source between two comments::

    # BEGIN LAB 03.2: a short title
    ...reference code...
    # END LAB 03.2

A region is either one whole ``def`` (its markers sit around it) or a run of
statements inside a function. The starter for a reference module keeps the
functions that hold regions and nothing else of the reference's code: each
region becomes its markers, the ``def`` line and docstring when the region is
a whole function, the ``# HINT:`` comments, and a ``raise
NotImplementedError("Lab 03.2: ...")``. Classes are re-opened by subclassing
the reference class, so everything outside the holes is the reference's.

Splicing goes the other way: it replaces the code inside a file's regions
with other code (the reference's, to solve a starter or to grade one lab
with the other labs' regions filled in).

Keeping starters current (``update``, ``stale_files``): a region "holds
student code" unless it holds only what a stub holds (comments, the ``def``
line and docstring, the placeholders, the ``raise``). Bringing a starter up to
date rewrites everything else, hints and stubs included, and carries the
student's regions over unchanged; when that cannot be done (the lab markers
changed, or the ``def`` line or docstring of a function holding student code
changed) the file is left alone and named. A starter is stale when updating
it would change it.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO_ROOT / "mini_vllm"
LABS_PACKAGE = "labs"

BEGIN = re.compile(r"^(?P<indent>[ ]*)# BEGIN LAB (?P<lab>\d\d\.\d+)(?::\s*(?P<title>.*?))?\s*$")
END = re.compile(r"^(?P<indent>[ ]*)# END LAB (?P<lab>\d\d\.\d+)\s*$")
HINT = re.compile(r"^\s*# HINT:")
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)  # a region may live in either


class RegionError(ValueError):
    """Markers that do not pair up, or code the generator cannot handle."""


@dataclass
class Region:
    lab: str  # "03.2"
    title: str
    begin: int  # index of the BEGIN line (0-based)
    end: int  # index of the END line
    indent: str

    @property
    def phase(self) -> str:
        return self.lab.split(".")[0]


def find_regions(lines: list[str], where: str = "<source>") -> list[Region]:
    """The regions of a file, in order; markers must pair up and not nest."""
    regions: list[Region] = []
    open_region: Region | None = None
    for i, line in enumerate(lines):
        if m := BEGIN.match(line):
            if open_region is not None:
                raise RegionError(
                    f"{where}:{i + 1}: BEGIN LAB {m['lab']} inside LAB "
                    f"{open_region.lab} (opened at line {open_region.begin + 1})"
                )
            open_region = Region(m["lab"], m["title"] or "", i, -1, m["indent"])
        elif m := END.match(line):
            if open_region is None or m["lab"] != open_region.lab:
                raise RegionError(f"{where}:{i + 1}: END LAB {m['lab']} without a matching BEGIN")
            if m["indent"] != open_region.indent:
                raise RegionError(
                    f"{where}:{i + 1}: END LAB {m['lab']} is indented differently from its BEGIN"
                )
            open_region.end = i
            regions.append(open_region)
            open_region = None
        elif line.lstrip().startswith(("# BEGIN LAB", "# END LAB")):
            raise RegionError(f"{where}:{i + 1}: malformed lab marker: {line.strip()!r}")
    if open_region is not None:
        raise RegionError(
            f"{where}:{open_region.begin + 1}: BEGIN LAB {open_region.lab} is never closed"
        )
    return regions


def reference_modules(phase: str | None = None) -> dict[Path, list[Region]]:
    """Every reference module holding regions (of ``phase``, if given)."""
    found = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        text = path.read_text()
        if "# BEGIN LAB" not in text or path.parent.name == "grading":
            continue
        regions = find_regions(text.splitlines(), str(path.relative_to(REPO_ROOT)))
        if phase is not None:
            regions = [r for r in regions if r.phase == phase]
        if regions:
            found[path] = regions
    return found


def phases() -> list[str]:
    return sorted({r.phase for regions in reference_modules().values() for r in regions})


def labs_of(phase: str) -> dict[str, str]:
    """{lab id: title} for a phase, in lab order (the first title given wins)."""
    titles: dict[str, str] = {}
    for regions in reference_modules(phase).values():
        for r in regions:
            if not titles.get(r.lab):
                titles[r.lab] = r.title
    return dict(sorted(titles.items(), key=lambda kv: int(kv[0].split(".")[1])))


def module_name(path: Path) -> str:
    """``mini_vllm/x/y.py`` -> ``mini_vllm.x.y``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path:
    """The reverse of ``module_name``: the module's file, or its package's ``__init__.py``."""
    path = REPO_ROOT / Path(*name.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"


def starter_stem(reference: Path) -> str:
    """A starter's module name: the reference file's, or for a package's
    ``__init__.py`` the package's (``structured_output/__init__.py`` ->
    ``structured_output.py``), since each phase's folder has its own ``__init__.py``."""
    return reference.parent.name if reference.stem == "__init__" else reference.stem


def starter_relpath(phase: str, reference: Path) -> Path:
    """Where a reference module's starter lives, relative to the labs folder."""
    return Path(f"phase_{phase}") / f"{starter_stem(reference)}.py"


def starter_module_name(phase: str, reference: Path) -> str:
    return f"{LABS_PACKAGE}.phase_{phase}.{starter_stem(reference)}"


# ------------------------------------------------------------------ starters

LINE_LENGTH = 100  # the project's (pyproject.toml): starters are linted like the rest
FIRST_PARTY = {"mini_vllm", LABS_PACKAGE}


def _owner(tree: ast.Module, region: Region):
    """(class name or None, function node, whole) for the function a region
    lives in or is. Line numbers in ``ast`` are 1-based; region indices are
    0-based."""
    first, last = region.begin + 2, region.end  # the lines between the markers
    candidates = []
    for node in tree.body:
        if isinstance(node, FUNCTIONS):
            candidates.append((None, node))
        elif isinstance(node, ast.ClassDef):
            candidates += [(node.name, f) for f in node.body if isinstance(f, FUNCTIONS)]
    for cls, fn in candidates:
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        if start >= first and fn.end_lineno <= last:
            return cls, fn, True  # the region is this whole function
        if fn.body[0].lineno <= first and last <= fn.end_lineno:
            return cls, fn, False  # the region is inside its body
    raise RegionError(
        f"LAB {region.lab} (line {region.begin + 1}) is neither a whole "
        "function nor inside a top-level function or method"
    )


def _inside(line: int, region: Region) -> bool:
    """Whether 1-based ``line`` lies between a region's markers."""
    return region.begin + 1 < line < region.end + 1


def region_contract(fn: ast.FunctionDef, region: Region) -> list[str]:
    """The names a region inside a function body must leave defined: those it
    binds that the rest of the function reads (after it, or anywhere in a loop
    around it). Its first ``# HINT:`` must name each of them."""
    loops = [
        n
        for n in ast.walk(fn)
        if isinstance(n, (ast.For, ast.While))
        and n.lineno <= region.begin
        and region.end + 1 <= n.end_lineno
    ]
    bound, read_later = set(), set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Name):
            continue
        if _inside(node.lineno, region):
            if isinstance(node.ctx, ast.Store):
                bound.add(node.id)
        elif isinstance(node.ctx, ast.Load) and (
            node.lineno > region.end
            or any(loop.lineno <= node.lineno <= loop.end_lineno for loop in loops)
        ):
            read_later.add(node.id)
    return sorted(bound & read_later)


def _first_hint(lines: list[str], region: Region) -> str:
    """The region's first hint sentence (it may run over several HINT lines)."""
    text = " ".join(
        HINT.sub("", line).strip()
        for line in lines[region.begin + 1 : region.end]
        if HINT.match(line)
    )
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def _check_contract(lines: list[str], region: Region, names: list[str], where: str) -> None:
    first = _first_hint(lines, region)
    missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", first)]
    if missing:
        raise RegionError(
            f"{where}:{region.begin + 1}: LAB {region.lab}'s first HINT sentence must name what "
            f"the region leaves defined for the code after it: {', '.join(missing)} "
            f"(first HINT sentence: {first!r})"
        )


def _quote(text: str) -> str:
    """A string literal as ruff format writes it (double quotes unless the
    text holds a double quote and no single one)."""
    if '"' in text and "'" not in text:
        return "'" + text.replace("\\", "\\\\") + "'"
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _raise_lines(indent: str, message: str, tail: str = "") -> list[str]:
    """``raise NotImplementedError(message)`` (then ``tail``) as ruff format
    writes it: on one line if it fits, else the message in pieces of at most
    LINE_LENGTH."""
    one = f"{indent}raise NotImplementedError({_quote(message)}){tail}"
    if len(one) <= LINE_LENGTH:
        return [one]
    inner = indent + " " * 4
    if len(inner + _quote(message)) <= LINE_LENGTH:
        return [f"{indent}raise NotImplementedError(", inner + _quote(message), indent + ")" + tail]
    chunks, words = [], message.split(" ")
    current = words.pop(0)
    for word in words:
        if len(inner) + len(_quote(current + " " + word + " ")) > LINE_LENGTH:
            chunks.append(current + " ")
            current = word
        else:
            current += " " + word
    chunks.append(current)
    pieces = [inner + _quote(c) for c in chunks]
    return [f"{indent}raise NotImplementedError(", *pieces, indent + ")" + tail]


def _stub(
    lines: list[str],
    region: Region,
    fn: ast.FunctionDef,
    whole: bool,
    starter_path: str,
    read_outside: set[str],
) -> list[str]:
    """The starter's replacement for a region's code (markers excluded): the
    ``def`` line and docstring of a whole-function region, the hints, a
    placeholder for each name of its contract that the starter reads outside
    the regions and nothing else binds, and the ``raise``."""
    body = lines[region.begin + 1 : region.end]
    kept: list[str] = []
    indent = region.indent
    if whole:
        doc = ast.get_docstring(fn) is not None
        head_end = fn.body[0].end_lineno if doc else fn.body[0].lineno - 1
        kept = lines[region.begin + 1 : head_end]
        indent = " " * fn.body[0].col_offset
    kept += [line for line in body if HINT.match(line)]
    if not whole:
        # Bound before the region (a binding further down, as in a later loop,
        # does not count: the code right after the region would read it unbound).
        bound_outside = {
            n.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.lineno <= region.begin
        } | {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        for name in region_contract(fn, region):
            if name not in bound_outside and name in read_outside:
                line = f"{indent}{name} = None  # yours to set: the code after the region reads it"
                # Within the line length ruff checks (100), deep in a loop too.
                kept.append(line if len(line) <= 100 else f"{indent}{name} = None  # yours to set")
    message = f"Lab {region.lab}: {region.title}" if region.title else f"Lab {region.lab}"
    # Inside an ``except`` block the stub raises ``from None`` (ruff's B904).
    in_handler = any(
        isinstance(n, ast.ExceptHandler) and n.lineno <= region.begin and region.end <= n.end_lineno
        for n in ast.walk(fn)
    )
    tail = " from None" if in_handler and not whole else ""
    kept += _raise_lines(indent, f"{message} ({starter_path})", tail)
    if whole:  # the blank lines between the function and its END marker
        kept += [""] * (len(body) - len("\n".join(body).rstrip("\n").split("\n")))
    return kept


def _read_outside(fn: ast.FunctionDef, regions: list[Region]) -> set[str]:
    """The names the function reads outside its (in-body) regions."""
    return {
        n.id
        for n in ast.walk(fn)
        if isinstance(n, ast.Name)
        and isinstance(n.ctx, ast.Load)
        and not any(_inside(n.lineno, r) for r in regions)
    }


def _unused_outside(fn: ast.FunctionDef, regions: list[Region]) -> dict[int, str]:
    """{line: rule} for the lines outside the regions that bind a name only a
    region reads: with the regions hollowed out, ruff would call it unused
    (F841 for an assignment, B007 for a loop variable)."""

    def in_region(node: ast.AST) -> bool:
        return any(_inside(node.lineno, r) for r in regions)

    read_outside = _read_outside(fn, regions)
    flagged: dict[int, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign | ast.AnnAssign) and not in_region(node):
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for t in targets if isinstance(t, ast.Name)]
            if any(t.id not in read_outside for t in targets):
                flagged[node.lineno] = "F841"
        elif isinstance(node, ast.For) and not in_region(node):
            names = [n for n in ast.walk(node.target) if isinstance(n, ast.Name)]
            if any(n.id not in read_outside for n in names):
                flagged[node.lineno] = "B007"
    return flagged


def _function_text(
    lines: list[str], fn: ast.FunctionDef, regions: list[tuple[Region, bool]], starter_path: str
) -> list[str]:
    """A holed function as the starter shows it: the reference's lines, each
    region replaced by its stub."""
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
    end = fn.end_lineno
    for region, whole in regions:
        if whole:
            start, end = min(start, region.begin), max(end, region.end + 1)
    lines = list(lines)
    in_body = [r for r, whole in regions if not whole]
    read_outside = _read_outside(fn, in_body)
    for lineno, rule in _unused_outside(fn, in_body).items():
        line = lines[lineno - 1]
        if m := re.search(
            r"# noqa: ([A-Z]+[0-9]+(?:, ?[A-Z]+[0-9]+)*)", line
        ):  # one noqa comment per line
            lines[lineno - 1] = line[: m.end(1)] + f", {rule}" + line[m.end(1) :]
        else:
            lines[lineno - 1] = line + f"  # noqa: {rule} (a lab region reads it)"
    out, i = [], start
    for region, whole in regions:
        out += lines[i : region.begin + 1]
        out += _stub(lines, region, fn, whole, starter_path, read_outside)
        out.append(lines[region.end])
        i = region.end + 1
    out += lines[i:end]
    return out


def _names_used(text: str) -> set[str]:
    """The names a piece of code reads, quoted annotations included."""
    names = set()
    for sub in ast.walk(ast.parse(text)):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        annotations = []
        if isinstance(sub, ast.arg | ast.AnnAssign):
            annotations.append(sub.annotation)
        elif isinstance(sub, FUNCTIONS):
            annotations.append(sub.returns)
        for ann in annotations:
            if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                names |= _names_used(ann.value)
    return names


def _section(module: str) -> int:
    """isort's sections, as ruff orders them: future, stdlib, third party, first party."""
    top = module.split(".")[0]
    if top == "__future__":
        return 0
    if top in sys.stdlib_module_names:
        return 1
    return 3 if top in FIRST_PARTY else 2


def _member_key(name: str) -> tuple:
    """isort's order-by-type: CONSTANTS, then Classes, then everything else."""
    kind = 0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name.lower(), name


def _import_lines(node: ast.Import | ast.ImportFrom, comment: str = "") -> list[str]:
    """One import statement, its names sorted, wrapped as ruff format wraps it."""
    aliases = sorted(node.names, key=lambda a: _member_key(a.asname or a.name))
    names = [a.name + (f" as {a.asname}" if a.asname else "") for a in aliases]
    if isinstance(node, ast.Import):
        return [f"import {n}{comment}" for n in names]
    one = f"from {node.module} import {', '.join(names)}"
    if len(one) <= LINE_LENGTH:  # ruff leaves a trailing pragma comment out of the width
        return [one + comment]
    return [f"from {node.module} import ({comment}", *[f"    {n}," for n in names], ")"]


def _import_block(statements: list[tuple[ast.Import | ast.ImportFrom, str]]) -> list[str]:
    """The starter's imports, sorted and grouped as ruff's isort rule wants them."""

    def key(item):
        node, _ = item
        module = node.names[0].name if isinstance(node, ast.Import) else node.module
        return _section(module), isinstance(node, ast.ImportFrom), module.lower(), module

    out: list[str] = []
    section = None
    for node, comment in sorted(statements, key=key):
        this = key((node, comment))[0]
        if section is not None and this != section:
            out.append("")
        section = this
        out += _import_lines(node, comment)
    return out


def _imports(
    tree: ast.Module, used: set[str], region_used: set[str], siblings: set[str], phase: str
) -> list[tuple[ast.Import | ast.ImportFrom, bool, str]]:
    """The reference's imports that the starter's code or the reference's
    regions use, sibling modules redirected to their starters; (statement,
    under ``if TYPE_CHECKING``, comment). A name only a region uses is kept for
    the student's code, with a noqa: the hollow starter does not read it."""
    found = [(n, False) for n in tree.body]
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            found += [(n, True) for n in node.body]
    out = []
    for node, type_checking in found:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        names = [(a.asname or a.name).split(".")[0] for a in node.names]
        keep = [a for a, n in zip(node.names, names, strict=True) if n in used | region_used]
        if not keep:
            continue
        for_regions = any(n not in used for n in names if n in region_used)
        comment = "  # noqa: F401 (a lab region uses it)" if for_regions else ""
        if isinstance(node, ast.ImportFrom):
            module = node.module
            if module in siblings:
                module = starter_module_name(phase, module_path(module))
            node = ast.ImportFrom(module=module, names=keep, level=0)
        else:
            node = ast.Import(names=keep)
        out.append((node, type_checking, comment))
    return out


def _header(phase: str, rel: str, regions: list[Region]) -> list[str]:
    """The starter's docstring: how to work in it, and every region of every lab."""
    by_lab: dict[str, list[str]] = {}
    for region in regions:
        by_lab.setdefault(region.lab, []).append(region.title or "(untitled)")
    listing = []
    for lab, titles in sorted(by_lab.items(), key=lambda kv: int(kv[0].split(".")[1])):
        listing.append(f"- {lab} (``make check-lab-{lab}``):")
        listing += [f"  - {title}" for title in titles]
    return [
        f'"""Phase {phase} lab starter, generated from',
        f"``{rel}``.",
        "",
        "Write your code between the ``# BEGIN LAB`` and ``# END LAB`` markers (keep the",
        "markers), then grade it with the lab's command below. Everything outside the",
        "regions is the reference's: the imports below bring it in, and each class",
        "here subclasses the reference class, re-opening only the methods that hold",
        "a lab. The hints are comments starting with ``# HINT:``; a region's first hint",
        "says what it receives and what it must leave defined for the code after it.",
        "",
        "Labs in this file, region by region:",
        *listing,
        "",
        "Generated by ``python -m mini_vllm.grading generate``.",
        '"""',
        "",
    ]


def _holed_functions(tree: ast.Module, lines: list[str], regions: list[Region], rel: str):
    """{(class or None, function name): (function node, [(region, whole)])}, in
    source order; each in-body region's contract is checked on the way."""
    owners: dict[tuple[str | None, str], tuple[ast.FunctionDef, list]] = {}
    for region in regions:
        cls, fn, whole = _owner(tree, region)
        if not whole:
            _check_contract(lines, region, region_contract(fn, region), rel)
        owners.setdefault((cls, fn.name), (fn, []))[1].append((region, whole))
    return owners


def _body(owners, lines: list[str], phase: str, starter_path: str) -> list[str]:
    """The holed functions, each class re-opened as a subclass of the reference's."""
    body: list[str] = []
    opened: set[str] = set()
    for (cls, _), (fn, regions) in owners.items():
        if cls is None:
            body += ["", ""] + _function_text(lines, fn, regions, starter_path)
            continue
        if cls not in opened:
            opened.add(cls)
            body += [
                "",
                "",
                f"class {cls}(_reference.{cls}):",
                f'    """The reference ``{cls}`` with its Phase {phase} lab methods re-opened."""',
            ]
        body += [""] + _function_text(lines, fn, regions, starter_path)
    return body


def _reexported(tree: ast.Module, holed: set[str]) -> list[str]:
    """Everything else the reference module defines at top level, so that the
    starter can stand in for it."""
    names = []
    for n in tree.body:
        if isinstance(n, (*FUNCTIONS, ast.ClassDef)):
            if n.name not in holed:
                names.append(n.name)
        elif isinstance(n, ast.Assign) and len(n.targets) == 1:
            if isinstance(n.targets[0], ast.Name):
                names.append(n.targets[0].id)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.append(n.target.id)
    return names


def _starter_imports(tree, owners, body, modname: str, siblings: set[str], phase: str):
    """The starter's import lines: the reference's imports it needs, the
    reference module as ``_reference`` when a class is re-opened, and a
    re-export of everything the starter does not redefine."""
    used = _names_used("\n".join(body))
    region_used = _names_used("\n".join(ast.unparse(fn) for fn, _ in owners.values()))
    imports = _imports(tree, used, region_used, siblings, phase)
    if any(type_checking for _, type_checking, _ in imports):
        imports = _imports(tree, used | {"TYPE_CHECKING"}, region_used, siblings, phase)
    statements = [(node, comment) for node, type_checking, comment in imports if not type_checking]
    holed_classes = {cls for cls, _ in owners if cls}
    if holed_classes:
        package, _, leaf = modname.rpartition(".")
        statements.append((ast.ImportFrom(package, [ast.alias(leaf, "_reference")], 0), ""))
    holed = holed_classes | {name for cls, name in owners if cls is None}
    if others := _reexported(tree, holed):
        node = ast.ImportFrom(modname, [ast.alias(n) for n in others], 0)
        statements.append((node, "  # noqa: F401"))
    lines = ["from __future__ import annotations", "", *_import_block(statements)]
    type_checking = [(node, comment) for node, tc, comment in imports if tc]
    if type_checking:
        lines += ["", "if TYPE_CHECKING:"]
        lines += ["    " + line for line in _import_block(type_checking)]
    return lines


def make_starter(reference: Path, phase: str, siblings: set[str]) -> str:
    """The starter module for ``reference``'s regions of ``phase``.

    ``siblings`` are the module names (``mini_vllm.x.y``) that also get a
    starter in this phase: imports from them are redirected to their starters.
    """
    text = reference.read_text()
    lines = text.splitlines()
    rel = str(reference.relative_to(REPO_ROOT))
    tree = ast.parse(text)
    # A module may hold regions of several phases (engine/core.py: 01.2 and
    # 14.2; core/sched/scheduler.py: 03.x and 08.1, some in one function);
    # each phase's starter re-opens only its own. Another phase's region in a
    # function this starter re-opens keeps the reference's code, without its
    # markers and hints (the starter is graded against this phase's markers).
    all_regions = find_regions(lines, rel)
    regions = [r for r in all_regions if r.phase == phase]
    lines = list(lines)
    for other in (r for r in all_regions if r.phase != phase):
        for i in range(other.begin, other.end + 1):
            if i in (other.begin, other.end) or HINT.match(lines[i]):
                lines[i] = _DROPPED
    owners = _holed_functions(tree, lines, regions, rel)
    starter_path = f"{LABS_PACKAGE}/{starter_relpath(phase, reference)}"
    body = [line for line in _body(owners, lines, phase, starter_path) if line != _DROPPED]
    imports = _starter_imports(tree, owners, body, module_name(reference), siblings, phase)
    return "\n".join(_header(phase, rel, regions) + imports + body) + "\n"


# Stands in for a line the starter leaves out (another phase's marker or hint),
# so that line numbers still match the reference's syntax tree until the end.
_DROPPED = "\x00dropped"


def starters(phase: str) -> dict[Path, str]:
    """{path relative to the labs folder: text} for every starter of a phase."""
    modules = reference_modules(phase)
    siblings = {module_name(p) for p in modules}
    names = [starter_stem(p) for p in modules]
    if len(set(names)) != len(names):
        raise RegionError(f"phase {phase}: two reference modules share a file name: {names}")
    init = f'"""Phase {phase} lab starters (generated; see each module\'s docstring)."""\n'
    out = {Path(f"phase_{phase}") / "__init__.py": init}
    for path in modules:
        out[starter_relpath(phase, path)] = make_starter(path, phase, siblings)
    return out


def all_starters() -> dict[Path, str]:
    out = {Path("__init__.py"): '"""Your workspace: one package of lab starters per phase."""\n'}
    for phase in phases():
        out.update(starters(phase))
    return out


# ------------------------------------------------------------------ splicing


def region_code(lines: list[str], regions: list[Region]) -> list[list[str]]:
    return [lines[r.begin + 1 : r.end] for r in regions]


def splice(text: str, replacements: dict[int, list[str]], where: str = "<source>") -> str:
    """``text`` with the code of region number i (in file order) replaced by
    ``replacements[i]``; regions not named keep their code."""
    lines = text.splitlines()
    regions = find_regions(lines, where)
    out, i = [], 0
    for k, region in enumerate(regions):
        out += lines[i : region.begin + 1]
        out += replacements.get(k, lines[region.begin + 1 : region.end])
        i = region.end
    out += lines[i:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def check_same_regions(student: list[Region], reference: list[Region], where: str) -> None:
    got = [r.lab for r in student]
    want = [r.lab for r in reference]
    if got != want:
        raise RegionError(
            f"{where}: the lab markers do not match the reference's (found {got}, expected "
            f"{want}). Put back any `# BEGIN LAB` / `# END LAB` line you removed or changed "
            "(`git diff labs/` shows them)."
        )


def reference_region_code(phase: str) -> dict[str, list[list[str]]]:
    """{starter file name: [code of each region, in order]} from the reference."""
    out = {}
    for path, regions in reference_modules(phase).items():
        out[starter_relpath(phase, path).name] = region_code(path.read_text().splitlines(), regions)
    return out


def compose(
    student_text: str,
    reference_code: list[list[str]],
    keep: set[str] | None,
    where: str,
    reference_regions: list[Region],
) -> str:
    """The student's file with every region of a lab not in ``keep`` filled
    with the reference's code (``keep=None``: the student's code everywhere)."""
    regions = find_regions(student_text.splitlines(), where)
    check_same_regions(regions, reference_regions, where)
    if keep is None:
        return student_text
    return splice(
        student_text,
        {k: reference_code[k] for k, r in enumerate(regions) if r.lab not in keep},
        where,
    )


# ------------------------------------------------------------------ keeping starters current


def _is_stub_statement(node: ast.stmt, lines: list[str]) -> bool:
    """The generator's ``raise NotImplementedError("Lab ...")`` or one of its
    ``name = None  # yours to set`` placeholders."""
    if isinstance(node, ast.Raise):
        call = node.exc
        return (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "NotImplementedError"
            and len(call.args) == 1
            and isinstance(call.args[0], ast.Constant)
            and str(call.args[0].value).startswith("Lab ")
        )
    return (
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and node.value.value is None
        and "# yours to set" in lines[node.lineno - 1]
    )


def region_is_stub(body: list[str]) -> bool:
    """Whether a region's lines (markers excluded) hold no student code: only
    comments (hints, old or new), the ``def`` line and docstring of a
    whole-function region, placeholders and the ``raise``. Code that does not
    parse counts as the student's."""
    lines = textwrap.dedent("\n".join(body)).splitlines()
    try:
        statements = ast.parse("\n".join(lines)).body
    except SyntaxError:
        return False
    if len(statements) == 1 and isinstance(statements[0], FUNCTIONS):
        fn = statements[0]
        statements = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    return all(_is_stub_statement(node, lines) for node in statements)


def _function_head(body: list[str]) -> list[str] | None:
    """A whole-function region's lines up to the end of its docstring (its
    decorators, ``def`` line and docstring); None for a region inside a body."""
    try:
        statements = ast.parse(textwrap.dedent("\n".join(body))).body
    except SyntaxError:
        return None
    if len(statements) != 1 or not isinstance(statements[0], FUNCTIONS):
        return None
    fn = statements[0]
    end = fn.body[0].end_lineno if ast.get_docstring(fn) is not None else fn.body[0].lineno - 1
    return body[:end]


def update(current: str, fresh: str, where: str) -> tuple[str | None, str]:
    """``fresh`` (the starter the generator writes now) with the student's code
    from ``current`` put back into each region that holds some; regions
    holding only a stub take the fresh stub, hints included. (None, why) when
    the student's code cannot be carried over: the lab markers differ, or a
    whole-function region holding code has a different ``def`` line or
    docstring from the fresh one."""
    lines, fresh_lines = current.splitlines(), fresh.splitlines()
    try:
        regions = find_regions(lines, where)
    except RegionError as e:
        return None, str(e)
    fresh_regions = find_regions(fresh_lines, where)
    if [r.lab for r in regions] != [r.lab for r in fresh_regions]:
        return None, (
            f"its lab markers ({[r.lab for r in regions]}) differ from the reference's "
            f"({[r.lab for r in fresh_regions]})"
        )
    keep = {}
    for k, (mine, new) in enumerate(zip(regions, fresh_regions, strict=True)):
        body = lines[mine.begin + 1 : mine.end]
        if region_is_stub(body):
            continue
        header = _function_head(fresh_lines[new.begin + 1 : new.end])
        if header is not None and body[: len(header)] != header:
            return None, (
                f"LAB {mine.lab} holds your code, and the def line or docstring of its function "
                "differs from the reference's"
            )
        keep[k] = body
    return splice(fresh, keep, where), ""


def stale_files(labs_dir: Path) -> list[str]:
    """Starters in ``labs_dir`` that differ in any way from what the generator
    writes now (code outside the regions, hints, docstrings, signatures), apart
    from the student's own code inside regions that hold some."""
    problems = []
    starters = all_starters()
    for rel, fresh in starters.items():
        path = labs_dir / rel
        if not path.exists():
            problems.append(f"{rel}: missing")
            continue
        current = path.read_text()
        if current == fresh:
            continue
        updated, why = update(current, fresh, str(rel))
        if updated is None:
            problems.append(f"{rel}: {why}")
        elif updated != current:
            problems.append(f"{rel}: out of date with the reference")
    for path in sorted(labs_dir.rglob("*.py")):
        rel = path.relative_to(labs_dir)
        if rel not in starters:
            problems.append(f"{rel}: not a starter the generator writes (delete it?)")
    return problems
