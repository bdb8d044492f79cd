"""``python -m mini_vllm.grading``: starters, grading, and diffs against upstream.

generate [--check] [--out DIR] [--force]   bring the labs/ starters up to date (or check them);
                                           your code inside lab regions is kept
solve --out DIR                            a copy of labs/ with the reference's code in every region
check 03 | 03.2 [--impl ref] [--labs-dir DIR] [--results FILE] [--no-upstream-tests]
      [-- PYTEST ARGS]                     grade a phase or one lab; exit 0 only on full marks
diff SYMBOL [--impl labs]                  a symbol beside upstream's at the pin
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mini_vllm.grading import regions as R
from mini_vllm.oracle.upstream_suite.runner import LAB_FILES


def generate(out: Path, check: bool, force: bool) -> int:
    """Write every starter, or with ``check`` only name the stale ones. An
    existing starter is brought up to date with the student's code in its
    regions carried over (``regions.update``); one whose code cannot be carried
    over is left alone and named, unless ``force`` overwrites it."""
    if check:
        problems = R.stale_files(out)
        for p in problems:
            print(f"stale: {out / p}" if p.split(":")[0].endswith(".py") else p)
        if problems:
            print("Run `python -m mini_vllm.grading generate` to bring labs/ up to date.")
            return 1
        print(f"{out}: every starter is up to date with the reference.")
        return 0
    starters = R.all_starters()
    written, kept = 0, []
    for rel, text in starters.items():
        path = out / rel
        if path.exists() and not force:
            current = path.read_text()
            text, why = R.update(current, text, str(path))
            if text is None:
                kept.append((path, why))
                continue
            if text == current:
                continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written += 1
    for path, why in kept:
        print(
            f"kept {path}: {why}. Save your code from it, then `generate --force` "
            "overwrites it with the fresh starter."
        )
    print(f"wrote {written} starter files under {out} ({len(starters)} in all)")
    return 1 if kept else 0


def solve(out: Path) -> int:
    """Every starter with the reference's region code pasted in: proof that
    each lab can be solved inside its starter."""
    for rel, text in R.all_starters().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.name != "__init__.py":
            phase = rel.parent.name.removeprefix("phase_")
            code = R.reference_region_code(phase)[rel.name]
            text = R.splice(text, dict(enumerate(code)), str(rel))
        path.write_text(text)
    print(f"wrote solved starters under {out}")
    return 0


def phase_dir(phase: str) -> Path:
    found = sorted((R.REPO_ROOT / "phases").glob(f"{phase}-*"))
    if not found:
        raise SystemExit(
            f"No phase {phase}: phases/ has "
            f"{sorted(p.name for p in (R.REPO_ROOT / 'phases').glob('[0-9]*'))}"
        )
    return found[0]


def check(
    target: str,
    impl: str,
    labs_dir: str | None,
    results: str,
    pytest_args: list,
    upstream_tests: bool = True,
) -> int:
    """Grade ``target``; a whole phase also prints the line of upstream's own
    unit tests (information, not points) unless ``upstream_tests`` is False."""
    from mini_vllm.tiers import tier

    try:
        tier()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    phase, _, lab = target.partition(".")
    if not (phase.isdigit() and len(phase) == 2 and (lab == "" or lab.isdigit())):
        raise SystemExit(f"{target!r}: give a phase like 03 or a lab like 03.2")
    folder = phase_dir(phase) / "labs"
    if lab:
        found = sorted(folder.glob(f"lab-{int(lab):02d}-*"))
        if not found:
            raise SystemExit(
                f"Phase {phase} has no lab {lab}: {sorted(p.name for p in folder.glob('lab-*'))}"
            )
        folder = found[0]
    os.environ["IMPL"] = impl
    if labs_dir:
        os.environ["MINI_VLLM_LABS_DIR"] = str(Path(labs_dir).resolve())
    path = Path(results).resolve()
    try:  # before grading, not after: the score must have somewhere to go
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # an old score must never read as this run's
    except OSError as e:
        raise SystemExit(
            f"--results {results}: cannot write the score there ({e.strerror})."
        ) from None
    from mini_vllm.grading import run
    from mini_vllm.grading.plugin import _graded, score_table, write_results

    outcome = run.grade(folder, pytest_args)
    if outcome.results is None:
        print(f"\n{outcome.problem}\nNo score: {results} was not written.")
        return 130 if outcome.interrupted else 1
    write_results(path, outcome.results)
    summary = outcome.results
    print(
        f"\nScore ({_graded()}):\n{score_table(summary)}\n"
        f"results: {results} (run {summary['run_id']})"
    )
    if not lab and upstream_tests:
        from mini_vllm.grading.upstream_tests import upstream_tests_line

        line = upstream_tests_line(phase, impl, hung=outcome.hung)
        if line:
            print(line)
    full = summary["max_score"] > 0 and summary["score"] == summary["max_score"]
    return 0 if full and outcome.complete else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["diff"]:
        from mini_vllm.grading.diff_upstream import main as diff_main

        return diff_main(argv[1:])
    pytest_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm.grading", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write the labs/ starters from the reference")
    g.add_argument("--out", default=str(R.REPO_ROOT / R.LABS_PACKAGE))
    g.add_argument("--check", action="store_true", help="fail if labs/ is out of date")
    g.add_argument("--force", action="store_true", help="overwrite all, your code too")
    s = sub.add_parser("solve", help="a copy of labs/ with the reference's code in every region")
    s.add_argument("--out", required=True)
    c = sub.add_parser("check", help="grade a phase (03) or a lab (03.2)")
    c.add_argument("target")
    c.add_argument("--impl", choices=["labs", "ref"], default=os.environ.get("IMPL") or "labs")
    c.add_argument("--labs-dir", default=None)
    c.add_argument("--results", default="results.json")
    c.add_argument(
        "--no-upstream-tests",
        dest="upstream_tests",
        action="store_false",
        help="leave out the line of upstream's own unit tests (information only; phases "
        f"{', '.join(sorted(LAB_FILES))})",
    )
    sub.add_parser("diff", help="a symbol beside upstream's (see diff --help)")
    args = parser.parse_args(argv)
    if args.command == "generate":
        return generate(Path(args.out), args.check, args.force)
    if args.command == "solve":
        return solve(Path(args.out))
    return check(
        args.target, args.impl, args.labs_dir, args.results, pytest_args, args.upstream_tests
    )


if __name__ == "__main__":
    sys.exit(main())
