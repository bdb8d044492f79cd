"""Fetch upstream's own tests at the pin from the vllm 0.22.1 source distribution.

The wheel the project installs holds vllm's source but not its tests; the PyPI
sdist holds both, exactly at the pin (its ``vllm/_version.py`` names commit
``g0decac0d9``). pip is the only client used: ``pip download --no-binary :all:``
fetches and unpacks the sdist, then fails while generating vllm's build metadata
(it needs a Rust toolchain), but ``--no-clean`` keeps the unpacked tree in pip's
temporary folder. We point that folder (``TMPDIR``) into the cache, check the
version file, keep ``tests/`` and delete the rest.

The cache is ``build/upstream-tests/`` (gitignored). Once it holds ``tests/``
and the ``PIN`` stamp, nothing is fetched again, so later runs are offline.
Upstream's tests are never committed to this repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "0.22.1"
COMMIT_TAG = "g0decac0d9"
CACHE = Path(__file__).resolve().parents[3] / "build" / "upstream-tests"
STAMP = CACHE / "PIN"


def tests_root() -> Path:
    """The folder holding upstream's ``tests`` package (fetching it if needed)."""
    if not STAMP.exists():
        fetch()
    return CACHE


def fetch() -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="pip-tmp-") as tmp:
        command = [
            sys.executable, "-m", "pip", "download", f"vllm=={VERSION}",
            "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "--no-clean",
            "--dest", tmp, "--quiet",
        ]  # fmt: skip
        # Expected to fail at metadata generation; what matters is the unpacked tree.
        subprocess.run(command, env={**os.environ, "TMPDIR": tmp}, capture_output=True)
        trees = [p.parent.parent for p in Path(tmp).glob("*/vllm*/vllm/_version.py")]
        if len(trees) != 1:
            raise RuntimeError(
                f"pip did not leave one unpacked vllm {VERSION} sdist under {tmp} "
                f"(found {len(trees)}). Is PyPI reachable through pip?"
            )
        tree = trees[0]
        version_file = (tree / "vllm" / "_version.py").read_text()
        if f"'{VERSION}'" not in version_file or f"'{COMMIT_TAG}'" not in version_file:
            raise RuntimeError(f"the sdist is not vllm {VERSION} at {COMMIT_TAG}:\n{version_file}")
        if (CACHE / "tests").exists():
            shutil.rmtree(CACHE / "tests")
        shutil.move(str(tree / "tests"), CACHE / "tests")
    # Makes this folder pytest's rootdir, so node ids read "tests/v1/...".
    (CACHE / "pytest.ini").write_text("[pytest]\n")
    STAMP.write_text(f"vllm {VERSION} {COMMIT_TAG} (tests/ from the PyPI sdist)\n")


if __name__ == "__main__":
    print(tests_root())
