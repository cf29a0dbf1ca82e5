"""The grader's side of a child process (probes.py): start it in a sandbox (on Gradescope as an
unprivileged user), send it a case, wait at most the case's time limit for
its answer, and kill it and everything it started. Nothing it sends is trusted: answers are JSON,
read back into tensors of a few plain dtypes, and a malformed, late or missing answer fails that
case only (the next case gets a fresh child)."""
import ctypes
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

PROBES = (pathlib.Path(__file__).parent / "probes.py").read_text()
STANDINS = (pathlib.Path(__file__).parent / "standins.py").read_text()
DTYPES = {name: getattr(torch, name) for name in
          ("float64", "float32", "bfloat16", "float16", "int64", "int32", "bool")}
MAX_ANSWER = 64 * 2**20  # bytes: an answer longer than this is not read
START_SECONDS = 120  # time limit for the child to import torch and the submission
LIVE = set()  # pids of the children at work (exercises are graded side by side)
LOCK = threading.Lock()


class Failed(Exception):
    """A case the child could not answer: an exception (`alive`: the child can go on), a timeout,
    a crash, an unreadable answer."""

    def __init__(self, message, alive=False):
        super().__init__(message)
        self.alive = alive


def become_subreaper():
    """Orphans of a child (a daemon it forked) become ours, so kill_strays can find them (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def kill_strays():
    """Kill every process left whose parent is the grader, other than the live children of the
    exercises graded meanwhile: what a child forked and left behind (again until none is left:
    one that forks as it dies leaves its own child to us)."""
    with LOCK:
        kill_strays_unlocked(str(os.getpid()))


def kill_strays_unlocked(me):
    for _ in range(100):
        strays = []
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and int(stat.parent.name) not in LIVE:
                strays.append(int(stat.parent.name))
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (OSError, ChildProcessError):
                pass


def sandbox_user(name):
    """(uid, gid) of user `name` (the autograder's `nobody`) for the child, or None for ours. As
    `nobody` the child cannot read the grader's files (chmod go-rwx) nor write its results; the
    grader must be root to switch, and the Python it runs must be readable by that user."""
    if not name:
        return None
    import pwd

    try:
        user = pwd.getpwnam(name)
    except KeyError:
        raise SystemExit(f"--child-user {name}: no such user") from None
    if os.geteuid() != 0:
        raise SystemExit(f"--child-user {name}: the grader must run as root to switch users")
    return user.pw_uid, user.pw_gid


def start(sandbox, others, own, patch, user=None, hidden=False):
    """A child in `sandbox` importing the project modules `others` (tolerantly) and `own`: a dict,
    with its import errors ({module: first lines}). Its environment holds nothing of the grader's
    (no seed, no paths); hidden, its home is the sandbox."""
    read_end, write_end = os.pipe()
    log = tempfile.TemporaryFile()
    home = {"HOME": str(sandbox), "MPLCONFIGDIR": str(sandbox / ".matplotlib")} if hidden else \
        {"HOME": os.environ.get("HOME", str(sandbox))}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "LANG": "C.UTF-8", **home}
    ids = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
    with LOCK:  # not taken for a stray by another exercise's kill_strays
        proc = subprocess.Popen([sys.executable, "-I", "-c", PROBES, str(write_end)],
                                cwd=sandbox, env=env, stdin=subprocess.PIPE, stdout=log,
                                stderr=log, pass_fds=(write_end,), start_new_session=True, **ids)
        LIVE.add(proc.pid)
    os.close(write_end)
    child = {"proc": proc, "answers": read_end, "buffer": b"", "log": log, "next_id": 0}
    setup = {"others": others, "own": own, "patch": patch, "standins": STANDINS if patch else ""}
    try:
        proc.stdin.write((json.dumps(setup) + "\n").encode())
        proc.stdin.flush()
        ready = read_answer(child, START_SECONDS)
    except (Failed, OSError) as error:
        stop(child)
        raise Failed(f"the submission could not be loaded: {error}") from None
    child["import_errors"] = ready.get("import_errors") or {}
    return child


def read_answer(child, seconds):
    """One JSON line from the child within `seconds`, or Failed."""
    deadline = time.monotonic() + seconds
    while b"\n" not in child["buffer"]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Failed(f"timeout: no answer within {seconds:g} s")
        ready, _, _ = select.select([child["answers"]], [], [], left)
        if not ready:
            continue
        chunk = os.read(child["answers"], 1 << 20)
        if not chunk:
            code = child["proc"].poll()
            raise Failed(f"the process exited (code {code}) before answering"
                         f"{last_output(child)}")
        child["buffer"] += chunk
        if len(child["buffer"]) > MAX_ANSWER:
            raise Failed("an answer too large to read")
    line, child["buffer"] = child["buffer"].split(b"\n", 1)
    try:
        answer = json.loads(line)
        assert isinstance(answer, dict)
    except (ValueError, AssertionError):
        raise Failed("an unreadable answer (did the submission write to the grader's "
                     "channel?)") from None
    return answer


def last_output(child):
    child["log"].seek(0)
    lines = child["log"].read().decode(errors="replace").strip().splitlines()
    return f"; its last output: {lines[-1][:200]}" if lines else ""


def call(child, probe, seconds, **args):
    """The outputs of `probe` (probes.py) on `args` in the child, as tensors and JSON values."""
    child["next_id"] += 1
    request = {"id": child["next_id"], "probe": probe, "args": encode(args)}
    try:
        child["proc"].stdin.write((json.dumps(request) + "\n").encode())
        child["proc"].stdin.flush()
    except OSError:
        raise Failed(f"the process exited (code {child['proc'].poll()}){last_output(child)}") \
            from None
    answer = read_answer(child, seconds)
    if answer.get("id") != child["next_id"]:
        raise Failed("an answer to another case (did the submission write to the grader's "
                     "channel?)")
    if "error" in answer:
        raise Failed(f"exception: {answer['error']}", alive=True)
    try:
        return decode(answer["out"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise Failed(f"an unreadable output ({str(error)[:100]})", alive=True) from None


def stop(child):
    """Kill the child, its process group and any process it left behind."""
    try:
        os.killpg(child["proc"].pid, signal.SIGKILL)
    except OSError:
        pass
    child["proc"].wait()
    with LOCK:
        LIVE.discard(child["proc"].pid)
    kill_strays()
    os.close(child["answers"])
    child["log"].close()
    for stream in (child["proc"].stdin,):
        try:
            stream.close()
        except OSError:
            pass


def encode(x):
    if isinstance(x, torch.Tensor):
        data = x.detach().float() if x.dtype == torch.bfloat16 else x.detach()
        return {"tensor": str(x.dtype).replace("torch.", ""), "shape": list(x.shape),
                "data": data.flatten().tolist()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {k: encode(v) for k, v in x.items()}
    return x


def decode(x):
    """JSON from the child back into tensors of the dtypes in DTYPES; anything else is refused."""
    if isinstance(x, dict) and "tensor" in x:
        if x["tensor"] not in DTYPES:
            raise ValueError(f"a tensor of dtype {x['tensor']!r}")
        shape = [int(n) for n in x["shape"]]
        return torch.tensor(x["data"], dtype=DTYPES[x["tensor"]]).reshape(shape)
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        return {str(k): decode(v) for k, v in x.items()}
    return x
