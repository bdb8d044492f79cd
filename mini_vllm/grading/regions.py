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
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO_ROOT / "mini_vllm"
LABS_PACKAGE = "labs"

BEGIN = re.compile(r"^(?P<indent>[ ]*)# BEGIN LAB (?P<lab>\d\d\.\d+)(?::\s*(?P<title>.*?))?\s*$")
END = re.compile(r"^(?P<indent>[ ]*)# END LAB (?P<lab>\d\d\.\d+)\s*$")
HINT = re.compile(r"^\s*# HINT:")


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
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


def starter_relpath(phase: str, reference: Path) -> Path:
    """Where a reference module's starter lives, relative to the labs folder."""
    return Path(f"phase_{phase}") / reference.name


def starter_module_name(phase: str, reference: Path) -> str:
    return f"{LABS_PACKAGE}.phase_{phase}.{reference.stem}"


# ------------------------------------------------------------------ starters


def _owner(tree: ast.Module, region: Region):
    """(class name or None, function node) of the function a region lives in
    or is. Line numbers in ``ast`` are 1-based; region indices are 0-based."""
    first, last = region.begin + 2, region.end  # the lines between the markers
    candidates = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            candidates.append((None, node))
        elif isinstance(node, ast.ClassDef):
            candidates += [(node.name, f) for f in node.body if isinstance(f, ast.FunctionDef)]
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


def _stub(
    lines: list[str], region: Region, fn: ast.FunctionDef, whole: bool, starter_path: str
) -> list[str]:
    """The starter's replacement for a region's code (markers excluded)."""
    body = lines[region.begin + 1 : region.end]
    kept: list[str] = []
    indent = region.indent
    if whole:
        doc = ast.get_docstring(fn) is not None
        head_end = fn.body[0].end_lineno if doc else fn.body[0].lineno - 1
        kept = lines[region.begin + 1 : head_end]
        indent = " " * fn.body[0].col_offset
    kept += [line for line in body if HINT.match(line)]
    message = (
        f"Lab {region.lab}: {region.title} ({starter_path})"
        if region.title
        else f"Lab {region.lab} ({starter_path})"
    )
    kept.append(f"{indent}raise NotImplementedError({message!r})")
    return kept


def _names_used(nodes) -> set[str]:
    names = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                # String annotations (`from __future__ import annotations`).
                names.update(re.findall(r"[A-Za-z_]\w*", sub.value))
    return names


