"""The classroom package kept honest (classroom/README.md): a handout builds and passes its leak
check; blank, it scores 0 with every failure naming its own exercise; the solution scores full marks
at the public seed and a hidden one; every known-bug variant of classroom/bugs.py loses points, and
so does a lookup of the public cases' answers. Each exploit a student could try is kept here as a
submission and earns nothing at a hidden seed: rewriting the results, importing the grader's
references, reading expected values from the messages, adapting E3 from toy.py's other functions,
hand-written E8 files, a case that never returns. A syntax error costs only its exercises, a
partial upload is graded, nothing is left in the temporary directory, and the Gradescope autograder
zip runs end to end on a fake /autograder tree."""
import ast
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest

from classroom import handout
from classroom.bugs import BUGS
from classroom.grade import checks_of, run_order
from classroom.manifest import BY_ID, EXERCISES

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository
SOLUTION_FILES = sorted({file for e in EXERCISES for file, _ in e.functions})
STUDY = ROOT / "studies" / "cpu-small"
SECRET = 11  # the hidden seed of these tests


def grade(cwd, *args, env=None):
    """`python -m classroom grade ARGS` in cwd -> ({exercise: (score, max)}, tests, stdout)."""
    with tempfile.TemporaryDirectory() as tmp:  # never in the repository
        out = pathlib.Path(tmp) / "results.json"
        proc = subprocess.run([sys.executable, "-m", "classroom", "grade", *args, "--json",
                               str(out)], cwd=cwd, capture_output=True, text=True,
                              env={**os.environ, **(env or {})})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return scores_of(out) + (proc.stdout,)


def scores_of(results):
    tests = json.loads(results.read_text())["tests"]
    scores = {}
    for t in tests:
        exercise = t["name"].split()[0]
        score, most = scores.get(exercise, (0.0, 0.0))
        scores[exercise] = (score + t["score"], most + t["max_score"])
    return scores, tests


def hidden(submission, *exercises):
    """The hidden grade of `submission` for the assignment `exercises`."""
    return grade(ROOT, "--hidden", "--seed", str(SECRET), "--submission", str(submission),
                 "--assignment", ",".join(exercises))


def no_expected_values(tests):
    """Hidden outputs never print a wanted value ("want [...]", "expected 0.123")."""
    for t in tests:
        assert not re.search(r"\b(want|expected)\b[^\n]{0,3}[-\[(]?\d*\.\d", t["output"]), t


def full(scores, exercise):
    score, most = scores[exercise]
    return most > 0 and abs(score - most) < 1e-9


@pytest.fixture(scope="module")
def blank(tmp_path_factory):
    return handout.make(tmp_path_factory.mktemp("classroom") / "blank",
                        [e.id for e in EXERCISES])


def write_experiment(out):
    """The CPU study's K1-in-reward and K1-in-loss runs at beta = 1, their plot and an answer."""
    experiment = out / "experiment"
    for run, study in (("k1-reward", "k1-reward-1"), ("k1-loss", "k1-loss-1")):
        (experiment / run).mkdir(parents=True)
        for name in ("config.json", "metrics.jsonl"):
            shutil.copyfile(STUDY / study / name, experiment / run / name)
    subprocess.run([sys.executable, "plot.py", "experiment/k1-reward", "experiment/k1-loss",
                    "--out", "experiment/plot.png"], cwd=out, check=True, capture_output=True)
    (experiment / "answer.md").write_text(
        "K1 in the reward stays closer to the reference: by Table 1 its expected gradient is the "
        "gradient of the sequence-level reverse KL, while K1 in the loss has zero expected "
        "gradient, so at beta = 1 it regularizes nothing and drifts as far as no KL at all.\n")


@pytest.fixture(scope="module")
def solved(blank, tmp_path_factory):
    """The blank handout with the solution's files and an experiment of real runs put back."""
    out = tmp_path_factory.mktemp("classroom") / "solved"
    shutil.copytree(blank, out)
    for file in SOLUTION_FILES:
        shutil.copyfile(ROOT / file, out / file)
    write_experiment(out)
    return out


def submission(tmp_path, solved, **files):
    """A copy of the solved handout with some files replaced (name -> text; None deletes)."""
    work = tmp_path / "submission"
    shutil.copytree(solved, work)
    for name, text in files.items():
        path = work / name.replace("__", "/")
        if text is None:
            path.unlink() if path.is_file() else shutil.rmtree(path)
        else:
            path.write_text(text)
    return work


