"""The grader stays the grader: code under grade cannot rebind what judges it.

A graded test runs the student's code in the grader's own process, so that
code can reach the grader's modules: a lab that does
``kv_checks.snapshot_mismatch = lambda *a, **k: None`` at import would pass
every snapshot check. ``Seal`` records, once the tests are collected and
before any code under grade is loaded (it is loaded by the ``impl``
fixture, inside a test), what the checks are made of:

- the names of the grader's own modules (``mini_vllm.grading``,
  ``mini_vllm.oracle``, ``mini_vllm.testing``, the phase folders' test and
  helper modules): every function, class, module and constant they hold;
- the public names of ``pytest``, ``hypothesis``, ``torch`` and ``builtins``
  that can be called (``torch.equal``, ``len``...);
- the code of every function and the methods of every class defined in
  ``mini_vllm`` (the reference is the oracle of many checks), in the phase
  folders, in pytest (``_pytest``, ``pluggy``) and in ``torch.Tensor``.

After each test (its fixtures torn down, so a ``monkeypatch`` of the
reference by the grader itself is undone by then) ``broken`` compares, puts
every changed name back, and names what changed: the plugin fails that test.
A module first imported during the run is recorded when first seen; an
installed package wrapping one of its own names (importing ``torch._dynamo``
wraps ``torch.manual_seed``) is taken as the new value.

The reference's module-level names are not sealed: graded tests plug the
student's functions into the reference's engine with ``monkeypatch``.
In-process grading has a limit this does not lift: code that writes the
grader's result files itself, or edits its data (not its code), is not
caught. ``python -m mini_vllm.grading check`` takes the score from the
events the child logs, never from the child's exit code.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from mini_vllm.grading.regions import REPO_ROOT

PHASES = str(REPO_ROOT / "phases")
# Modules whose every name is sealed.
GRADER = ("mini_vllm.grading", "mini_vllm.oracle", "mini_vllm.testing")
# Modules whose callable public names are sealed.
LIBRARIES = ("pytest", "hypothesis", "hypothesis.strategies", "torch", "builtins")
# Packages whose functions' code and classes' methods are sealed.
CODE = ("mini_vllm", "_pytest", "pluggy", "pytest")
IMMUTABLE = (int, float, complex, str, bytes, bool, tuple, frozenset, type(None))
FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")
_MISSING = object()


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _phase_module(module: types.ModuleType) -> bool:
    return str(getattr(module, "__file__", None) or "").startswith(PHASES)


def _callable(value) -> bool:
    return callable(value) or isinstance(value, (classmethod, staticmethod, property))


class Seal:
    def __init__(self) -> None:
        # (owner, name, original): ``owner.name`` must still be ``original``.
        self.names: list[tuple[object, str, object]] = []
        # (class, method names at record time): a method added later is removed.
        self.methods: list[tuple[type, frozenset[str]]] = []
        self.seen: set[str] = set()

    def record_new_modules(self) -> None:
        """Record every module not seen before (all of them the first time)."""
        for name, module in list(sys.modules.items()):
            if name in self.seen or not isinstance(module, types.ModuleType):
                continue
            self.seen.add(name)
            self._record(name, module)

    def _record(self, name: str, module: types.ModuleType) -> None:
        phase = _phase_module(module)
        everything = phase or _in(name, GRADER)
        if everything or name in LIBRARIES:
            for key, value in list(vars(module).items()):
                if key.startswith("__") or not (
                    (everything and isinstance(value, IMMUTABLE))
                    or _callable(value)
                    or isinstance(value, types.ModuleType)
                ):
                    continue
                if (not everything and key.startswith("_")) or value is None:
                    continue  # None: a cache filled on first use
                self.names.append((module, key, value))
        if not (phase or _in(name, CODE) or name == "torch"):
            return
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != name and not (
                name == "torch" and value is getattr(module, "Tensor", None)
            ):
                continue
            if isinstance(value, types.FunctionType):
                self._record_function(value)
            elif isinstance(value, type):
                self._record_class(value)

    def _record_function(self, fn: types.FunctionType) -> None:
        for part in FUNCTION_PARTS:
            self.names.append((fn, part, getattr(fn, part)))

    def _record_class(self, cls: type) -> None:
        members = {k: v for k, v in vars(cls).items() if _callable(v) and k != "__class__"}
        for key, value in members.items():
            self.names.append((cls, key, value))
            if isinstance(value, types.FunctionType):
                self._record_function(value)
        self.methods.append((cls, frozenset(members)))

    def broken(self) -> list[str]:
        """What changed since it was recorded, each put back; then record the
        modules imported since."""
        changed = []
        for n, (owner, key, original) in enumerate(self.names):
            now = (
                getattr(owner, key, _MISSING)
                if key in FUNCTION_PARTS
                else vars(owner).get(key, _MISSING)
            )
            if now is original:
                continue
            if _installed_wrapper(now, original):
                self.names[n] = (owner, key, now)
                continue
            changed.append(f"{_label(owner)}.{key}")
            setattr(owner, key, original)
        for cls, members in self.methods:
            for key, value in list(vars(cls).items()):
                if key not in members and _callable(value) and key != "__class__":
                    changed.append(f"{_label(cls)}.{key}")
                    delattr(cls, key)
        self.record_new_modules()
        return changed


def _installed_wrapper(new, original) -> bool:
    """An installed package wrapping a name it owns, as importing
    ``torch._dynamo`` wraps ``torch.manual_seed`` (``functools.wraps``)."""
    code = getattr(new, "__code__", None)
    where = code.co_filename if code is not None else ""
    return getattr(new, "__wrapped__", None) is original and "site-packages" in where


def _label(owner) -> str:
    if isinstance(owner, types.ModuleType):
        name = owner.__name__
        path = getattr(owner, "__file__", None)
        return Path(path).stem if path and path.startswith(PHASES) else name
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"{owner.__module__}.{owner.__qualname__}"  # a function
