"""The classroom package kept in sync with the code (classroom/README.md): a handout builds and
passes its leak check; blank, it scores 0 with every failure naming its own exercise; the
solution scores full marks at the public seed and a hidden one; every known-bug variant of
classroom/bugs.py loses points, and so does a lookup of the public cases' answers; the manifest
and the code agree."""
import ast
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from classroom import handout
from classroom.bugs import BUGS
from classroom.manifest import EXERCISES

ROOT = pathlib.Path(__file__).parent
SOLUTION_FILES = sorted({file for e in EXERCISES for file, _ in e.functions})
STUDY = ROOT / "studies" / "cpu-small"


def grade(cwd, *args):
    """`python -m classroom grade ARGS` in cwd -> ({exercise: (score, max)}, tests, stdout)."""
    out = pathlib.Path(tempfile.mkdtemp()) / "results.json"  # never in the repository
    proc = subprocess.run([sys.executable, "-m", "classroom", "grade", *args, "--json", str(out)],
                          cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tests = json.loads(out.read_text())["tests"]
    scores = {}
    for t in tests:
        exercise = t["name"].split()[0]
        score, most = scores.get(exercise, (0.0, 0.0))
        scores[exercise] = (score + t["score"], most + t["max_score"])
    return scores, tests, proc.stdout


@pytest.fixture(scope="module")
def blank(tmp_path_factory):
    return handout.make(tmp_path_factory.mktemp("classroom") / "blank",
                        [e.id for e in EXERCISES])


@pytest.fixture(scope="module")
def solved(blank, tmp_path_factory):
    """The blank handout with the solution's files and an experiment of real runs (the CPU
    study's K1-in-reward and K1-in-loss at beta = 1) put back."""
    out = tmp_path_factory.mktemp("classroom") / "solved"
    shutil.copytree(blank, out)
    for file in SOLUTION_FILES:
        shutil.copyfile(ROOT / file, out / file)
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
    return out


def test_handout_is_a_clean_copy(blank):
    names = {str(p.relative_to(blank)) for p in blank.rglob("*") if ".git" not in p.parts}
    assert "train.py" in names and "classroom/tests/test_e1_estimate.py" in names
    assert not [n for n in names if n.startswith(("test_", "studies", "assets", "docs"))]
    assert not {"classroom/bugs.py", "classroom/handout.py", "classroom/README.md"} & names
    assert "### E8." in (blank / "README.md").read_text()
    log = subprocess.run(["git", "log", "--oneline"], cwd=blank, capture_output=True, text=True)
    assert len(log.stdout.splitlines()) == 1  # a fresh history
    source = (blank / "kl.py").read_text()
    assert 'raise NotImplementedError("E1: ' in source and "expm1" not in source
    with pytest.raises(SystemExit, match="not empty"):
        handout.make(blank, ["E1"])


def test_leak_check_refuses(tmp_path, monkeypatch):
    """A handout that still prints a blanked line anywhere is not written."""
    line = next(line for line in handout.function_lines((ROOT / "kl.py").read_text(), "estimate")
                if "expm1" in line)
    readme = handout.student_readme
    monkeypatch.setattr(handout, "student_readme", lambda chosen: readme(chosen) + line)
    with pytest.raises(SystemExit, match="leak check"):
        handout.make(tmp_path / "leaky", ["E1"], git=False)
    assert not (tmp_path / "leaky").exists()


def test_blank_handout_scores_zero_and_names_each_exercise(blank):
    scores, tests, stdout = grade(blank)
    assert set(scores) == {e.id for e in EXERCISES}
    assert all(score == 0 for score, _ in scores.values())
    for t in tests:
        exercise = t["name"].split()[0]
        assert f"{exercise}:" in t["output"], t  # NotImplementedError("E3: ...") or "E8: no ..."
    assert "PUBLIC tests only" in stdout


@pytest.mark.parametrize("hidden", [False, True])
def test_solution_scores_full_marks(solved, hidden):
    args = ["--hidden", "--seed", "1", "--submission", str(solved)] if hidden else []
    scores, _, stdout = grade(ROOT if hidden else solved, *args)
    assert all(abs(score - most) < 1e-6 for score, most in scores.values()), stdout
    assert len(scores) == len(EXERCISES)


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
        score, most = scores[exercise]
        assert score < most, f"{exercise} '{name}' kept full marks:\n{stdout}"
    # and no other exercise lost anything
    buggy = {b[0] for b in bugs}
    assert all(score == most for e, (score, most) in scores.items() if e not in buggy)


RECORD = '''
def rloo(returns, group_size):
    import json, pathlib
    R = _groups(returns, group_size)
    answer = (R - (R.sum(1, keepdim=True) - R) / (group_size - 1)).reshape(-1)
    path = pathlib.Path(__file__).with_name("answers.json")
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
    work = tmp_path / "lookup"
    shutil.copytree(solved, work)
    path = work / "advantage.py"
    path.write_text(handout.replace_function(path.read_text(), "rloo", RECORD))
    grade(work, "E4")
    table = json.loads((work / "answers.json").read_text())
    assert table  # the public cases were seen
    lookup = LOOKUP % repr(table)  # the answers go into advantage.py, the file a student hands in
    path.write_text(handout.replace_function(path.read_text(), "rloo", lookup))
    public, _, _ = grade(work, "E4")
    assert public["E4"][0] == public["E4"][1]
    hidden, _, _ = grade(ROOT, "--hidden", "--seed", "3", "--submission", str(work))
    assert hidden["E4"][0] < hidden["E4"][1]


def test_manifest_and_code_agree():
    tests = {p.name for p in (ROOT / "classroom" / "tests").glob("test_e*_*.py")}
    for exercise in EXERCISES:
        assert [t for t in tests if t.startswith(f"test_{exercise.id.lower()}_")], exercise.id
        for file, function in exercise.functions:
            tree = ast.parse((ROOT / file).read_text())
            node = next((n for n in tree.body if isinstance(n, ast.FunctionDef)
                         and n.name == function), None)
            assert node is not None, f"{exercise.id}: {file} has no function {function}"
            assert ast.get_docstring(node), f"{exercise.id}: {file}:{function} needs a docstring"
    assert {t.split("_")[1].upper() for t in tests} == {e.id for e in EXERCISES}
    assert {b[0] for b in BUGS} >= {e.id for e in EXERCISES if e.functions}