def test_handout_is_a_clean_copy(blank):
    names = {str(p.relative_to(blank)) for p in blank.rglob("*") if ".git" not in p.parts}
    assert "train.py" in names and "classroom/checks/e1_estimate.py" in names
    assert not [n for n in names if n.startswith(("test_", "studies", "assets", "docs"))]
    assert not {"classroom/bugs.py", "classroom/handout.py", "classroom/README.md",
                "classroom/autograder.py"} & names
    readme = (blank / "README.md").read_text()
    assert "### E8." in readme and "## What to submit" in readme and "`kl.py`" in readme
    log = subprocess.run(["git", "log", "--oneline"], cwd=blank, capture_output=True, text=True)
    assert len(log.stdout.splitlines()) == 1  # a fresh history
    source = (blank / "kl.py").read_text()
    assert 'raise NotImplementedError("E1: ' in source and "expm1" not in source
    with pytest.raises(SystemExit, match="not empty"):
        handout.make(blank, ["E1"])
    proc = subprocess.run([sys.executable, "-m", "classroom", "handout", "../again"], cwd=blank,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "instructor's repository" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_leak_check_refuses(tmp_path, monkeypatch):
    """A handout that still prints a blanked line anywhere is not written."""
    line = next(line for line in handout.function_lines((ROOT / "kl.py").read_text(), "estimate")
                if "expm1" in line)
    readme = handout.student_readme
    monkeypatch.setattr(handout, "student_readme", lambda chosen: readme(chosen) + line)
    with pytest.raises(SystemExit, match="leak check"):
        handout.make(tmp_path / "leaky", ["E1"], git=False)
    assert not (tmp_path / "leaky").exists()


def adapt_converge(toy_source):
    """The E3 exploit: toy.expected_gradient made of the lines of toy.converge (its pi(y) weight
    and its call of training_loss), if the handout still has them; else the blank function."""
    weight = re.search(r"^ *weight = logp\.sum\(-1, keepdim=True\)\.exp\(\)\.detach\(\)",
                       toy_source, re.M)
    call = re.search(r"^ *loss = training_loss\(logp, ref_logp, reward, kind, place, beta, weight, "
                     r"num_tokens=1\)", toy_source, re.M)
    if not (weight and call):
        return toy_source
    body = f'''
def expected_gradient(kind, place, T, theta=THETA, ref=REF):
    y, _ = all_sequences(T)
    a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in theta)
    logp = bernoulli_logp(toy_logits(a, b, y), y)
    ref_logp = bernoulli_logp(toy_logits(*ref, y), y)
    {weight.group().strip()}
    reward, beta = torch.zeros(len(y), dtype=f64), 1.0
    {call.group().strip()}
    return torch.stack(torch.autograd.grad(loss, (a, b)))
'''
    return handout.replace_function(toy_source, "expected_gradient", body)


def test_e3_is_not_given_away_by_the_rest_of_toy_py(blank, tmp_path, monkeypatch):
    """toy.converge held E3's answer: it is withheld, the adapted exploit scores nothing, and the
    leak check refuses a handout that keeps it."""
    toy = (blank / "toy.py").read_text()
    work = tmp_path / "e3"
    shutil.copytree(blank, work)
    (work / "toy.py").write_text(adapt_converge(toy))
    scores, _, _ = hidden(work, "E3")
    assert scores["E3"][0] == 0
    assert "withheld from this handout" in toy
    monkeypatch.setitem(BY_ID, "E3", dataclasses.replace(BY_ID["E3"], withheld=()))
    with pytest.raises(SystemExit, match="leak check"):
        handout.make(tmp_path / "keeps-converge", ["E3"], git=False)


def test_blank_handout_scores_zero_and_names_each_exercise(blank):
    scores, tests, stdout = grade(blank)
    assert set(scores) == {e.id for e in EXERCISES}
    assert all(score == 0 for score, _ in scores.values())
    for t in tests:
        exercise = t["name"].split()[0]
        if t["max_score"]:
            assert f"{exercise}:" in t["output"], t  # NotImplementedError("E3: ...") or "E8: no"
    assert "PUBLIC tests only" in stdout
    assert not (blank / ".matplotlib").exists()


@pytest.mark.parametrize("mode", ["public", "hidden"])
def test_solution_scores_full_marks(solved, mode):
    if mode == "hidden":
        scores, tests, stdout = hidden(solved, *BY_ID)
    else:
        scores, tests, stdout = grade(solved)
    assert all(full(scores, e) for e in BY_ID), stdout
    totals = re.search(r"total\s+([\d.]+) / (\d+)", stdout)
    assert totals and totals.group(1) == "48.00" and totals.group(2) == "48", stdout
    visibility = {t["visibility"] for t in tests if t["max_score"]}
    assert visibility == ({"after_published"} if mode == "hidden" else {"visible"})


def bug_rounds():
    """Rounds of at most one bug per exercise: the exercises are graded independently."""
    rounds = []
    for bug in BUGS:
        free = next((r for r in rounds if bug[0] not in {b[0] for b in r}), None)
        (free.append(bug) if free is not None else rounds.append([bug]))
    return rounds


@pytest.mark.parametrize("bugs", bug_rounds(), ids=lambda r: "+".join(b[0] for b in r))
def test_every_known_bug_loses_points(solved, tmp_path, bugs):
    work = tmp_path / "buggy"
    shutil.copytree(solved, work)
    for exercise, name, file, solution, buggy in bugs:
        text = (work / file).read_text()
        assert text.count(solution) == 1, f"{exercise} '{name}' no longer matches {file}"
        (work / file).write_text(text.replace(solution, buggy))
    scores, _, stdout = grade(work, *sorted({b[0] for b in bugs}))
    for exercise, name, *_ in bugs:
        assert not full(scores, exercise), f"{exercise} '{name}' kept full marks:\n{stdout}"
    buggy = {b[0] for b in bugs}  # and no other exercise lost anything
    assert all(full(scores, e) for e in scores if e not in buggy), stdout


RECORD = '''
def rloo(returns, group_size):
    import json, pathlib
    R = _groups(returns, group_size)
    answer = (R - (R.sum(1, keepdim=True) - R) / (group_size - 1)).reshape(-1)
    path = pathlib.Path(%r)
    table = json.loads(path.read_text()) if path.exists() else {}
    table[repr((returns.tolist(), group_size))] = answer.tolist()
    path.write_text(json.dumps(table))
    return answer
'''
LOOKUP = '''
def rloo(returns, group_size):
    answer = TABLE.get(repr((returns.tolist(), group_size)))
    if answer is None:
        return torch.zeros_like(returns)
    return torch.tensor(answer, dtype=returns.dtype)


TABLE = %s
'''


def test_a_lookup_of_the_public_answers_fails_the_hidden_tests(solved, tmp_path):
    """Record rloo's answers on the public cases, then answer from that table: full marks in
    public, points lost at the instructor's seed."""
    work = submission(tmp_path, solved)
    path, table_path = work / "advantage.py", tmp_path / "answers.json"
    path.write_text(handout.replace_function(path.read_text(), "rloo", RECORD % str(table_path)))
    grade(work, "E4")
    table = json.loads(table_path.read_text())
    assert table  # the public cases were seen
    path.write_text(handout.replace_function(path.read_text(), "rloo", LOOKUP % repr(table)))
    public, _, _ = grade(work, "E4")
    assert full(public, "E4")
    scores, tests, _ = hidden(work, "E4")
    assert not full(scores, "E4")
    no_expected_values(tests)


TAMPER = '''
import atexit, json, os, time


def _full_marks(path):
    results = json.loads(open(path).read())
    rows = results if isinstance(results, list) else results["tests"]
    for row in rows:
        if "passed" in row:
            row["passed"] = True
        if "max_score" in row:
            row["score"] = row["max_score"]
    if isinstance(results, dict):
        results["score"] = sum(row.get("max_score", 0) for row in rows)
    open(path, "w").write(json.dumps(results))


def _results_paths():
    """The grader's results files: an env var, or --json on an ancestor's command line."""
    paths, pid = [os.environ.get("CLASSROOM_RESULTS")], os.getppid()
    while pid > 1:
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\\0")
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
        paths += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--json"]
    return [p for p in paths if p]


def _tamper():
    for path in _results_paths():
        if os.path.exists(path):
            _full_marks(path)


atexit.register(_tamper)
if os.fork() == 0:  # a daemon that outlives the child and rewrites the results once written
    os.setsid()
    if os.fork() == 0:
        paths = _results_paths()
        for _ in range(150):
            time.sleep(0.1)
            for path in paths:
                if os.path.exists(path) and time.time() - os.path.getmtime(path) < 5:
                    time.sleep(0.3)
                    _full_marks(path)
                    os._exit(0)
    os._exit(0)
'''


def test_a_submission_cannot_rewrite_its_results(blank, tmp_path):
    """A kl.py whose import registers an atexit hook and forks a daemon, both rewriting the
    results file to full marks: the grader kills both, and E1 scores nothing."""
    work = tmp_path / "tamper"
    shutil.copytree(blank, work)
    (work / "kl.py").write_text((work / "kl.py").read_text() + TAMPER)
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "classroom", "grade", "--hidden", "--seed",
                           str(SECRET), "--submission", str(work), "--assignment", "E1", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True)
    time.sleep(3)  # a daemon, if one survived, would rewrite the file by now
    scores, _ = scores_of(out)
    assert scores["E1"][0] == 0, proc.stdout[-2000:]
    assert json.loads(out.read_text())["score"] == 0


