"""Grade a handout: run each exercise's tests (classroom/tests/test_<id>_*.py) in one pytest
process, print a table of points, tests passed and seconds per exercise with a hint for each
failure, and write a results file in the format Gradescope's autograder reads.

Every case's parameters are drawn from a seed: the public seed by default, the instructor's secret
one with --hidden (classroom/README.md). Oracles are computed at grading time; nothing is stored.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from classroom.manifest import BY_ID, EXERCISES

PUBLIC_SEED = 2512  # arXiv 2512.21852


def chosen_exercises(root):
    marker = root / ".classroom"
    return marker.read_text().split() if marker.exists() else [e.id for e in EXERCISES]


def run_tests(root, exercises, seed, hidden, verbose=False):
    """Run the exercises' tests under `root`; return one dict per test (see tests/conftest.py)."""
    files = sorted(str(path.relative_to(root)) for e in exercises
                   for path in (root / "classroom" / "tests").glob(f"test_{e.lower()}_*.py"))
    with tempfile.TemporaryDirectory() as tmp:
        results = pathlib.Path(tmp) / "results.json"
        env = {**os.environ, "CLASSROOM_SEED": str(seed), "CLASSROOM_RESULTS": str(results),
               "CLASSROOM_HIDDEN": "1" if hidden else "", "PYTHONPATH": str(root)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
               str(root / "classroom" / "tests"), *files]
        cmd += [] if verbose else ["--tb=no", "--no-header", "-rN"]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=not verbose, text=True)
        if not results.exists():
            raise SystemExit(f"the tests did not run (pytest exit {proc.returncode}):\n"
                             f"{(proc.stdout or '')[-2000:]}{(proc.stderr or '')[-2000:]}")
        return json.loads(results.read_text())


def summarize(tests, exercises):
    rows = []
    for exercise_id in exercises:
        mine = [t for t in tests if t["exercise"] == exercise_id]
        rows.append({"exercise": exercise_id, "title": BY_ID[exercise_id].title,
                     "points": sum(t["points"] for t in mine if t["passed"]),
                     "max_points": sum(t["points"] for t in mine),
                     "passed": sum(t["passed"] for t in mine), "tests": len(mine),
                     "seconds": sum(t["seconds"] for t in mine)})
    return rows


def print_report(rows, tests, hidden, seed):
    print(f"{'':4}{'exercise':<44}{'points':>10}{'tests':>9}{'seconds':>9}")
    for row in rows:
        print(f"{row['exercise']:<4}{row['title'][:43]:<44}"
              f"{row['points']:>5.1f} / {row['max_points']:<3.0f}"
              f"{row['passed']:>4} / {row['tests']:<3}"
              f"{row['seconds']:>8.1f}")
    total, most = sum(r["points"] for r in rows), sum(r["max_points"] for r in rows)
    print(f"{'':4}{'total':<44}{total:>5.1f} / {most:<3.0f}")
    for row in rows:
        failures = [t for t in tests if t["exercise"] == row["exercise"] and not t["passed"]]
        if failures:
            print(f"\n{row['exercise']} failed {len(failures)} test(s). "
                  f"Hint: {failures[0]['hint']}")
        for t in failures:
            print(f"  {t['name']}: {t['message']}")
    if hidden:
        print(f"\nThese are the hidden tests (seed {seed}).")
    else:
        print("\nThese are the PUBLIC tests only. Your grade comes from hidden tests with other "
              "parameters (lengths, parameters, masks, dtypes, seeds), and E8's written answer "
              "from a rubric: passing here does not mean passing there.")


def gradescope(rows, tests, hidden):
    """The results.json Gradescope's autograder reads: a score, and one entry per test."""
    return {
        "score": round(sum(r["points"] for r in rows), 3),
        "output": ("Hidden tests." if hidden else "Public tests only: the grade comes from hidden "
                   "tests."),
        "tests": [{"name": f"{t['exercise']} {t['name']}", "score": t["points"] * t["passed"],
                   "max_score": t["points"], "visibility": "visible",
                   "output": "" if t["passed"] else f"{t['message']}\nhint: {t['hint']}"}
                  for t in tests],
    }


def hidden_copy(submission, exercises):
    """A fresh handout (in a temporary directory) holding only the submission's exercise files."""
    from classroom import handout

    out = pathlib.Path(tempfile.mkdtemp(prefix="classroom-hidden-")) / "handout"
    handout.make(out, exercises, git=False)
    for file in sorted({file for e in exercises for file, _ in BY_ID[e].functions}):
        if not (submission / file).exists():
            raise SystemExit(f"the submission {submission} has no {file}")
        shutil.copyfile(submission / file, out / file)
        if "oracle" in (submission / file).read_text():
            print(f"WARNING: the submission's {file} mentions 'oracle' (the grader's references)")
    if (submission / "experiment").is_dir() and "E8" in exercises:
        shutil.copytree(submission / "experiment", out / "experiment")
    return out


def main(args):
    root = pathlib.Path.cwd()
    if args.hidden:
        if args.seed is None:
            raise SystemExit("--hidden needs --seed SECRET (the instructor's)")
        submission = pathlib.Path(args.submission or ".").resolve()
        exercises = chosen_exercises(submission)
        root = hidden_copy(submission, exercises)
    else:
        exercises = chosen_exercises(root)
    if args.exercises:
        wanted = [e.upper() for e in args.exercises]
        unknown = [e for e in wanted if e not in exercises]
        if unknown:
            raise SystemExit(f"{', '.join(unknown)}: not in this handout ({', '.join(exercises)})")
        exercises = wanted
    seed = PUBLIC_SEED if args.seed is None else args.seed
    try:
        tests = run_tests(root, exercises, seed, args.hidden, args.verbose)
    finally:
        if args.hidden:
            shutil.rmtree(root.parent)
    rows = summarize(tests, exercises)
    print_report(rows, tests, args.hidden, seed)
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(gradescope(rows, tests, args.hidden), indent=1))
    print(f"results: {out}")
    return rows, tests
