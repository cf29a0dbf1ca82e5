"""Grade a handout or a submission: for each exercise, a child process (probes.py, child.py) runs
the submitted functions on each case's inputs and returns their outputs; this process, which never
imports submitted code, computes the expected values (checks/, standins.py, reference.py),
compares, and writes the table and Gradescope's results.json.

Public (`grade` in a handout): the public seed, the child in the handout itself, messages with
values. Hidden (`grade --hidden --seed S --submission DIR`, and the Gradescope autograder): a
sandbox holding a fresh blank handout without the grader (classroom/) and the submission's files
of the assignment's exercises, a child per exercise that cannot import the grader (on Gradescope
run as `nobody`, who cannot read it either), messages that never print an expected value, results
that students see once grades are published. Each exercise stands alone: a file that is missing
or does not import costs the exercises that need it, with its error's first lines.
"""
import importlib
import json
import os
import pathlib
import re
import shutil
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from fractions import Fraction
from pathlib import Path

import torch

from classroom import child as children
from classroom.manifest import BY_ID, EXERCISES

PUBLIC_SEED = 2512  # arXiv 2512.21852
# the most seconds a case may take (each check sets its own, 20-120 s); lower it to try a timeout
CASE_SECONDS = float(os.environ.get("CLASSROOM_CASE_SECONDS") or "inf")
WORKERS = int(os.environ.get("CLASSROOM_WORKERS") or 2)  # exercises graded at once
CHECKS = {path.stem.split("_")[0].upper(): f"classroom.checks.{path.stem}"
          for path in (pathlib.Path(__file__).parent / "checks").glob("e[0-9]*_*.py")}


def prerequisites(exercises):
    """{exercise: the exercises that must be graded before it starts}. An exercise's functions are
    graded before any exercise whose child is sent stand-ins of them (a child cannot keep a
    stand-in, on disk, for one graded later); E8 (no submitted code, its files read by this
    process) before any child that runs submitted code could touch its files."""
    owner = {name: e for e in exercises for _, name in BY_ID[e].functions}
    first = {e for e in exercises if not BY_ID[e].functions}
    return {e: ({owner[attr] for _, attr in checks_of(e).PATCH if attr in owner} - {e})
            | (first if BY_ID[e].functions else set()) for e in exercises}


def run_order(exercises):
    """The exercises in an order that respects their prerequisites."""
    needs, order = prerequisites(exercises), []
    while len(order) < len(exercises):
        order += [e for e in exercises if e not in order and needs[e] <= set(order)][:1]
    return order


def checks_of(exercise_id):
    return importlib.import_module(CHECKS[exercise_id])


def grade_exercise(exercise_id, root, seed, hidden, missing, user):
    """One dict per test of the exercise: points, cases passed, messages, seconds."""
    checks = checks_of(exercise_id)
    kwargs = {"root": root} if exercise_id == "E8" else {}
    specs = checks.tests(seed, hidden, **kwargs)
    state = {"child": None, "broken": None}

    def run(probe, seconds, **args):
        if state["broken"]:
            raise children.Failed(state["broken"])
        if state["child"] is None:
            try:
                state["child"] = children.start(root, checks.OTHERS, checks.OWN, checks.PATCH,
                                                user, hidden)
            except children.Failed as error:  # e.g. an import that never ends: fail the rest fast
                state["broken"] = str(error)
                raise
            errors = state["child"]["import_errors"]
            if errors:
                state["broken"] = "; ".join(f"{name}.py does not import:\n" + "\n".join(lines)
                                            for name, lines in errors.items())
                raise children.Failed(state["broken"])
        return children.call(state["child"], probe, seconds, **args)

    results = []
    try:
        for spec in specs:
            start, passed, messages = time.monotonic(), 0, []
            for label, params in spec["cases"]:
                try:
                    if missing:
                        raise children.Failed(f"{', '.join(missing)}: not submitted")
                    seconds = min(spec["seconds"], CASE_SECONDS)
                    spec["check"](params, lambda probe, **a: run(probe, seconds, **a))
                    passed += 1
                except children.Failed as error:
                    messages.append(f"[{label}] {error}")
                    if state["child"] is not None and not error.alive and not state["broken"]:
                        children.stop(state["child"])  # a fresh child for the next case
                        state["child"] = None
                except Exception as error:  # noqa: BLE001  harness.Wrong, or a bad output
                    message = getattr(error, "hidden" if hidden else "public", None)
                    message = message or f"{type(error).__name__}: {str(error)[:200]}"
                    messages.append(f"[{label}] {message}")
            results.append({"exercise": exercise_id, "name": spec["name"],
                            "points": Fraction(spec["points"]).limit_denominator(1000),
                            "cases": len(spec["cases"]), "passed": passed,
                            "messages": unique(messages), "hint": spec["hint"],
                            "seconds": time.monotonic() - start})
    finally:
        if state["child"] is not None:
            children.stop(state["child"])
    return results