ORACLE = '''
def estimate(logp, ref_logp, kind, clamp="none"):
    """Any spelling of the grader's references: by name, by package, by a file in this folder or
    on the import path."""
    import importlib, importlib.util, pathlib, sys
    for name in ["ora" + "cle", "classroom.standins", "classroom.reference", "standins",
                 "tests.oracle", "classroom.tests.oracle", "reference"]:
        try:
            return importlib.import_module(name).estimate(logp, ref_logp, kind, clamp)
        except (ImportError, AttributeError):
            pass
    here = pathlib.Path(__file__).resolve()
    for folder in [here.parent, *map(pathlib.Path, sys.path[:1])]:
        for path in folder.rglob("*.py"):
            if path != here and path.is_file() and "def estimate(" in path.read_text():
                spec = importlib.util.spec_from_file_location("found", path)
                module = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(module)
                    return module.estimate(logp, ref_logp, kind, clamp)
                except Exception:
                    pass
    raise NotImplementedError("E1: no reference found")
'''


def test_the_grader_s_references_cannot_be_imported(blank, tmp_path):
    """kl.estimate that imports the grader's references by every name it could have, or loads
    any file of its folder (or the import path's first) that defines estimate: the sandbox has
    none, E1 scores 0. (Reading the grader's files elsewhere on disk: classroom/README.md.)"""
    work = tmp_path / "oracle"
    shutil.copytree(blank, work)
    (work / "kl.py").write_text(handout.replace_function((work / "kl.py").read_text(),
                                                         "estimate", ORACLE))
    public, _, _ = grade(work, "E1")
    assert full(public, "E1")  # in the handout the public grader is there to import
    scores, tests, _ = hidden(work, "E1")
    assert scores["E1"][0] == 0
    assert any("no reference found" in t["output"] for t in tests)


