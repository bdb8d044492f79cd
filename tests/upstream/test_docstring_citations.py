"""Upstream line numbers quoted in mini_vllm's module docstrings are true at the pin.

Each module docstring opens with ``Mirrors upstream ``vllm/...py`` ...`` and
quotes symbols with line numbers in one of these forms:
``Name`` :N, ``Name`` at :N, ``Name`` (:N), ``Name``, :N — resolved in the
module's mirrored file — or ``Name`` (other_file.py:N) — resolved next to it
(or from the package root when written ``vllm/...``).
The quoted line must hold ``class Name`` or ``def name(``; a quote of
``inline`` code is written as ``file.py:A-B`` prose and is not checked here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import mini_vllm

pytestmark = pytest.mark.upstream

MIRRORS = re.compile(r"Mirrors upstream ``(vllm/[\w/]+\.py)``")
QUOTE = re.compile(r"``([A-Za-z_][\w.]*)``(?:\s*,|\s+at)?\s*\(?\s*(?:([\w/]+\.py))?:(\d+)\)?")


def _modules():
    for info in pkgutil.walk_packages(mini_vllm.__path__, "mini_vllm."):
        # __main__ modules run a program when imported.
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        if module is not None and module.__doc__ and MIRRORS.search(module.__doc__):
            yield module


MODULES = list(_modules())


def test_citing_modules_found():
    assert len(MODULES) >= 10, [m.__name__ for m in MODULES]


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__ for m in MODULES])
def test_docstring_line_quotes_hold_the_symbol(module):
    import vllm

    site = Path(vllm.__file__).parent.parent
    primary = site / MIRRORS.search(module.__doc__).group(1)
    quotes = QUOTE.findall(module.__doc__)
    assert quotes, f"{module.__name__} cites no upstream line"
    for name, other_file, line in quotes:
        if not other_file:
            path = primary
        elif other_file.startswith("vllm/"):
            path = site / other_file
        else:
            path = primary.parent / other_file
        text = path.read_text().splitlines()[int(line) - 1]
        last = name.split(".")[-1]
        assert re.search(rf"\b(class|def)\s+{re.escape(last)}\b", text), (
            f"{module.__name__}: ``{name}`` quoted at {path.name}:{line}, "
            f"but that line reads: {text.strip()!r}"
        )