def unique(messages):
    """A module's import error is one message, not one per case."""
    seen, out = set(), []
    for message in messages:
        key = message.split("] ", 1)[-1]
        if key not in seen:
            seen.add(key)
            out.append(message)
    return out


def score(test):
    return test["points"] * test["passed"] / test["cases"]


def find(submission, name, directory=False):
    """submission/name, or the shallowest match in a folder of the upload (a zipped handout); never
    a link (it could point at the grader's files)."""
    def plain(path):
        parts = path.relative_to(submission).parts
        return (not any(part.startswith((".", "__MACOSX")) for part in parts[:-1])
                and not any((submission / Path(*parts[:i + 1])).is_symlink()
                            for i in range(len(parts)))
                and (path.is_dir() if directory else path.is_file()))

    matches = [submission / name] + sorted(submission.rglob(name),
                                           key=lambda p: (len(p.parts), str(p)))
    return next((path for path in matches if path.exists() and plain(path)), None)


def no_links(folder, names):
    return [name for name in names if os.path.islink(os.path.join(folder, name))]


def build_sandbox(sandbox, base, submission, exercises, received):
    """A blank handout (`base`) without the grader, with the submission's files of `exercises`
    copied in; `received` gets {file: 'received' | 'not submitted'}."""
    shutil.copytree(base, sandbox, ignore=shutil.ignore_patterns(".git"))
    shutil.rmtree(sandbox / "classroom", ignore_errors=True)
    for exercise_id in exercises:
        for file in files_of(exercise_id):
            found = find(submission, file.rstrip("/"), directory=file.endswith("/"))
            received[file] = "received" if found else "not submitted"
            if found and file.endswith("/"):
                shutil.copytree(found, sandbox / file, ignore=no_links, dirs_exist_ok=True)
            elif found:
                shutil.copyfile(found, sandbox / file)


def files_of(exercise_id):
    """The files a student hands in for an exercise (E8: the experiment/ folder)."""
    exercise = BY_ID[exercise_id]
    return sorted({file for file, _ in exercise.functions}) or ["experiment/"]


def give_to(sandbox, user):
    """Make the sandbox the child's own (it runs as `user`, e.g. nobody, when we are root), and the
    way to it traversable by that user: the sandbox's temporary folder, which holds nothing else,
    opened for traversal only (0711), and every folder above it (the system's: /tmp) checked."""
    if user is None:
        return
    os.chmod(sandbox.parent, 0o711)
    for item in [sandbox, *sandbox.rglob("*")]:
        os.chown(item, *user, follow_symlinks=False)
    for folder in sandbox.parent.parents:
        status = os.stat(folder)
        bit = 0o100 if status.st_uid == user[0] else 0o010 if status.st_gid == user[1] else 0o001
        if not status.st_mode & bit:
            raise SystemExit(f"the child's user cannot reach the sandbox: {folder} is closed to "
                             "it (set TMPDIR to a folder it can traverse, as /tmp)")