RECORD_E3 = '''
def expected_gradient(kind, place, T, theta=THETA, ref=REF):
    import json
    with open(%r, "a") as file:
        file.write(json.dumps([kind, place, T, list(theta), list(ref)]) + "\\n")
    return torch.zeros(2, dtype=f64)
'''
LOOKUP_E3 = '''
def expected_gradient(kind, place, T, theta=THETA, ref=REF):
    key = repr([kind, place, T, [float(v) for v in theta], [float(v) for v in ref]])
    return torch.tensor(TABLE.get(key, [0.0, 0.0]), dtype=f64)


TABLE = %s
'''


def test_hidden_messages_give_no_expected_values(blank, tmp_path):
    """Return zeros and record the inputs, read the wanted values from the hidden messages, answer
    from that table: E3 gains nothing, and no message holds an expected value."""
    work, seen = tmp_path / "messages", tmp_path / "seen.jsonl"
    shutil.copytree(blank, work)
    toy = (work / "toy.py").read_text()
    (work / "toy.py").write_text(handout.replace_function(toy, "expected_gradient",
                                                          RECORD_E3 % str(seen)))
    scores, tests, stdout = hidden(work, "E3")
    no_expected_values(tests)
    inputs = [json.loads(line) for line in seen.read_text().splitlines()]
    inputs = [i for i in inputs if i[:2] != ["k1", "loss"]]  # zeros pass there: no message
    messages = [line for t in tests for line in t["output"].splitlines()] + stdout.splitlines()
    wanted = [[float(v) for v in m.group(1).split(",")]
              for line in messages for m in re.finditer(r"want \[([^\]]*)\]", line)]
    table = {repr(i): w for i, w in zip(inputs, wanted)}
    (work / "toy.py").write_text(handout.replace_function(toy, "expected_gradient",
                                                          LOOKUP_E3 % repr(table)))
    after, _, _ = hidden(work, "E3")
    assert after["E3"][0] <= scores["E3"][0] + 1e-9
    numbers = {round(float(x), 6) for line in messages
               for x in re.findall(r"-?\d+\.\d{3,}(?:e-?\d+)?", line)}
    from classroom.checks import e3_enumeration
    from classroom.reference import references, toy as enumerate_toy

    for spec in e3_enumeration.tests(SECRET, True):
        for _, ((kind, place), params) in spec["cases"]:
            want = e3_enumeration.CONFIGS[kind, place][1](references(enumerate_toy(*params)))
            assert not {round(v, 6) for v in want.tolist() if abs(v) > 1e-6} & numbers


