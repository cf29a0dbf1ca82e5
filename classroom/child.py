"""The grader's side of a child process (probes.py): start it in a sandbox (on Gradescope as an
unprivileged user), send it a case, wait at most the case's time limit for
its answer, and kill it and everything it started. Nothing it sends is trusted: answers are JSON,
read back into tensors of a few plain dtypes, and a malformed, late or missing answer fails that
case only (the next case gets a fresh child).

Nothing a child starts outlives its exercise. Where the kernel lets the grader create a PID
namespace (root with CAP_SYS_ADMIN: a local root grader, CI), each child is pid 1 of its own
(launch.py), and all in it die with it. Where it is refused (Gradescope's containers: root without
CAP_SYS_ADMIN), the child's user bounds it: at the end every process of that user is killed. As the
grader's own user without a namespace, the grader, their subreaper, gets every orphan back and
kills every process below it, pass after pass until none is left."""
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
LAUNCH = (pathlib.Path(__file__).parent / "launch.py").read_text()
STANDINS = (pathlib.Path(__file__).parent / "standins.py").read_text()
DTYPES = {name: getattr(torch, name) for name in
          ("float64", "float32", "bfloat16", "float16", "int64", "int32", "bool")}
MAX_ANSWER = 64 * 2**20  # bytes: an answer longer than this is not read
START_SECONDS = 120  # time limit for the child to import torch and the submission
LIVE = set()  # pids of the children at work (exercises are graded side by side)
UNCONFINED = set()  # users other than ours whose children ran outside a PID namespace
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
    """Kill every process below the grader but the live children of the exercises graded
    meanwhile and theirs: what a child left behind, at any depth (orphans come back to us, the
    subreaper), pass after pass until a pass finds none (those that fork meanwhile are found by
    the next)."""
    with LOCK:
        me = os.getpid()
        while strays := below(me, spare=LIVE):
            for pid, _ in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for pid, parent in strays:
                if parent == me:
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass
            if all(parent != me for _, parent in strays):
                time.sleep(0.01)  # only the dead whose parents are dying: soon ours to reap


def processes():
    """{pid: (parent pid, state, real uid)} of every process."""
    table = {}
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue
        table[int(status.parent.name)] = (int(fields["PPid"]), fields["State"].split()[0],
                                          int(fields["Uid"].split()[0]))
    return table


def below(root, spare=()):
    """[(pid, parent)] of the processes below `root`, but those in `spare` and below them."""
    children = {}
    for pid, (parent, _, _) in processes().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        for pid in children.get(parent, []):
            if pid not in spare:
                found.append((pid, parent))
                todo.append(pid)
    return found


def kill_user(uid):
    """Kill every process of user `uid` (another than ours: the children's, where they ran outside
    a PID namespace). One process of that user kills them all at once (kill -1), so none forks
    away meanwhile; again until none is left."""
    assert uid not in (0, os.geteuid())
    while any(state != "Z" and owner == uid for _, state, owner in processes().values()):
        helper = os.fork()
        if helper == 0:
            try:
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
        kill_strays()  # reaps those that were ours


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
    if user.pw_uid == os.geteuid():
        return None
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
    uid, gid = user or (-1, -1)
    confined, report = os.pipe()  # the launcher says there whether a PID namespace holds the child
    with LOCK:  # not taken for a stray by another exercise's kill_strays
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCH, str(uid), str(gid),
                                 str(report), sys.executable, "-I", "-c", PROBES, str(write_end)],
                                cwd=sandbox, env=env, stdin=subprocess.PIPE, stdout=log,
                                stderr=log, pass_fds=(write_end, report), start_new_session=True)
        LIVE.add(proc.pid)
    os.close(write_end)
    os.close(report)
    if os.read(confined, 1) != b"1" and user:
        UNCONFINED.add(uid)
    os.close(confined)
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
