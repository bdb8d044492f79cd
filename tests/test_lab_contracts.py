"""Lab contracts: every generated starter reads no undefined name, and the
generator holds each region to its contract (its first HINT names what it
must leave defined; the starter binds a placeholder for each such name)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mini_vllm.grading import regions as R


def undefined_names(text: str) -> list[str]:
    """ruff's F821 (undefined name) findings for a module's text."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821"]
        + ["--output-format", "concise", "--stdin-filename", "starter.py", "-"],
        input=text,
        capture_output=True,
        text=True,
    )
    assert out.returncode in (0, 1), out.stderr  # 2: ruff itself failed
    return [line for line in out.stdout.splitlines() if "F821" in line]


@pytest.mark.parametrize("rel", sorted(str(p) for p in R.all_starters()))
def test_starter_reads_no_undefined_name(rel):
    text = R.all_starters()[Path(rel)]
    assert undefined_names(text) == [], f"labs/{rel}: a region leaves a name undefined"


# A planted reference module: the region binds `total`, which the code after it reads.
PLANTED = """
def add_all(xs):
    xs = list(xs)
    # BEGIN LAB 99.1: sum the list
    # HINT: {hint}
    total = 0
    for x in xs:
        total += x
    # END LAB 99.1
    return total
"""


def planted_starter(tmp_path, monkeypatch, hint: str) -> str:
    module = tmp_path / "mini_vllm" / "planted.py"
    module.parent.mkdir()
    module.write_text(textwrap.dedent(PLANTED.format(hint=hint)))
    monkeypatch.setattr(R, "REPO_ROOT", tmp_path)
    return R.make_starter(module, "99", set())


def test_the_check_sees_a_region_that_leaves_a_name_undefined(tmp_path, monkeypatch):
    starter = planted_starter(tmp_path, monkeypatch, "receives xs; leaves total.")
    assert "total = None" in starter  # the generator's placeholder
    without = starter.replace("total = None", "pass")  # what the old generator wrote
    assert undefined_names(starter) == []
    assert len(undefined_names(without)) == 1, without


def test_a_first_hint_that_does_not_name_the_contract_is_refused(tmp_path, monkeypatch):
    with pytest.raises(R.RegionError, match="must name what the region leaves defined.*total"):
        planted_starter(tmp_path, monkeypatch, "add them up.")


def test_the_header_lists_every_region_of_a_lab():
    text = R.all_starters()[Path("phase_02/block_pool.py")]
    header = text.split('"""')[1]
    for path, regions in R.reference_modules("02").items():
        if path.name == "block_pool.py":
            for region in regions:
                assert f"  - {region.title}" in header, region


# A planted async generator whose region sits in an `except` block (Phase 16's shape).
PLANTED_ASYNC = """
async def relay(source, on_abort):
    \"\"\"Yield what the source yields; abort if the caller goes away.\"\"\"
    try:
        async for item in source:
            yield item
    except BaseException:
        # BEGIN LAB 99.2: abort, then re-raise
        # HINT: receives on_abort; re-raises.
        on_abort()
        raise
        # END LAB 99.2
"""


def test_a_region_in_an_async_function_and_an_except_block(tmp_path, monkeypatch):
    module = tmp_path / "mini_vllm" / "planted_async.py"
    module.parent.mkdir()
    module.write_text(textwrap.dedent(PLANTED_ASYNC))
    monkeypatch.setattr(R, "REPO_ROOT", tmp_path)
    starter = R.make_starter(module, "99", set())
    assert "async def relay(source, on_abort):" in starter
    # Inside `except`, the stub raises `from None` (ruff's B904), and nothing else is kept.
    stub = starter.split("# BEGIN LAB 99.2")[1].split("# END LAB 99.2")[0]
    assert "on_abort()" not in stub and "from None" in stub, stub
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F,E,B"]
        + ["--output-format", "concise", "--stdin-filename", "starter.py", "-"],
        input=starter,
        capture_output=True,
        text=True,
    )
    assert lint.returncode == 0, lint.stdout