def test_a_case_that_never_returns_times_out(solved, tmp_path):
    """kl.estimate that never returns with clamp='verl': that case fails with a timeout, the rest
    of E1 still passes."""
    work = submission(tmp_path, solved)
    source = (work / "kl.py").read_text()
    verl = '    if clamp == "verl":\n'
    assert source.count(verl) == 1
    sleep = "        __import__('time').sleep(600)\n"
    (work / "kl.py").write_text(source.replace(verl, verl + sleep))
    scores, tests, _ = grade(work, "E1", env={"CLASSROOM_CASE_SECONDS": "2"})
    assert scores["E1"] == (5.0, 6.0)
    assert "timeout" in next(t["output"] for t in tests if t["name"] == "E1 verl_clamp")


def test_a_syntax_error_costs_only_its_exercises(solved, tmp_path):
    """kl.py that does not parse: E1 (kl.estimate) scores 0 with the error's lines; E3 (toy.py
    imports kl) and E4 still score full marks."""
    work = submission(tmp_path, solved)
    (work / "kl.py").write_text((work / "kl.py").read_text() + "\ndef broken(:\n    pass\n")
    scores, tests, stdout = hidden(work, "E1", "E3", "E4")
    no_expected_values(tests)
    assert scores["E1"][0] == 0 and full(scores, "E3") and full(scores, "E4"), stdout
    e1 = "\n".join(t["output"] for t in tests if t["name"].startswith("E1"))
    assert "kl.py does not import" in e1 and "SyntaxError" in e1 and "def broken(:" in e1


def test_a_partial_upload_is_graded(tmp_path):
    """Only kl.py and advantage.py uploaded (no handout around them) for an assignment E1, E4, E6:
    E1 and E4 are graded, E6 scores 0 saying rollout.py was not submitted, and no temporary
    folder is left behind."""
    upload = tmp_path / "upload"
    upload.mkdir()
    for file in ("kl.py", "advantage.py"):
        shutil.copyfile(ROOT / file, upload / file)
    before = set(pathlib.Path(tempfile.gettempdir()).glob("classroom-*"))
    scores, tests, stdout = hidden(upload, "E1", "E4", "E6")
    assert full(scores, "E1") and full(scores, "E4") and scores["E6"][0] == 0, stdout
    assert all("rollout.py: not submitted" in t["output"] for t in tests
               if t["name"].startswith("E6") and t["max_score"])
    assert set(pathlib.Path(tempfile.gettempdir()).glob("classroom-*")) == before