def grade(root, exercises, seed, hidden, submission=None, base=None, child_user=None):
    """Grade; returns (tests, received). Hidden: a sandbox from `base` (a blank handout, built
    from this repository if None) and `submission`, removed afterwards; its children run as
    `child_user` if given."""
    children.become_subreaper()
    torch.set_num_threads(1)  # small tensors; the exercises run side by side
    for exercise_id in exercises:  # import every check (and transformers) before any child runs
        checks_of(exercise_id)
    received = {}
    with tempfile.TemporaryDirectory(prefix="classroom-") as tmp, \
            tempfile.TemporaryDirectory(prefix="classroom-sandbox-") as outer:
        user = None
        if hidden:
            if base is None:
                from classroom import handout

                base = handout.make(pathlib.Path(tmp) / "base", exercises, git=False)
                shutil.rmtree(base / "classroom")  # the grader is no file a child can find
            root = pathlib.Path(outer) / "sandbox"
            build_sandbox(root, base, submission, exercises, received)
            user = children.sandbox_user(child_user)
            give_to(root, user)
        tests, needs, done, running = [], prerequisites(exercises), set(), {}
        with ThreadPoolExecutor(WORKERS) as pool:  # exercises side by side, prerequisites first
            while len(done) < len(exercises):
                for e in run_order(exercises):
                    if e not in done | set(running) and needs[e] <= done and len(running) < WORKERS:
                        missing = [f for f in files_of(e) if received.get(f) == "not submitted"]
                        running[e] = pool.submit(grade_exercise, e, root, seed, hidden, missing,
                                                 user)
                finished, _ = wait(running.values(), return_when=FIRST_COMPLETED)
                for e in [e for e, future in running.items() if future in finished]:
                    tests += running.pop(e).result()
                    done.add(e)
        if user and user[0] in children.UNCONFINED:  # no PID namespace held its processes
            children.kill_user(user[0])
    order = {e: i for i, e in enumerate(exercises)}
    return sorted(tests, key=lambda t: order[t["exercise"]]), received


def summarize(tests, exercises):
    rows = []
    for exercise_id in exercises:
        mine = [t for t in tests if t["exercise"] == exercise_id]
        rows.append({"exercise": exercise_id, "title": BY_ID[exercise_id].title,
                     "points": sum((score(t) for t in mine), Fraction(0)),
                     "max_points": sum((t["points"] for t in mine), Fraction(0)),
                     "passed": sum(t["passed"] == t["cases"] for t in mine), "tests": len(mine),
                     "seconds": sum(t["seconds"] for t in mine)})
    return rows


def print_report(rows, tests, hidden, seed, received, verbose=False):
    print(f"{'':4}{'exercise':<44}{'points':>12}{'tests':>9}{'seconds':>9}")
    for row in rows:
        print(f"{row['exercise']:<4}{row['title'][:43]:<44}"
              f"{float(row['points']):>6.2f} / {float(row['max_points']):<3g}"
              f"{row['passed']:>4} / {row['tests']:<3}{row['seconds']:>8.1f}")
    total, most = sum(r["points"] for r in rows), sum(r["max_points"] for r in rows)
    print(f"{'':4}{'total':<44}{float(total):>6.2f} / {float(most):<3g}")
    if received:
        print("\nfiles: " + ", ".join(f"{file} {status}" for file, status in received.items()))
    for t in tests:
        if t["passed"] < t["cases"]:
            print(f"\n{t['exercise']} {t['name']}: {t['passed']}/{t['cases']} cases. "
                  f"Hint: {t['hint']}")
            for message in t["messages"] if verbose else t["messages"][:6]:
                print("  " + message.replace("\n", "\n    "))
    if hidden:
        print("\nThese are the hidden tests" + (f" (seed {seed})." if seed is not None else "."))
    else:
        print("\nThese are the PUBLIC tests only. Your grade comes from hidden tests with other "
              "parameters (lengths, parameters, masks, dtypes, seeds), and E8's written answer "
              "from a rubric: passing here does not mean passing there.")


