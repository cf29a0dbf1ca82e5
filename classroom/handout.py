"""Make a handout: a copy of the project's tracked files with the chosen exercises' functions
blanked (and the functions that would give them away withheld), the answer keys, results and the
instructor's side of classroom/ left out, a student README, a leak check and a fresh git history
(see classroom/README.md). The public grader ships with it; hidden grading never lets submitted
code import it (grade.py)."""
import ast
import pathlib
import re
import subprocess

from classroom.manifest import BY_ID, EXERCISES

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Left out of every handout: the project's own tests (their references are the answer key), its
# results, documents that print solution lines, CI, and the instructor's side of classroom/;
# lab/kl_presets.py writes the peers' estimators out (E1's lines; check_kl runs without it).
DROP = [r"test_[^/]*\.py", r"tests/.*", r"assets/.*", r"studies/.*", r"lab/kl_presets\.py",
        r"docs/.*", r"\.ci/.*", r"README\.md", r"classroom/README\.md", r"classroom/handout\.py",
        r"classroom/bugs\.py", r"classroom/STUDENT\.md", r"classroom/autograder\.py"]
MIN_LEAK = 20  # a blanked line of at least this many characters must appear nowhere in a handout


def blank_function(source, name, exercise, withheld=False):
    """`source` with top-level function `name` reduced to its signature, docstring and a raise."""
    tree = ast.parse(source)
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise ValueError(f"{exercise.id}: no top-level function {name!r} to blank")
    lines = source.splitlines(keepends=True)
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    keep_until = body[0].end_lineno if has_doc else body[0].lineno - 1  # 1-based, inclusive
    indent = " " * (body[0].col_offset)
    why = (f"withheld from this handout: it holds {exercise.id}'s answer" if withheld else
           f"{exercise.id}: {exercise.title}; see README.md")
    stub = f'{indent}raise NotImplementedError("{why}")\n'
    return "".join(lines[:keep_until]) + stub + "".join(lines[node.end_lineno:])


def replace_function(source, name, new_def):
    """`source` with top-level function `name` replaced by the source text `new_def`."""
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = source.splitlines(keepends=True)
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    return "".join(lines[:start]) + new_def.rstrip("\n") + "\n" + "".join(lines[node.end_lineno:])


def function_lines(source, name):
    """The stripped lines of a top-level function's body after its docstring (what blanking
    removes)."""
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == name)
    body = node.body
    start = body[1].lineno if (isinstance(body[0], ast.Expr) and len(body) > 1
                               and isinstance(body[0].value, ast.Constant)) else body[0].lineno
    return [line.strip() for line in source.splitlines()[start - 1:node.end_lineno]]


def code_of(line):
    """A stripped line without its trailing comment: `x = f(y)  # pi(y)` and `x = f(y)` match."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def leaks(out, removed, shared=()):
    """(file, line) for each removed line of MIN_LEAK+ characters (comments aside) still in the
    handout: as a line of its own, comments aside, or inside other text when 2 * MIN_LEAK long.
    Only the `shared` lines (a helper call the kept code also makes) are let through."""
    found = []
    long_lines = {code_of(line) for line in removed if len(code_of(line)) >= MIN_LEAK}
    long_lines -= {code_of(line) for line in shared}
    for path in sorted(out.rglob("*")):
        if ".git" in path.parts or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        lines = {code_of(line) for line in text.splitlines()}
        found += [(str(path.relative_to(out)), line) for line in sorted(long_lines)
                  if line in lines or (len(line) >= 2 * MIN_LEAK and line in text)]
    return found


def student_readme(chosen):
    experiment = {"experiment/ (a folder: zip it with the files)"} if "E8" in chosen else set()
    files = sorted({file for e in chosen for file, _ in BY_ID[e].functions} | experiment)
    parts = [(ROOT / "classroom" / "STUDENT.md").read_text().replace(
        "{files}", ", ".join(f"`{file}`" for file in files))]
    for exercise in EXERCISES:
        if exercise.id not in chosen:
            continue
        where = ", ".join(f"`{file[:-3]}.{name}`" for file, name in exercise.functions)
        parts.append(f"\n### {exercise.id}. {exercise.title} (~{exercise.minutes} min)\n\n"
                     + (f"Blanked: {where}.\n\n" if where else "")
                     + f"{exercise.statement}\n\nHint: {exercise.hint}\n")
    return "".join(parts)


def make(out, chosen, git=True):
    """Write the handout of exercises `chosen` (ids) to `out`; refuse on a leak. Returns `out`."""
    out = pathlib.Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty: a handout never overwrites a directory")
    unknown = [e for e in chosen if e not in BY_ID]
    if unknown:
        raise SystemExit(f"unknown exercise(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(BY_ID)}")
    # tracked files and new ones git does not ignore
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = [f for f in files if not any(re.fullmatch(pattern, f) for pattern in DROP)]
    texts = {f: (ROOT / f).read_bytes() for f in files}
    removed, shared = [], []
    for exercise_id in chosen:
        exercise = BY_ID[exercise_id]
        shared += exercise.shared
        for file, name in exercise.functions:
            source = texts[file].decode()
            removed += function_lines(source, name)
            texts[file] = blank_function(source, name, exercise).encode()
        for file, name in exercise.withheld:
            texts[file] = blank_function(texts[file].decode(), name, exercise, True).encode()
    texts["README.md"] = student_readme(chosen).encode()
    out.mkdir(parents=True, exist_ok=True)
    for file, data in texts.items():
        (out / file).parent.mkdir(parents=True, exist_ok=True)
        (out / file).write_bytes(data)
    (out / ".classroom").write_text(" ".join(chosen) + "\n")  # the exercises this handout asks
    found = leaks(out, removed, shared)
    if found:
        import shutil
        shutil.rmtree(out)
        listing = "; ".join(f"{file}: {line!r}" for file, line in found[:5])
        raise SystemExit(f"leak check: {len(found)} solution line(s) remain ({listing}); "
                         "no handout written")
    if git:
        run = lambda *cmd: subprocess.run(["git", *cmd], cwd=out, check=True,  # noqa: E731
                                          capture_output=True)
        run("init", "-q")
        run("add", "-A")
        run("-c", "user.name=classroom", "-c", "user.email=classroom@localhost", "commit", "-q",
            "-m", f"Handout: exercises {', '.join(chosen)}")
    return out
