"""The student's whole engine: every lab region of the chosen phases filled
with the student's code, inside the reference's own modules (Phase 19).

``impl.load`` builds one phase's starters as modules of their own, for a
phase's suite to call. A served engine needs more: the reference's modules
themselves (``mini_vllm.core.sched.scheduler`` and the rest) must run the
student's code, so that everything importing them gets it. ``install`` does
that with an import hook: when a reference module holding regions of a chosen
phase is imported, its source is read, the code inside those regions is
replaced with the code inside the same regions of the student's starter
(``labs/phase_NN/<module>.py``), and the result is compiled as the reference
module. Regions of the other phases keep the reference's code, so a run with
``phases={"00", ..., "05"}`` is the student's engine up to Phase 05 and the
reference's after it (what ``capstone.bisect`` swaps phase by phase).

``mini-vllm`` calls ``install_from_env`` at startup: with
``MINI_VLLM_STUDENT_PHASES`` unset it does nothing (the reference runs as
always); set to ``all`` or to phases (``00,03,07``) it installs the hook over
``$MINI_VLLM_LABS_DIR`` (default ``labs/``). There is no upstream counterpart:
upstream has no lab regions.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import os
import sys
from pathlib import Path

from mini_vllm.grading import regions as R

PHASES_ENV = "MINI_VLLM_STUDENT_PHASES"


def parse_phases(text: str) -> list[str]:
    """``all`` -> every phase with regions; ``00,3,07`` -> ["00", "03", "07"]."""
    known = R.phases()
    if text.strip() == "all":
        return known
    chosen = sorted({f"{int(p):02d}" for p in text.split(",") if p.strip()})
    unknown = [p for p in chosen if p not in known]
    if unknown:
        raise ValueError(f"{PHASES_ENV}: no lab regions in phase(s) {', '.join(unknown)}")
    return chosen


def assembled_source(reference: Path, labs: Path, phases: list[str]) -> str:
    """``reference``'s source with each region of ``phases`` holding the code
    of the same region in the student's starter of that phase."""
    text = reference.read_text()
    where = str(reference.relative_to(R.REPO_ROOT))
    regions = R.find_regions(text.splitlines(), where)
    replacements: dict[int, list[str]] = {}
    for phase in phases:
        mine = [k for k, r in enumerate(regions) if r.phase == phase]
        if not mine:
            continue
        starter = labs / R.starter_relpath(phase, reference)
        if not starter.exists():
            raise FileNotFoundError(
                f"{starter} is missing. Regenerate the starters with "
                "`python -m mini_vllm.grading generate` (it never overwrites your work)."
            )
        lines = starter.read_text().splitlines()
        theirs = R.find_regions(lines, str(starter))
        R.check_same_regions(theirs, [regions[k] for k in mine], str(starter))
        for k, code in zip(mine, R.region_code(lines, theirs), strict=True):
            replacements[k] = code
    return R.splice(text, replacements, where)


class _AssembledLoader(importlib.machinery.SourceFileLoader):
    """Loads a reference module from its assembled source (never from bytecode)."""

    def __init__(self, fullname: str, path: str, source: str) -> None:
        super().__init__(fullname, path)
        self.source = source

    def get_code(self, fullname: str):
        # Tracebacks show the lines actually run, under the reference's file name.
        filename = f"{self.path} [assembled]"
        lines = self.source.splitlines(True)
        linecache.cache[filename] = (len(self.source), None, lines, filename)
        return compile(self.source, filename, "exec", dont_inherit=True)


class StudentFinder(importlib.abc.MetaPathFinder):
    """Finds the reference modules holding regions of the chosen phases and
    loads them with the student's code spliced in."""

    def __init__(self, labs: Path, phases: list[str]) -> None:
        self.labs = labs
        self.phases = phases
        self.modules = {
            R.module_name(path): path for phase in phases for path in R.reference_modules(phase)
        }

    def find_spec(self, fullname, path=None, target=None):
        reference = self.modules.get(fullname)
        if reference is None:
            return None
        source = assembled_source(reference, self.labs, self.phases)
        loader = _AssembledLoader(fullname, str(reference), source)
        package = [str(reference.parent)] if reference.name == "__init__.py" else None
        return importlib.util.spec_from_file_location(
            fullname, reference, loader=loader, submodule_search_locations=package
        )


def install(labs: Path, phases: list[str]) -> StudentFinder:
    """Put the student's code of ``phases`` into the reference modules from now on.
    Must run before any of those modules is imported."""
    finder = StudentFinder(Path(labs), phases)
    early = sorted(name for name in finder.modules if name in sys.modules)
    if early:
        raise RuntimeError(f"already imported with the reference's code: {', '.join(early)}")
    sys.meta_path.insert(0, finder)
    return finder


def install_from_env() -> StudentFinder | None:
    """``install`` as ``$MINI_VLLM_STUDENT_PHASES`` and ``$MINI_VLLM_LABS_DIR`` say."""
    text = os.environ.get(PHASES_ENV, "")
    if not text.strip():
        return None
    labs = Path(os.environ.get("MINI_VLLM_LABS_DIR") or R.REPO_ROOT / R.LABS_PACKAGE)
    return install(labs, parse_phases(text))