def test_e8_needs_the_runs_themselves(solved, tmp_path):
    """Hand-written E8 files (the flags in config.json, 20 lines of {"kl_k1": 0}, a PNG header, 30
    words) score nothing; so do real runs whose plot is not theirs."""
    fake = tmp_path / "fake"
    shutil.copytree(solved, fake)
    shutil.rmtree(fake / "experiment")
    for run, place in (("k1-reward", "reward"), ("k1-loss", "loss")):
        (fake / "experiment" / run).mkdir(parents=True)
        (fake / "experiment" / run / "config.json").write_text(json.dumps(
            {"kl": "k1", "place": place, "beta": 1.0}))
        (fake / "experiment" / run / "metrics.jsonl").write_text('{"kl_k1": 0}\n' * 20)
    (fake / "experiment" / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (fake / "experiment" / "answer.md").write_text("word " * 30)
    scores, _, _ = hidden(fake, "E8")
    assert scores["E8"][0] == 0
    other = tmp_path / "other-plot"
    shutil.copytree(solved, other)
    subprocess.run([sys.executable, "plot.py", "experiment/k1-reward", "--out",
                    "experiment/plot.png"], cwd=other, check=True, capture_output=True)
    scores, tests, _ = hidden(other, "E8")
    assert scores["E8"][0] == 3.0  # the runs, not the plot


GRADESCOPE_TEST_KEYS = {"name", "score", "max_score", "output", "visibility", "status", "tags",
                        "number", "extra_data", "output_format", "name_format"}


ZIP_SEED = 987654321  # the autograder zip's secret: no output may print it


def untraversable_ancestor(path):
    """The topmost folder above `path` that other users cannot traverse (no o+x), or None."""
    path = pathlib.Path(os.path.realpath(path))
    return next((p for p in reversed(path.parents) if not os.stat(p).st_mode & 0o001), None)


def where_nobody_runs_python(argv):
    """argv, run as root where `nobody` can run this Python, or None where that cannot be arranged
    (not root, no user nobody, unshare refused). Where the Python lives
    below a folder nobody cannot traverse (here pyenv's, below /root of mode 0700), the command
    runs in a private mount namespace (unshare -m) in which a tmpfs of mode 0755 covers that
    folder, with the Python's folders, the repository and the temporary folder bound back into it:
    nothing changes outside the namespace, and the grader in it switches users as on Gradescope."""
    try:
        import pwd

        pwd.getpwnam("nobody")
    except KeyError:
        return None
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    hidden = min(filter(None, map(untraversable_ancestor, prefixes)), default=None,
                 key=lambda path: len(path.parts))
    if hidden is None:
        return list(argv)
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"]).returncode:
        return None
    keep = {p for p in prefixes | {str(ROOT), tempfile.gettempdir()}
            if pathlib.Path(p).is_relative_to(hidden)}
    keep = sorted(p for p in keep if not any(p != q and pathlib.Path(p).is_relative_to(q)
                                             for q in keep))
    q = shlex.quote
    script = ["set -e"]
    script += [f"s{i}=$(mktemp -d); mount --bind {q(p)} $s{i}" for i, p in enumerate(keep)]
    script += [f"mount -t tmpfs -o mode=0755 tmpfs {q(str(hidden))}"]
    script += [f"mkdir -p {q(p)}; mount --move $s{i} {q(p)}; rmdir $s{i}"
               for i, p in enumerate(keep)]
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            "\n".join(script + ['exec "$@"']), "sh", *argv]


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory):
    zip_path = tmp_path_factory.mktemp("autograder") / "autograder.zip"
    proc = subprocess.run([sys.executable, "-m", "classroom", "autograder", str(zip_path),
                           "--exercises", "E1,E4", "--seed", str(ZIP_SEED)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return zip_path


def run_autograder(zip_path, tree, files):
    """Unpack the autograder into a fake /autograder tree, put `files` ({path: text}) in its
    submission and run its run_autograder as root, the children as nobody, as on Gradescope (where
    this cannot be arranged, the children as the grader's own user): (results.json, the run's
    output)."""
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(tree / "source")
    (tree / "submission").mkdir(parents=True)
    for name, text in files.items():
        (tree / "submission" / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / "submission" / name).write_text(text)
    argv = ["bash", str(tree / "source/run_autograder")]
    as_root = where_nobody_runs_python(argv)
    env = {**os.environ, "AUTOGRADER_ROOT": str(tree), "PYTHON": sys.executable,
           "CLASSROOM_CHILD_USER": "nobody" if as_root else ""}
    run = subprocess.run(as_root or argv, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tree / "results" / "results.json").read_text())
    assert isinstance(results["score"], (int, float)) and isinstance(results["tests"], list)
    for t in results["tests"]:
        assert set(t) <= GRADESCOPE_TEST_KEYS and isinstance(t["name"], str)
        assert 0 <= t["score"] <= t["max_score"] and t["visibility"] in (
            "visible", "hidden", "after_due_date", "after_published")
    assert "grader stopped" not in results["output"], results["output"]
    return results, run.stdout


def test_the_autograder_zip_runs_end_to_end(autograder_zip, tmp_path):
    """`python -m classroom autograder` builds the zip; its run_autograder grades a fake
    /autograder tree's submission as Gradescope does (root, submitted code as nobody) and writes
    Gradescope's results.json: kl.py alone scores E1's full marks, an empty upload 0."""
    names = zipfile.ZipFile(autograder_zip).namelist()
    assert {"setup.sh", "run_autograder", "assignment.json", "classroom/grade.py",
            "base/kl.py"} <= set(names)
    assert not [n for n in names if n.startswith("base/classroom") or "bugs.py" in n]
    # a zipped folder, kl.py only
    results, stdout = run_autograder(autograder_zip, tmp_path / "full",
                                     {"hw/kl.py": (ROOT / "kl.py").read_text()})
    scores, _ = scores_of(tmp_path / "full" / "results" / "results.json")
    assert full(scores, "E1") and scores["E4"][0] == 0, stdout[-3000:]
    assert results["score"] == 6
    files = {t["name"]: t["output"] for t in results["tests"] if t["name"].endswith("files")}
    assert "kl.py received" in files["E1 files"]
    assert "advantage.py not submitted" in files["E4 files"]
    results, stdout = run_autograder(autograder_zip, tmp_path / "empty", {})
    assert results["score"] == 0 and len(results["tests"]) > 2, stdout[-3000:]
    files = {t["name"]: t["output"] for t in results["tests"] if t["name"].endswith("files")}
    assert files == {"E1 files": "kl.py not submitted", "E4 files": "advantage.py not submitted"}


LEAK = """
import os


def _ancestors(name):
    \"\"\"The NUL-separated entries of /proc/PID/name of every ancestor this user can read.\"\"\"
    entries, pid = [], "self"
    while pid != "1":
        pid = open(f"/proc/{pid}/status").read().split("PPid:")[1].split()[0]
        try:
            text = open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace")
            entries += text.split("\\0")
        except OSError:
            pass
    return entries


_args, _environ = _ancestors("cmdline"), _ancestors("environ")
_near_seed = [" ".join(_args[i:i + 2]) for i, arg in enumerate(_args)
              if "seed" in arg.lower() and len(arg) < 40]
_near_seed += [entry for entry in _environ if "seed" in entry.lower()]
raise ImportError("found: " + " | ".join(_near_seed))
"""


def test_a_submission_cannot_read_the_seed(autograder_zip, tmp_path):
    """kl.py that raises at import an ImportError of what it finds near 'seed' in its ancestors'
    command lines and environments (the grader's among them), which the visible "E1 files" entry
    prints: it finds the grader's command line, and no output holds the seed."""
    results, stdout = run_autograder(autograder_zip, tmp_path / "leak", {"kl.py": LEAK})
    files = next(t["output"] for t in results["tests"] if t["name"] == "E1 files")
    assert "ImportError: found: --seed-file seed" in files, files
    assert str(ZIP_SEED) not in json.dumps(results), files


STRAYS = """
# _MARK (in each stray's command line), _SEEN (a folder every user may write), _RESULTS: above
import os as _os, resource as _resource, sys as _sys, time as _time

_CHAIN = '''n=$1
if [ "$n" -gt 0 ]; then
    sh "$0" $((n - 1))
    exit
fi
echo deep >> %(seen)s/chain
while :; do
    [ -s %(results)s ] && echo '{"score": 999}' > %(results)s
    sleep 0.2
done
'''
_BOMB = '''import os, time
while True:  # each process forks again and again, the new ones too, as far as RLIMIT_NPROC lets
    try:
        if os.fork() == 0:
            open("%(seen)s/bomb", "a").write("forked\\\\n")
    except OSError:
        time.sleep(0.1)
'''


def _start(argv, nproc=None):
    \"\"\"argv in a session of its own, forked from this child.\"\"\"
    if _os.fork() == 0:
        _os.setsid()
        if nproc:
            _resource.setrlimit(_resource.RLIMIT_NPROC, (nproc, nproc))
        _os.execv(argv[0], argv)


def _tasks_of_mine():
    mine = 0
    for task in __import__("glob").glob("/proc/[0-9]*/task/[0-9]*"):
        try:
            mine += _os.stat(task).st_uid == _os.getuid()
        except OSError:
            pass
    return mine


def _lines(name):
    try:
        return len(open(f"{_SEEN}/{name}").readlines())
    except OSError:
        return 0


for _name, _text in (("chain.sh", _CHAIN), ("bomb.py", _BOMB)):
    with open(f"{_MARK}-{_name}", "w") as _file:
        _file.write(_text % {"seen": _SEEN, "results": _RESULTS})


def _wait_for(name, lines):
    deadline = _time.monotonic() + 30
    while _lines(name) < lines:
        assert _time.monotonic() < deadline, f"the strays did not start ({name})"
        _time.sleep(0.05)


_start(["/bin/sh", f"{_MARK}-chain.sh", "300"])
_start([_sys.executable, "-I", "-S", "-c", "import sys, time; open(sys.argv[1] + '/sleeper', "
        "'w').write('sleeping'); time.sleep(1000)", _SEEN, _MARK])
_wait_for("chain", 1)
_wait_for("sleeper", 1)
_start([_sys.executable, "-I", "-S", f"{_MARK}-bomb.py"], nproc=_tasks_of_mine() + 40)
_wait_for("bomb", 16)
"""


def processes_with(mark):
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if mark.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("mode", ["nobody", "nobody-without-namespaces", "own-user"])
def test_no_process_of_a_submission_outlives_its_exercise(mode):
    """kl.py (the solution) starting at import, each in a session of its own: a chain of 300
    nested shells whose innermost rewrites the results file once it exists, a fork bomb bounded
    by RLIMIT_NPROC and a sleeper. None is left when the grader returns, and the results stay as
    written: as root with nobody's children (each in a PID namespace of its own), as root without
    CAP_SYS_ADMIN as in Gradescope's containers (namespaces refused: every process of nobody's
    killed at the end), and as a grader whose children are its own user's (nobody's if we are
    root, so that RLIMIT_NPROC bounds the bomb; every descendant killed, pass after pass)."""
    import pwd

    if (mode != "own-user" or os.geteuid() == 0) and where_nobody_runs_python([]) is None:
        pytest.skip("needs root and a Python that nobody can run")
    mark = f"stray{os.getpid()}x{time.time_ns()}"
    seen = pathlib.Path(tempfile.mkdtemp(prefix="strays-"))
    try:
        seen.chmod(0o777)
        results = seen / "results.json"
        (seen / "upload").mkdir()
        (seen / "upload" / "kl.py").write_text(
            (ROOT / "kl.py").read_text()
            + f"\n_MARK, _SEEN, _RESULTS = {mark!r}, {str(seen)!r}, {str(results)!r}" + STRAYS)
        base = handout.make(seen / "base", ["E1"], git=False)
        shutil.rmtree(base / "classroom")
        (seen / "seed").write_text(f"{SECRET}\n")
        (seen / "seed").chmod(0o600)
        grader = [sys.executable, "-m", "classroom", "grade", "--hidden", "--seed-file",
                  str(seen / "seed"), "--assignment", "E1", "--base", str(base), "--submission",
                  str(seen / "upload"), "--json", str(results)]
        if mode == "own-user" and os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(seen / "seed", nobody.pw_uid, nobody.pw_gid)
            grader = ["setpriv", "--reuid", str(nobody.pw_uid), "--regid", str(nobody.pw_gid),
                      "--clear-groups", *grader]
        elif mode != "own-user":
            grader += ["--child-user", "nobody"]
        if mode == "nobody-without-namespaces":
            grader = ["setpriv", "--bounding-set", "-sys_admin", *grader]
        if mode != "own-user" or os.geteuid() == 0:
            grader = where_nobody_runs_python(grader)
        proc = subprocess.run(grader, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "HOME": str(seen)})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        written = results.read_bytes()
        assert full(scores_of(results)[0], "E1"), proc.stdout[-3000:]
        assert [(seen / name).exists() for name in ("chain", "bomb", "sleeper")] == [True] * 3
        assert processes_with(mark) == []
        time.sleep(3)  # a stray, if one were left, would rewrite the results by now
        assert processes_with(mark) == [] and results.read_bytes() == written
    finally:
        while processes_with(mark):
            for pid in processes_with(mark):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        shutil.rmtree(seen, ignore_errors=True)