def make_starter(reference: Path, phase: str, siblings: set[str]) -> str:
    """The starter module for ``reference``'s regions of ``phase``.

    ``siblings`` are the module names (``mini_vllm.x.y``) that also get a
    starter in this phase: imports from them are redirected to their starters.
    """
    text = reference.read_text()
    lines = text.splitlines()
    rel = str(reference.relative_to(REPO_ROOT))
    starter_path = f"{LABS_PACKAGE}/{starter_relpath(phase, reference)}"
    tree = ast.parse(text)
    all_regions = find_regions(lines, rel)
    if [r for r in all_regions if r.phase != phase]:
        raise RegionError(f"{rel}: regions of several phases in one module are not supported")

    # Function -> its regions, in source order.
    owners: dict[tuple[str | None, str], tuple[ast.FunctionDef, list]] = {}
    for region in all_regions:
        cls, fn, whole = _owner(tree, region)
        owners.setdefault((cls, fn.name), (fn, []))[1].append((region, whole))

    def function_text(fn, regions) -> list[str]:
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
        end = fn.end_lineno
        for region, whole in regions:
            if whole:
                start, end = min(start, region.begin), max(end, region.end + 1)
        out, i = [], start
        for region, whole in regions:
            out += lines[i : region.begin + 1]
            out += _stub(lines, region, fn, whole, starter_path)
            out.append(lines[region.end])
            i = region.end + 1
        out += lines[i:end]
        return out

    holed_classes = {cls for cls, _ in owners if cls}
    holed_functions = {name for cls, name in owners if cls is None}
    used = _names_used(fn for fn, _ in owners.values())

    # Imports: the reference's own, pruned to what the holes' functions use.
    imports = ["from __future__ import annotations", ""]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            keep = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
            if not keep:
                continue
            if isinstance(node, ast.ImportFrom) and node.module in siblings:
                node = ast.ImportFrom(
                    module=starter_module_name(
                        phase, REPO_ROOT / Path(*node.module.split(".")).with_suffix(".py")
                    ),
                    names=keep,
                    level=0,
                )
            else:
                node = type(node)(**{**{f: getattr(node, f) for f in node._fields}, "names": keep})
            imports.append(ast.unparse(node))
    modname = module_name(reference)
    if holed_classes:
        package, _, leaf = modname.rpartition(".")
        imports.append(f"from {package} import {leaf} as _reference")
    others = [
        n.name if not isinstance(n, ast.Assign) else n.targets[0].id
        for n in tree.body
        if (
            isinstance(n, (ast.FunctionDef, ast.ClassDef))
            and n.name not in holed_functions
            and n.name not in holed_classes
        )
        or (
            isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
        )
    ]
    if others:
        imports.append(f"from {modname} import {', '.join(others)}  # noqa: F401")

    labs = {}
    for region in all_regions:
        labs.setdefault(region.lab, region.title)
    doc = [
        '"""Phase {} lab starter, generated from ``{}``.'.format(phase, rel),
        "",
        "Write your code between the ``# BEGIN LAB`` and ``# END LAB`` markers (keep the",
        "markers), then grade it with the lab's command below. Everything outside the",
        "regions is the reference's: the imports below bring it in, and each class",
        "here subclasses the reference class, re-opening only the methods that hold",
        "a lab. The hints are comments starting with ``# HINT:``.",
        "",
        "Labs in this file:",
        *[
            f"- {lab}: {title} (``make check-lab-{lab}``)"
            for lab, title in sorted(labs.items(), key=lambda kv: int(kv[0].split(".")[1]))
        ],
        "",
        "Generated by ``python -m mini_vllm.grading generate``.",
        '"""',
        "",
    ]
    body: list[str] = []
    done_classes: set[str] = set()
    for (cls, _), (fn, regions) in owners.items():
        if cls is None:
            body += ["", ""] + function_text(fn, regions)
            continue
        if cls not in done_classes:
            done_classes.add(cls)
            body += [
                "",
                "",
                f"class {cls}(_reference.{cls}):",
                f'    """The reference ``{cls}`` with its Phase {phase} lab methods re-opened."""',
            ]
        body += [""] + function_text(fn, regions)
    return "\n".join(doc + imports + body) + "\n"


def starters(phase: str) -> dict[Path, str]:
    """{path relative to the labs folder: text} for every starter of a phase."""
    modules = reference_modules(phase)
    siblings = {module_name(p) for p in modules}
    names = [p.name for p in modules]
    if len(set(names)) != len(names):
        raise RegionError(f"phase {phase}: two reference modules share a file name: {names}")
    out = {
        Path(f"phase_{phase}")
        / "__init__.py": f'"""Phase {phase} lab starters (generated; see each module\'s docstring)."""\n'
    }
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
        out[path.name] = region_code(path.read_text().splitlines(), regions)
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


def stale_files(labs_dir: Path) -> list[str]:
    """Starters in ``labs_dir`` that differ from what the generator writes now,
    ignoring the code inside regions (that part is the student's)."""
    problems = []
    for rel, fresh in all_starters().items():
        path = labs_dir / rel
        if not path.exists():
            problems.append(f"{rel}: missing")
            continue
        current = path.read_text()
        fresh_lines = fresh.splitlines()
        try:
            fresh_code = region_code(fresh_lines, find_regions(fresh_lines))
            normalised = splice(current, dict(enumerate(fresh_code)), str(rel))
        except RegionError as e:
            problems.append(f"{rel}: {e}")
            continue
        if normalised != fresh:
            problems.append(f"{rel}: out of date with the reference")
    known = set(all_starters())
    for path in sorted(labs_dir.rglob("*.py")):
        rel = path.relative_to(labs_dir)
        if rel not in known:
            problems.append(f"{rel}: not a starter the generator writes (delete it?)")
    return problems


def has_student_code(path: Path, fresh: str) -> bool:
    """Whether the file's regions hold anything but stubs: comments (hints,
    old or new) and the ``raise NotImplementedError`` do not count."""

    def code(lines: list[str]) -> list[list[str]]:
        return [
            [
                line
                for line in region
                if line.strip()
                and not line.lstrip().startswith("#")
                and not line.lstrip().startswith("raise NotImplementedError(")
            ]
            for region in region_code(lines, find_regions(lines, str(path)))
        ]

    try:
        return code(path.read_text().splitlines()) != code(fresh.splitlines())
    except RegionError:
        return True
