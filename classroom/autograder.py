"""`python -m classroom autograder OUT.zip --exercises E1,E2 --seed S`: the Gradescope autograder of
an assignment, one zip. Gradescope unpacks it to /autograder/source, runs setup.sh once, then
run_autograder for each submission (as root), which grades /autograder/submission with the hidden
cases of S and writes /autograder/results/results.json. Inside: setup.sh, run_autograder, the grader
(classroom/ without the instructor's files), a blank handout of the assignment (base/, the sandbox's
project files), requirements.txt, assignment.json (the exercises) and seed (the secret).
run_autograder makes the grader unreadable to others, gives it the seed in that file (never on a
command line: every user can read those) and runs submitted code as `nobody`. AUTOGRADER_ROOT
(default /autograder) moves the tree, PYTHON picks the interpreter and CLASSROOM_CHILD_USER the
child's user (empty: the grader's own), so the zip can be tried on any machine
(tests/test_classroom.py does)."""
import json
import pathlib
import shutil
import tempfile
import zipfile

from classroom import handout

GRADER = ["__init__.py", "__main__.py", "manifest.py", "grade.py", "child.py", "launch.py",
          "probes.py", "harness.py", "standins.py", "reference.py", "checks/*.py"]

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once when the autograder is built: Python, torch (CPU), the requirements.
set -euo pipefail
apt-get update -qq && apt-get install -y -qq python3 python3-pip >/dev/null
pip3 install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
pip3 install --quiet -r /autograder/source/requirements.txt
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this (as root) for each submission: the hidden tests of assignment.json.
set -u
ROOT="${AUTOGRADER_ROOT:-/autograder}"
SOURCE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
mkdir -p "$ROOT/results"
chmod -R go-rwx "$SOURCE"  # the seed and the references: submitted code runs as another user
cd "$SOURCE"
"$PYTHON" - "$ROOT" <<'PY'
import json, subprocess, sys, pathlib
root = pathlib.Path(sys.argv[1])
config = json.loads(pathlib.Path("assignment.json").read_text())
results = root / "results" / "results.json"
import os
proc = subprocess.run([sys.executable, "-m", "classroom", "grade", "--hidden",
                       "--seed-file", "seed", "--assignment", ",".join(config["exercises"]),
                       "--base", "base", "--submission", str(root / "submission"),
                       "--json", str(results),
                       "--child-user", os.environ.get("CLASSROOM_CHILD_USER", "nobody")],
                      capture_output=True, text=True)
print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\\n")
if proc.returncode != 0 or not results.exists():  # never no results: a zero that says why
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    results.write_text(json.dumps({"score": 0, "output": "The grader stopped before it finished "
                                   "(exit %d): %s" % (proc.returncode, " | ".join(tail)),
                                   "tests": []}))
PY
"""


def build(out, exercises, seed):
    """Write the autograder zip of `exercises` with the hidden cases of `seed`; returns `out`."""
    out = pathlib.Path(out)
    if out.suffix != ".zip":
        raise SystemExit(f"{out}: the autograder is a .zip")
    with tempfile.TemporaryDirectory(prefix="classroom-autograder-") as tmp:
        source = pathlib.Path(tmp) / "source"
        base = handout.make(source / "base", exercises, git=False)  # also the leak check
        shutil.rmtree(base / "classroom")
        for pattern in GRADER:
            for path in handout.ROOT.joinpath("classroom").glob(pattern):
                target = source / "classroom" / path.relative_to(handout.ROOT / "classroom")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
        shutil.copyfile(handout.ROOT / "requirements.txt", source / "requirements.txt")
        (source / "assignment.json").write_text(json.dumps({"exercises": exercises}) + "\n")
        (source / "seed").write_text(f"{seed}\n")
        (source / "setup.sh").write_text(SETUP)
        (source / "run_autograder").write_text(RUN)
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(source.rglob("*")):
                if path.is_file():
                    info = zipfile.ZipInfo.from_file(path, path.relative_to(source))
                    if path.name in ("setup.sh", "run_autograder"):
                        info.external_attr = 0o755 << 16
                    archive.writestr(info, path.read_bytes(), zipfile.ZIP_DEFLATED)
    return out