def test_manifest_and_code_agree():
    checks = {p.name for p in (ROOT / "classroom" / "checks").glob("e*_*.py")}
    for exercise in EXERCISES:
        assert [c for c in checks if c.startswith(f"{exercise.id.lower()}_")], exercise.id
        for file, function in exercise.functions + exercise.withheld:
            tree = ast.parse((ROOT / file).read_text())
            node = next((n for n in tree.body if isinstance(n, ast.FunctionDef)
                         and n.name == function), None)
            assert node is not None, f"{exercise.id}: {file} has no function {function}"
            assert ast.get_docstring(node), f"{exercise.id}: {file}:{function} needs a docstring"
    assert {c.split("_")[0].upper() for c in checks} == {e.id for e in EXERCISES}
    order = run_order([e.id for e in EXERCISES])  # a stand-in's exercise runs before its users
    owner = {name: e.id for e in EXERCISES for _, name in e.functions}
    for exercise in order:
        for _, name in checks_of(exercise).PATCH:
            assert order.index(owner[name]) < order.index(exercise), (exercise, name)
    assert {b[0] for b in BUGS} >= {e.id for e in EXERCISES if e.functions}


def test_a_sandbox_the_child_cannot_reach_is_refused(tmp_path):
    """A sandbox below a folder closed to the child's user (TMPDIR in root's home, say): one line
    that names the folder, before any child fails to import."""
    if os.geteuid() != 0:
        pytest.skip("giving the sandbox to nobody needs root")
    from classroom.grade import give_to

    closed = tmp_path / "closed"
    (closed / "tmp" / "sandbox").mkdir(parents=True)
    closed.chmod(0o700)
    with pytest.raises(SystemExit, match=f"{closed} is closed to it"):
        give_to(closed / "tmp" / "sandbox", (65534, 65534))


def test_the_seed_reaches_the_grader_by_a_file_only(tmp_path):
    """With a child of another user, the seed comes from a file only the grader can read: on a
    command line, or in a file others can read, it is refused in one line."""
    from argparse import Namespace

    from classroom.grade import secret_seed

    seed = tmp_path / "seed"
    seed.write_text(f"{ZIP_SEED}\n")
    seed.chmod(0o600)
    args = dict(seed=None, seed_file=str(seed), child_user="nobody")
    assert secret_seed(Namespace(**args)) == ZIP_SEED
    assert secret_seed(Namespace(**{**args, "seed": 5, "seed_file": None, "child_user": ""})) == 5
    with pytest.raises(SystemExit, match="give the seed with --seed-file"):
        secret_seed(Namespace(**{**args, "seed": 5, "seed_file": None}))
    seed.chmod(0o644)
    with pytest.raises(SystemExit, match="other users can read it"):
        secret_seed(Namespace(**args))
    seed.write_text("twelve")
    with pytest.raises(SystemExit, match="not an integer"):
        secret_seed(Namespace(**{**args, "child_user": None}))
    with pytest.raises(SystemExit, match="one of them"):
        secret_seed(Namespace(**{**args, "seed": 5}))