# Two phases' regions in one function (core/sched/scheduler.py: Lab 03.1 and
# 08.1), and a name the region binds that the function binds again only later.
PLANTED_TWO_PHASES = """
def step(xs, budget):
    xs = list(xs)
    # BEGIN LAB 98.1: the demand
    # HINT: receives xs; leaves n.
    n = len(xs)
    # END LAB 98.1
    # BEGIN LAB 99.1: charge it
    # HINT: receives n and budget; leaves budget.
    budget -= n
    # END LAB 99.1
    for x in xs:
        n = x
    return n, budget
"""


def test_each_phase_starter_keeps_only_its_own_markers(tmp_path, monkeypatch):
    module = tmp_path / "mini_vllm" / "planted_two.py"
    module.parent.mkdir()
    module.write_text(textwrap.dedent(PLANTED_TWO_PHASES))
    monkeypatch.setattr(R, "REPO_ROOT", tmp_path)
    for phase, other in (("98", "99"), ("99", "98")):
        starter = R.make_starter(module, phase, set())
        # Only this phase's markers and hints; the other's code stays, unmarked.
        assert [r.lab for r in R.find_regions(starter.splitlines())] == [f"{phase}.1"], starter
        assert f"LAB {other}" not in starter, starter
        other_hint = "receives n and budget" if other == "99" else "receives xs; leaves n."
        assert other_hint not in starter, starter
        assert undefined_names(starter) == [], starter
    # Phase 98's region binds n; the loop binds it again only after the region,
    # so the starter needs the placeholder (ruff: F821 without it).
    starter = R.make_starter(module, "98", set())
    assert "n = None  # yours to set" in starter, starter
    # Phase 99's starter keeps phase 98's code (unmarked) and reads n from it.
    starter = R.make_starter(module, "99", set())
    assert "    n = len(xs)\n" in starter and "n = None" not in starter, starter


# A package's __init__.py with a region (structured_output/__init__.py: Lab
# 12.2), and a sibling module importing from that package.
PLANTED_PACKAGE = {
    "pkg/__init__.py": """
class Manager:
    def rows(self, ids):
        '''One row per id.'''
        # BEGIN LAB 97.1: one row per id
        # HINT: receives ids; leaves out.
        out = [0 for _ in ids]
        # END LAB 97.1
        return out
""",
    "user.py": """
from mini_vllm.pkg import Manager


# BEGIN LAB 97.1: use the manager
def use(ids):
    return Manager().rows(ids)


# END LAB 97.1
""",
}


def test_a_package_init_gets_a_starter_named_after_its_package(tmp_path, monkeypatch):
    for rel, text in PLANTED_PACKAGE.items():
        path = tmp_path / "mini_vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.setattr(R, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(R, "PACKAGE_ROOT", tmp_path / "mini_vllm")
    init = tmp_path / "mini_vllm" / "pkg" / "__init__.py"
    assert R.module_name(init) == "mini_vllm.pkg"
    assert R.module_path("mini_vllm.pkg") == init
    starters = R.starters("97")
    # Not labs/phase_97/__init__.py, which is the phase package's own marker.
    assert set(starters) == {
        Path("phase_97/__init__.py"),
        Path("phase_97/pkg.py"),
        Path("phase_97/user.py"),
    }, sorted(starters)
    assert R.starter_module_name("97", init) == "labs.phase_97.pkg"
    assert "from mini_vllm import pkg as _reference" in starters[Path("phase_97/pkg.py")]
    # The sibling's import of the package is redirected to the package's starter.
    assert "from labs.phase_97.pkg import Manager" in starters[Path("phase_97/user.py")]
    # `solve` finds each starter's reference code by the starter's file name.
    assert set(R.reference_region_code("97")) == {"pkg.py", "user.py"}
