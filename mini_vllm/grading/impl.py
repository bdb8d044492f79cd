"""What a graded suite runs: the student's code, or the reference (``IMPL=ref``).

``load("03.3")`` returns a namespace with one module per starter of phase
03 (``.scheduler``, ``.utils``). By default the modules are built from the
student's starters in ``labs/`` (or ``$MINI_VLLM_LABS_DIR``): the regions
of lab 03.3 hold the student's code and the regions of the phase's other
labs hold the reference's, so each lab is graded on its own. ``load("03")``
keeps the student's code in every region (the whole-phase checks).
With ``IMPL=ref`` the namespace holds the reference modules themselves.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import types
from pathlib import Path

from mini_vllm.grading import regions as R

IMPLS = ("labs", "ref")


def impl_name() -> str:
    name = os.environ.get("IMPL", "labs") or "labs"
    if name not in IMPLS:
        raise ValueError(f"IMPL={name!r}: use IMPL=labs (your code, the default) or IMPL=ref.")
    return name


def labs_dir() -> Path:
    return Path(os.environ.get("MINI_VLLM_LABS_DIR") or R.REPO_ROOT / R.LABS_PACKAGE)


def load(lab_or_phase: str, impl: str | None = None) -> types.SimpleNamespace:
    impl = impl or impl_name()
    phase, _, _ = lab_or_phase.partition(".")
    keep = None if "." not in lab_or_phase else {lab_or_phase}
    modules = R.reference_modules(phase)
    if not modules:
        raise ValueError(f"Phase {phase} has no lab regions in mini_vllm/.")
    if impl == "ref":
        import importlib

        return types.SimpleNamespace(
            **{R.starter_stem(p): importlib.import_module(R.module_name(p)) for p in modules}
        )
    return types.SimpleNamespace(**_load_student(phase, modules, keep))


def _load_student(phase: str, modules: dict, keep: set[str] | None) -> dict:
    folder = labs_dir()
    sources = {}
    for ref_path, ref_regions in modules.items():
        path = folder / R.starter_relpath(phase, ref_path)
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing. Regenerate the starters with "
                "`python -m mini_vllm.grading generate` (it never overwrites your work)."
            )
        code = R.region_code(ref_path.read_text().splitlines(), ref_regions)
        text = R.compose(path.read_text(), code, keep, str(path), ref_regions)
        sources[R.starter_module_name(phase, ref_path)] = (path, text)

    package = f"{R.LABS_PACKAGE}.phase_{phase}"
    # Starters import each other (`from labs.phase_03.utils import ...`):
    # build them in dependency order and let those imports find the modules
    # built here, not whatever `labs` package is on sys.path.
    saved = {name: sys.modules.get(name) for name in [R.LABS_PACKAGE, package, *sources]}
    built: dict[str, types.ModuleType] = {}
    try:
        for name in (R.LABS_PACKAGE, package):
            pkg = types.ModuleType(name)
            pkg.__path__ = []
            sys.modules[name] = pkg
        pending = dict(sources)
        while pending:
            ready = [
                n
                for n, (_, t) in pending.items()
                if not (
                    set(re.findall(rf"^from ({re.escape(package)}\.\w+) import", t, re.M))
                    - set(built)
                )
            ]
            if not ready:
                raise ImportError(f"starters of phase {phase} import each other in a cycle")
            for name in ready:
                path, text = pending.pop(name)
                built[name] = _exec_module(name, path, text, keep)
                sys.modules[name] = built[name]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return {name.rsplit(".", 1)[1]: module for name, module in built.items()}


def _exec_module(name: str, path: Path, text: str, keep: set[str] | None) -> types.ModuleType:
    # Tracebacks show the lines actually run; when other labs' regions were
    # filled with the reference's code, say so in the file name.
    filename = str(path) if keep is None else f"{path} [lab {', '.join(sorted(keep))}]"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    code = compile(text, filename, "exec")
    exec(code, module.__dict__)
    return module