def gradescope(rows, tests, hidden, received, exercises):
    """The results.json Gradescope's autograder reads. Hidden: the tests are seen once grades are
    published; a 0-point entry per exercise says at once which files arrived and whether they
    import."""
    visibility = "after_published" if hidden else "visible"
    entries = [{"name": f"{t['exercise']} {t['name']}", "score": float(score(t)),
                "max_score": float(t["points"]), "visibility": visibility,
                "status": "passed" if t["passed"] == t["cases"] else "failed",
                "output": (f"{t['passed']}/{t['cases']} cases passed" if t["passed"] == t["cases"]
                           else "\n".join(t["messages"]) + f"\nhint: {t['hint']}")}
               for t in tests]
    if hidden:
        for exercise_id in exercises:
            files = files_of(exercise_id)
            imports = [m for t in tests if t["exercise"] == exercise_id for m in t["messages"]
                       if "does not import" in m][:1]
            status = ", ".join(f"{f} {received.get(f, '?')}" for f in files)
            entries.append({"name": f"{exercise_id} files", "score": 0.0, "max_score": 0.0,
                            "visibility": "visible", "output": status + (
                                "\n" + imports[0].split("] ", 1)[-1] if imports else "")})
    total = sum((r["points"] for r in rows), Fraction(0))
    return {"score": round(float(total), 4),
            "output": ("Hidden tests: their results appear when grades are published."
                       if hidden else "Public tests only: the grade comes from hidden tests."),
            "tests": entries}


def secret_seed(args):
    """The hidden seed, from --seed or --seed-file. Every user can read a command line (through
    /proc), so a child of another user is kept from the seed only by a file it cannot read."""
    if (args.seed is None) == (args.seed_file is None):
        raise SystemExit("--hidden needs --seed SECRET_INT or --seed-file PATH (one of them)")
    if args.seed_file is None:
        if getattr(args, "child_user", None):
            raise SystemExit("--child-user: give the seed with --seed-file (the child's user can "
                             "read the grader's command line)")
        return args.seed
    path = pathlib.Path(args.seed_file)
    try:
        text = path.read_text().strip()
        readable_by_others = path.stat().st_mode & 0o044
    except OSError as error:
        raise SystemExit(f"--seed-file {path}: {error.strerror}") from None
    if getattr(args, "child_user", None) and readable_by_others:
        raise SystemExit(f"--seed-file {path}: other users can read it (chmod 600 it)")
    if not re.fullmatch(r"-?\d+", text):
        raise SystemExit(f"--seed-file {path}: not an integer")
    return int(text)


def main(args):
    if args.hidden:
        args.seed = secret_seed(args)
        submission = pathlib.Path(args.submission or ".").resolve()
        if not submission.is_dir():
            raise SystemExit(f"--submission {submission}: no such directory")
        marker = submission / ".classroom"
        exercises = (args.assignment.split(",") if args.assignment else
                     marker.read_text().split() if marker.is_file() else [e.id for e in EXERCISES])
        root = None
    else:
        root = pathlib.Path.cwd()
        in_handout = (root / ".classroom").is_file() or (root / "classroom/handout.py").is_file()
        if not in_handout:
            raise SystemExit("run `python -m classroom grade` in a handout's directory")
        marker = root / ".classroom"
        exercises = marker.read_text().split() if marker.is_file() else [e.id for e in EXERCISES]
        submission = None
    exercises = [e.strip().upper() for e in exercises if e.strip()]
    unknown = [e for e in exercises if e not in BY_ID]
    if unknown:
        raise SystemExit(f"unknown exercise(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(BY_ID)}")
    if args.exercises:
        wanted = [e.upper() for e in args.exercises]
        if [e for e in wanted if e not in exercises]:
            raise SystemExit(f"{', '.join(e for e in wanted if e not in exercises)}: not in this "
                             f"assignment ({', '.join(exercises)})")
        exercises = wanted
    seed = PUBLIC_SEED if args.seed is None else args.seed
    base = pathlib.Path(args.base).resolve() if getattr(args, "base", None) else None
    tests, received = grade(root, exercises, seed, args.hidden, submission, base,
                            getattr(args, "child_user", None))
    rows = summarize(tests, exercises)
    print_report(rows, tests, args.hidden, None if args.seed_file else seed, received,
                 args.verbose)
    if not args.hidden:  # the public grader is importable here, never in hidden grading
        for file in sorted({f for e in exercises for f in files_of(e) if not f.endswith("/")}):
            if re.search(r"\b(classroom|standins)\b", (root / file).read_text(errors="replace")):
                print(f"WARNING: {file} mentions the grader (classroom, standins): hidden grading "
                      "runs your code where it cannot be imported")
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(gradescope(rows, tests, args.hidden, received, exercises), indent=1))
    print(f"results: {out}")
    return rows, tests
