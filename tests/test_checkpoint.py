"""Tests of systems/checkpoint.py's on-disk protocol, without training: what makes a checkpoint complete,
which one --resume takes, and a kill at every point of a replacement of final/ (test_train.py kills
real torchrun runs at the worst of these points)."""
import json
import os
import shutil
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from systems import checkpoint


def write_checkpoint(directory, step, world_size=2):
    """A checkpoint's files as checkpoint.save leaves them, each small but whole (--resume reads
    each back), the weights' one value the step."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    save_file({"w": torch.full((4,), float(step))}, directory / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, directory / "optimizer.pt")
    for rank in range(world_size):
        torch.save(checkpoint.rng_state(torch.Generator()), directory / f"rng_rank{rank}.pt")
        torch.save([], directory / f"queue_rank{rank}.pt")
    state = {"step": step, "data_position": 8 * step, "world_size": world_size}
    (directory / "trainer_state.json").write_text(json.dumps(state))
    return directory


def test_a_checkpoint_is_complete_with_every_ranks_files(tmp_path):
    path = write_checkpoint(tmp_path / "step_1", 1)
    assert checkpoint.missing(path) is None
    (path / "queue_rank1.pt").unlink()
    assert checkpoint.missing(path) == "queue_rank1.pt"
    (path / "trainer_state.json").unlink()  # still being written
    assert checkpoint.missing(path) == "trainer_state.json"
    assert checkpoint.missing(tmp_path / "no-such-directory") == "trainer_state.json"


def test_latest_passes_over_incomplete_checkpoints(tmp_path):
    write_checkpoint(tmp_path / "step_1", 1)
    (write_checkpoint(tmp_path / "step_2", 2) / "rng_rank1.pt").unlink()  # rank 1's files lost
    (tmp_path / ".tmp-step_3").mkdir()  # a save killed early
    (tmp_path / "eval-arith").mkdir()  # not a checkpoint
    assert checkpoint.latest(tmp_path) == tmp_path / "step_1"
    assert checkpoint.latest(tmp_path / "empty") is None


class Killed(Exception):
    """Stands for SIGKILL: the file system is left as it was at that moment."""


def replace_killed_at(out, kill_at, monkeypatch):
    """checkpoint.replace(OUT/final, OUT/.tmp-final), killed before its file operation number
    `kill_at` (renames, removals of a directory or a file); returns how many it made."""
    done = []

    def counted(operation):
        def run(*args, **kwargs):
            if len(done) == kill_at:
                raise Killed
            done.append(operation.__name__)
            return operation(*args, **kwargs)
        return run

    monkeypatch.setattr(checkpoint.os, "rename", counted(os.rename))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", counted(shutil.rmtree))
    monkeypatch.setattr(Path, "unlink", counted(Path.unlink))
    try:
        checkpoint.replace(out / "final", out / ".tmp-final")
    except Killed:
        pass
    monkeypatch.undo()
    return len(done)


def test_a_kill_at_any_point_of_replacing_final_keeps_the_newest(tmp_path, monkeypatch):
    """final/ (step 1) replaced by a complete .tmp-final (step 2), killed before each of its file
    operations in turn: the newest checkpoint is always on disk and `latest` finds it; `recover`
    then leaves exactly final/ at step 2."""
    def setup(out):
        write_checkpoint(out / "final", 1)
        write_checkpoint(out / ".tmp-final", 2)
        return out

    operations = replace_killed_at(setup(tmp_path / "whole"), 10**6, monkeypatch)
    # two renames; retire .old-final: clear a stale .del-.old-final, rename to it, remove it
    assert operations == 5
    for kill_at in range(operations + 1):
        out = setup(tmp_path / f"killed{kill_at}")
        replace_killed_at(out, kill_at, monkeypatch)
        newest = checkpoint.latest(out)
        assert newest is not None and checkpoint.step_of(newest) == 2, (kill_at, newest)
        checkpoint.recover(out)
        assert sorted(p.name for p in out.iterdir()) == ["final"], kill_at
        assert checkpoint.missing(out / "final") is None and checkpoint.step_of(out / "final") == 2


def test_recover_puts_back_an_old_final_whose_replacement_never_finished(tmp_path):
    """An .old-final with no final/ and no complete .tmp-final (a save from before this protocol,
    or a hand-made mess) goes back to final/; an incomplete .tmp-final is left for the next save to
    clear."""
    write_checkpoint(tmp_path / ".old-final", 4)
    (tmp_path / ".tmp-final").mkdir()
    checkpoint.recover(tmp_path)
    assert checkpoint.latest(tmp_path) == tmp_path / "final"
    assert not (tmp_path / ".old-final").exists()


@pytest.mark.parametrize("name", ["final", "step_2"])
def test_recover_finishes_a_complete_temporary(tmp_path, name):
    write_checkpoint(tmp_path / name, 1)
    write_checkpoint(tmp_path / f".tmp-{name}", 2)
    checkpoint.recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert checkpoint.step_of(tmp_path / name) == 2


# ---------------------------------------------------------------- a run's log is never destroyed
def run_args(out, **flags):
    """train.py's parsed flags, as open_run and start_log read them (a few run-defining ones)."""
    return Namespace(**{"out": out, "resume": False, "kl": "k1", "place": "reward", "beta": 0.05,
                        "steps": 4, "save_every": 0, **flags})


def logged_run(out, steps, **flags):
    """OUT as a run leaves it when killed before any checkpoint: config.json, `steps` rows."""
    args = run_args(out, **flags)
    checkpoint.start_log(args, 0, resumed=False)
    for step in range(1, steps + 1):
        checkpoint.log_row(out / "metrics.jsonl", {"step": step, "reward": step / 10})
    return args


def test_resume_without_a_checkpoint_never_starts_over_a_logged_run(tmp_path):
    """A run killed before final/ (--save-every 0), then --resume with other flags: it stops in one
    line, and config.json and metrics.jsonl are as they were."""
    logged_run(tmp_path, 3)
    files = lambda: {p.name: p.read_bytes() for p in tmp_path.iterdir()  # noqa: E731
                     if p.name != checkpoint.LOCK}
    before = files()
    args = run_args(tmp_path, resume=True, kl="k3", place="loss", beta=0.7)
    with pytest.raises(SystemExit, match="3 steps in metrics.jsonl but no complete checkpoint"):
        checkpoint.open_run(args, 0, 1)
    checkpoint.unlock()
    assert files() == before


def test_resume_without_a_checkpoint_or_a_row_refuses_another_runs_flags(tmp_path):
    """Killed before its first step: nothing is logged, so --resume starts over, with the same
    run-defining flags only (config.json's)."""
    logged_run(tmp_path, 0)
    with pytest.raises(SystemExit, match=r"--beta: 0.05 -> 0.7"):
        checkpoint.open_run(run_args(tmp_path, resume=True, beta=0.7), 0, 1)
    assert checkpoint.open_run(run_args(tmp_path, resume=True, steps=8), 0, 1) == (None, {})
    checkpoint.unlock()


def test_a_resume_drops_rows_past_its_checkpoint_by_a_new_file(tmp_path, monkeypatch):
    """metrics.jsonl is only appended to; a resume from step 2 writes the rows up to 2 to a new
    file and renames it over the old (a kill before the rename keeps all of them); a torn last
    line (a kill mid-write) goes too. With nothing to drop, the file is appended to as it is."""
    logged_run(tmp_path, 4)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as file:
        file.write('{"step": 5, "rew')  # killed while writing step 5
    before = metrics.read_bytes()

    def killed(*args):
        raise Killed

    monkeypatch.setattr(checkpoint.os, "replace", killed)
    with pytest.raises(Killed):
        checkpoint.start_log(run_args(tmp_path, resume=True), 2, resumed=True)
    monkeypatch.undo()
    assert metrics.read_bytes() == before
    checkpoint.start_log(run_args(tmp_path, resume=True), 2, resumed=True)
    assert [json.loads(row)["step"] for row in metrics.read_text().splitlines()] == [1, 2]
    assert before.startswith(metrics.read_bytes())
    inode = metrics.stat().st_ino
    checkpoint.start_log(run_args(tmp_path, resume=True), 2, resumed=True)
    checkpoint.log_row(metrics, {"step": 3})
    assert metrics.stat().st_ino == inode and metrics.read_bytes() == before[:len(
        metrics.read_bytes()) - len(b'{"step": 3}\n')] + b'{"step": 3}\n'


def test_config_json_is_never_replaced_silently(tmp_path, capsys):
    """A resume with the same flags leaves config.json as it is; one that changes a flag a resume
    may change (--steps) keeps the old file beside it and says so."""
    logged_run(tmp_path, 2)
    first = (tmp_path / "config.json").read_text()
    checkpoint.start_log(run_args(tmp_path, resume=True), 2, resumed=True)
    assert (tmp_path / "config.json").read_text() == first
    checkpoint.start_log(run_args(tmp_path, resume=True, steps=8), 2, resumed=True)
    kept = tmp_path / "config-until-step2.json"
    assert kept.read_text() == first
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 8
    assert "--steps: 4 -> 8" in capsys.readouterr().out


# ---------------------------------------------------------------- one run per folder
def hold_lock(out):
    """Another process that takes OUT's lock and holds it until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from systems import checkpoint; print(checkpoint.lock(Path(sys.argv[1])), flush=True); "
         "time.sleep(300)", str(out)],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "None"  # it holds the lock
    return holder


def test_a_second_process_on_the_same_out_meets_the_lock(tmp_path, capsys):
    """While a run holds OUT, another stops at once naming its host and pid (a new run and a
    --resume alike); once that process is killed, its lock is taken over, and said so."""
    logged_run(tmp_path, 0)
    holder = hold_lock(tmp_path)
    try:
        for resume in (False, True):
            with pytest.raises(SystemExit) as error:
                checkpoint.open_run(run_args(tmp_path, resume=resume), 0, 1)
            message = str(error.value)
            assert f"in use by another run (host {socket.gethostname()}, pid {holder.pid}" in \
                message and "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    assert checkpoint.open_run(run_args(tmp_path, resume=True), 0, 1) == (None, {})
    assert f"pid {holder.pid}" in capsys.readouterr().out
    checkpoint.unlock()  # as at exit: the next run takes it without a word
    checkpoint.open_run(run_args(tmp_path, resume=True), 0, 1)
    assert "took over" not in capsys.readouterr().out
    checkpoint.unlock()


def test_a_new_run_may_use_a_folder_holding_only_a_released_lock(tmp_path):
    checkpoint.lock(tmp_path)
    checkpoint.unlock()
    assert checkpoint.open_run(run_args(tmp_path), 0, 1) == (None, {})
    checkpoint.unlock()


def test_a_run_refused_a_folder_never_leaves_two_runs_holding_its_lock(tmp_path, monkeypatch):
    """A new run refused by a non-empty --out removes the lock file it made; a --resume that takes
    the lock the moment the refused run releases it (the gap widened: it starts then) holds the
    folder's lock, the file OUT/.lock names, so a third run meets it. (Unlocked before the file was
    removed, the --resume held a lock on a removed file, and the third run locked a new one.)"""
    (tmp_path / "notes.txt").write_text("mine")
    holders, real_unlock = [], checkpoint.unlock

    def unlock_then_a_resume_locks():
        held = checkpoint._lock is not None
        real_unlock()
        if held and not holders:
            holders.append(hold_lock(tmp_path))

    monkeypatch.setattr(checkpoint, "unlock", unlock_then_a_resume_locks)
    with pytest.raises(SystemExit, match="is not empty: pass --resume"):
        checkpoint.open_run(run_args(tmp_path), 0, 1)
    monkeypatch.undo()
    try:
        assert holders
        third = checkpoint.lock(tmp_path)
        checkpoint.unlock()
        assert f"in use by another run (host {socket.gethostname()}, pid {holders[0].pid}" in (
            third or "")
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


@pytest.mark.parametrize("held", [False, True], ids=["released", "still held"])
def test_a_lock_file_removed_before_it_is_locked_is_not_the_lock_taken(tmp_path, monkeypatch,
                                                                       held):
    """OUT/.lock removed (by a run refused the folder, under its lock) between this process's open
    and its flock, the remover gone or still holding the removed file: the lock taken is on the
    file OUT/.lock names afterwards, not on the removed one, and a removed file's holder does not
    stop this run."""
    holder = hold_lock(tmp_path) if held else None
    real_flock, calls = checkpoint.fcntl.flock, []

    def removed_first(descriptor, operation):
        if not calls:
            (tmp_path / checkpoint.LOCK).unlink()
        calls.append(operation)
        return real_flock(descriptor, operation)

    monkeypatch.setattr(checkpoint.fcntl, "flock", removed_first)
    try:
        assert checkpoint.lock(tmp_path) is None
        monkeypatch.undo()
        locked, named = os.fstat(checkpoint._lock), os.stat(tmp_path / checkpoint.LOCK)
        assert (locked.st_dev, locked.st_ino) == (named.st_dev, named.st_ino)
    finally:
        checkpoint.unlock()
        if holder:
            holder.kill()
            holder.wait()


def read_only_lock(folder):
    """What checkpoint.lock says of `folder` made read-only for real: a read-only bind mount in a
    private mount namespace (as root), or mode 0555 (as another user); None where neither can be
    made."""
    code = ("import sys; from pathlib import Path; from systems import checkpoint; "
            "print(checkpoint.lock(Path(sys.argv[1])))")
    root = Path(__file__).resolve().parents[1]
    if os.geteuid() != 0:
        folder.chmod(0o555)
        command = [sys.executable, "-c", code, str(folder)]
    elif shutil.which("unshare"):
        command = ["unshare", "-m", "sh", "-c", 'mount --bind "$1" "$1" && mount -o '
                   'remount,bind,ro "$1" "$1" && exec "$2" -c "$3" "$1"', "sh", str(folder),
                   sys.executable, code]
    else:
        return None
    result = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if "mount" in result.stderr and result.returncode != 0 and "Traceback" not in result.stderr:
        return None  # no namespaces here (a container without CAP_SYS_ADMIN)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


@pytest.mark.parametrize("case", ["read-only", "dangling symlink", "below a file", "a file"])
def test_an_out_that_cannot_hold_a_run_stops_in_one_line(tmp_path, case):
    """--out a read-only folder (with a run in it, for --resume), a symlink to nowhere, a path
    below a file, a file: one line naming what is wrong, nothing made."""
    (tmp_path / "file").write_text("mine")
    out = {"read-only": tmp_path / "run", "dangling symlink": tmp_path / "link",
           "below a file": tmp_path / "file" / "run", "a file": tmp_path / "file"}[case]
    if case == "read-only":
        write_checkpoint(out / "final", 1)
        message = read_only_lock(out)
        if message is None:
            pytest.skip("no way to make a folder read-only here")
    else:
        if case == "dangling symlink":
            out.symlink_to(tmp_path / "nowhere")
        with pytest.raises(SystemExit) as error:
            checkpoint.open_run(run_args(out, resume=True), 0, 1)
        message = str(error.value)
    expected = {"read-only": f"--out {out} cannot be written (Read-only file system"
                if os.geteuid() == 0 else f"--out {out} cannot be written (Permission denied",
                "dangling symlink": f"is a symlink to {tmp_path / 'nowhere'}, which does not exist",
                "below a file": f"{tmp_path / 'file'} is a file, not a folder",
                "a file": f"{tmp_path / 'file'} is a file, not a folder"}[case]
    assert expected in message and "\n" not in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["file", *{"read-only": ["run"], "dangling symlink": ["link"]}.get(case, [])])
    assert (tmp_path / "file").read_text() == "mine"


def test_under_torchrun_every_rank_learns_that_out_is_locked(tmp_path, letter_model):
    """torchrun x2 (gloo) on an --out another process holds: rank 0 meets the lock, both ranks
    stop with its line, before any model loads."""
    from test_train import flags, run_module

    holder = hold_lock(tmp_path / "out")
    try:
        result = run_module(flags(letter_model(tmp_path), tmp_path / "out", "--resume"), procs=2)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode != 0
    assert result.stderr.count(f"pid {holder.pid}); wait for it to end") == 2, result.stderr[-3000:]


# ---------------------------------------------------------------- durable checkpoints
class PageCache:
    """The bytes of each file that are on disk: what an fsync of it last saw (files there before
    count as on disk). `after_power_loss` models a power loss on a journaling filesystem such as
    ext4 (data=ordered, delayed allocation): every rename and removal made before the loss
    survives, in order, but a file keeps only the bytes last fsynced (none if it never was: the
    zero-length file found after a crash). What it cannot show: a filesystem that reorders folder
    operations (the parent's fsync before `rotate` removes anything guards against that), nor a
    disk that lies about its flush."""

    def __init__(self, root):
        self.on_disk = {file.stat().st_ino: file.read_bytes()
                        for file in root.rglob("*") if file.is_file()}

    def fsync(self, descriptor):
        path = Path(os.readlink(f"/proc/self/fd/{descriptor}"))
        if path.is_file():
            self.on_disk[path.stat().st_ino] = path.read_bytes()

    def forget(self, path):
        """Files about to be removed: their inodes may come back as other files'."""
        path = Path(path)
        for file in [path] if path.is_file() else path.rglob("*"):
            if file.is_file():
                self.on_disk.pop(file.stat().st_ino, None)

    def after_power_loss(self, root, copy):
        """`root` as a power loss now would leave it, written to `copy`."""
        shutil.copytree(root, copy)
        for file in root.rglob("*"):
            if file.is_file():
                kept = self.on_disk.get(file.stat().st_ino, b"")
                if file.read_bytes() != kept:
                    (copy / file.relative_to(root)).write_bytes(kept)


def save_killed_at(path, state, kill_at, cache, monkeypatch):
    """checkpoint.save(path, *state, keep_last=1) killed before its file operation number
    `kill_at` (fsyncs, renames, removals; inside DCP's save they are not kill points: its
    .metadata, synced and written last, is its own mark), `cache` told of every fsync and
    removal. Returns how many operations it made."""
    done, in_dcp = [], []

    def counted(operation, before=None):
        def run(*args, **kwargs):
            if not in_dcp:
                if len(done) == kill_at:
                    raise Killed
                done.append(operation.__name__)
            if before and Path(args[-1]).exists():
                cache.forget(args[-1])
            return operation(*args, **kwargs)
        return run

    real_dcp_save, real_fsync, real_rmtree = checkpoint.dcp.save, os.fsync, shutil.rmtree

    def dcp_save(*args, **kwargs):
        in_dcp.append(1)
        try:
            return real_dcp_save(*args, **kwargs)
        finally:
            in_dcp.clear()

    def fsync(descriptor):
        cache.fsync(descriptor)
        return real_fsync(descriptor)

    monkeypatch.setattr(checkpoint.dcp, "save", dcp_save)
    monkeypatch.setattr(os, "fsync", counted(fsync))
    monkeypatch.setattr(os, "rename", counted(os.rename))
    monkeypatch.setattr(os, "replace", counted(os.replace, before=True))  # forgets its target
    monkeypatch.setattr(shutil, "rmtree", counted(real_rmtree, before=True))
    try:
        checkpoint.save(path, *state, keep_last=1)
    except Killed:
        pass
    finally:
        monkeypatch.undo()
    return len(done)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_kill_or_a_power_loss_at_any_point_of_a_save_keeps_a_checkpoint(
        tmp_path, monkeypatch, tiny_llama, smollm2_tokenizer, one_thread, sharded):
    """step_1 on disk, then the save of step_2 with --keep-last 1 (which removes step_1), killed
    before each of its file operations in turn; and each of those moments followed by a power loss
    (PageCache). Every time, --resume's recover and latest find a complete checkpoint that loads
    back exactly (step_2's weights, or step_1's), never an older one after the power loss than
    after the kill alone."""
    import collections
    import copy

    import torch

    from systems.model import load_model

    policy = tiny_llama(64)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
    weights = {}

    def train_step(step):
        policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        weights[step] = copy.deepcopy(policy.state_dict())
        trainer_state = {"step": step, "data_position": 0, "world_size": 1, "sharded": sharded}
        return (policy, smollm2_tokenizer, optimizer, torch.Generator(), collections.deque(),
                trainer_state, 0)

    def resumed_step(out):
        """What --resume finds in OUT: the step of the checkpoint, after loading it back whole."""
        checkpoint.recover(out)
        newest = checkpoint.latest(out)
        assert newest is not None
        step = checkpoint.step_of(newest)
        model = load_model(str(newest)) if checkpoint.has_weights(newest) else tiny_llama(64, 1)
        checkpoint.load(newest, model, torch.optim.AdamW(model.parameters(), lr=0.1),
                        torch.Generator(), 0)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, weights[step][name]), (step, name)
        return step

    base = tmp_path / "base"
    checkpoint.save(base / "step_1", *train_step(1), keep_last=1)
    start = copy.deepcopy((policy.state_dict(), optimizer.state_dict()))

    def killed_at(kill_at):
        out = tmp_path / f"killed{kill_at}"
        shutil.copytree(base, out)
        policy.load_state_dict(start[0])
        optimizer.load_state_dict(copy.deepcopy(start[1]))
        cache = PageCache(out)
        return out, cache, save_killed_at(out / "step_2", train_step(2), kill_at, cache,
                                          monkeypatch)

    operations = killed_at(10**6)[2]
    for kill_at in range(operations + 1):
        out, cache, _ = killed_at(kill_at)
        cache.after_power_loss(out, tmp_path / f"crashed{kill_at}")
        killed = resumed_step(out)
        assert resumed_step(tmp_path / f"crashed{kill_at}") == killed, kill_at
    assert killed == 2 and sorted(p.name for p in out.iterdir()) == ["step_2"]


def test_a_sharded_checkpoint_is_complete_with_every_ranks_shard_whole(tmp_path):
    """Under --fsdp completeness reads DCP's .metadata and checks each file it names (a rank's
    shard each) is there and as long as .metadata says, not .metadata alone."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = write_checkpoint(tmp_path / "step_1", 1, world_size=1)
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "sharded": True}))
    dcp.save({"model": {"w": torch.arange(1000.0)}}, checkpoint_id=path / "sharded")
    assert checkpoint.missing(path) is None
    shard = next((path / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut short by a lost page cache
    assert checkpoint.missing(path) == f"sharded/{shard.name}"
    shard.unlink()
    assert checkpoint.missing(path) == f"sharded/{shard.name}"
    (path / "sharded" / ".metadata").write_bytes(b"")
    assert checkpoint.missing(path) == "sharded/.metadata"


def test_a_removal_cut_short_is_removed_at_the_next_start(tmp_path, capsys):
    """A checkpoint is renamed .del-NAME before its removal: a kill in the middle leaves a folder
    known to be partial, which recover removes (and says so); nothing else is touched."""
    write_checkpoint(tmp_path / "step_2", 2)
    (write_checkpoint(tmp_path / ".del-step_1", 1) / "model.safetensors").unlink()
    (tmp_path / "notes").mkdir()
    assert checkpoint.latest(tmp_path) == tmp_path / "step_2"
    checkpoint.recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_2"]
    assert ".del-step_1" in capsys.readouterr().out


# ---------------------------------------------------------------- a damaged checkpoint
@pytest.fixture(scope="module")
def three_saves(tmp_path_factory, tiny_llama, smollm2_tokenizer, one_thread):
    """Run folders as checkpoint.save leaves them, 1 rank, a batch sampled ahead in the queue:
    step_1, step_2 and final (step 2); plain ("plain") and sharded as under --fsdp ("sharded").
    Returns {kind: folder}, and the batch as "batch"."""
    import collections

    import torch

    import rollout

    batch = {"weights_step": 1, "problems": [{"problem": "1 + 1", "answer": "2"}],
             "prompts": [[1, 2, 3]], "out": rollout.Rollout(
                 torch.tensor([[4, 5]]), torch.tensor([[-0.5, -1.5]]), torch.tensor([[1.0, 1.0]]))}
    saved = {"batch": batch}
    for kind in ("plain", "sharded"):
        out = tmp_path_factory.mktemp(kind)
        policy = tiny_llama(64)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
        for step, name in ((1, "step_1"), (2, "step_2"), (2, "final")):
            policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            trainer_state = {"step": step, "data_position": 4 * step, "world_size": 1,
                             "sharded": kind == "sharded"}
            checkpoint.save(out / name, policy, smollm2_tokenizer, optimizer, torch.Generator(),
                            collections.deque([batch]), trainer_state, 0)
        saved[kind] = out
    return saved


def cut_short(file):
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])


def plant(file, marker):
    """A pickle at `file` that, loaded as torch.load(weights_only=False) loads, writes `marker`."""
    import torch

    class Planted:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    torch.save({"torch": Planted()}, file)


def in_several_files(directory):
    """The weights saved as save_pretrained saves a large model: model-0000I-of-0000N.safetensors
    and their index (here a tiny maximum size a file)."""
    from systems.model import load_model

    model = load_model(str(directory))
    (directory / "model.safetensors").unlink()
    model.save_pretrained(directory, max_shard_size="20KB")
    return sorted(directory.glob("model-*.safetensors"))


DAMAGES = {  # what happens to final/ and step_2/, and what the line names
    "model.safetensors cut short": (
        "plain", lambda d, marker: cut_short(d / "model.safetensors"),
        "model.safetensors ({size} bytes where its header says"),
    "optimizer.pt cut short": (
        "plain", lambda d, marker: cut_short(d / "optimizer.pt"),
        "optimizer.pt (cut short, or not a PyTorch file: no zip directory at its end)"),
    "rng_rank0.pt cut short": (
        "sharded", lambda d, marker: cut_short(d / "rng_rank0.pt"),
        "rng_rank0.pt (cut short, or not a PyTorch file: no zip directory at its end)"),
    "queue_rank0.pt not a PyTorch file": (
        "plain", lambda d, marker: (d / "queue_rank0.pt").write_bytes(b"\x80\x04garbage"),
        "queue_rank0.pt (cut short, or not a PyTorch file"),
    "trainer_state.json garbage": (
        "plain", lambda d, marker: (d / "trainer_state.json").write_text("{not json"),
        "trainer_state.json (does not parse"),
    "a weight file of several deleted": (
        "plain", lambda d, marker: in_several_files(d)[-1].unlink(), "safetensors (missing)"),
    "a DCP shard deleted": (
        "sharded", lambda d, marker: (d / "sharded" / "__0_0.distcp").unlink(),
        "sharded/__0_0.distcp (missing)"),
    "optimizer.pt deleted": (
        "plain", lambda d, marker: (d / "optimizer.pt").unlink(), "optimizer.pt (missing)"),
    "a planted pickle in rng_rank0.pt": (
        "plain", lambda d, marker: plant(d / "rng_rank0.pt", marker),
        "rng_rank0.pt (it holds code, not data: a pickled exec, which is not run)"),
}


def folder_bytes(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != checkpoint.LOCK}


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_passes_over_damaged_checkpoints_for_the_newest_intact(
        tmp_path, three_saves, tiny_llama, one_thread, capsys, damage):
    """final/ and step_2/ damaged, step_1/ intact: --resume takes step_1, naming in one line each
    damaged file and what is wrong with it, loads step_1 back whole (its queue too), and changes
    nothing in the folder; no planted pickle runs."""
    import torch

    kind, spoil, named = DAMAGES[damage]
    out, marker = tmp_path / "out", tmp_path / "planted-ran"
    shutil.copytree(three_saves[kind], out)
    for name in ("final", "step_2"):
        spoil(out / name, marker)
    before = folder_bytes(out)
    resumed, trainer_state = checkpoint.open_run(run_args(out, resume=True), 0, 1)
    checkpoint.unlock()
    assert resumed == out / "step_1" and trainer_state["step"] == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].endswith(f"resuming {out / 'step_1'}"), printed
    for name in ("final", "step_2"):
        size = (out / name / "model.safetensors").stat().st_size if "{size}" in named else 0
        assert f"{out / name}/" in printed[0] and named.format(size=f"{size:,}") in printed[0], (
            printed)
    model = tiny_llama(64)
    queue = checkpoint.load(resumed, model, torch.optim.AdamW(model.parameters()),
                            torch.Generator(), 0)
    assert [batch["prompts"] for batch in queue] == [three_saves["batch"]["prompts"]]
    assert torch.equal(queue[0]["out"].token_logprobs, three_saves["batch"]["out"].token_logprobs)
    assert not marker.exists()
    assert folder_bytes(out) == before


@pytest.mark.parametrize("damage", ["model.safetensors cut short", "a planted pickle in "
                                    "rng_rank0.pt", "trainer_state.json garbage"])
def test_resume_with_no_intact_checkpoint_stops_in_one_line_and_touches_nothing(
        tmp_path, three_saves, one_thread, damage):
    kind, spoil, named = DAMAGES[damage]
    out, marker = tmp_path / "out", tmp_path / "planted-ran"
    shutil.copytree(three_saves[kind], out)
    for name in ("final", "step_2", "step_1"):
        spoil(out / name, marker)
    before = folder_bytes(out)
    with pytest.raises(SystemExit) as error:
        checkpoint.open_run(run_args(out, resume=True), 0, 1)
    checkpoint.unlock()
    message = str(error.value)
    assert "\n" not in message and "no older one" in message and str(out) in message, message
    assert not marker.exists()
    assert folder_bytes(out) == before


@pytest.mark.parametrize("name", ["rng_rank0.pt", "queue_rank0.pt"])
def test_a_planted_pickle_never_runs_at_resume(tmp_path, three_saves, tiny_llama, one_thread,
                                               name):
    """A run folder whose only checkpoint holds a pickle that runs code in place of its RNG state
    or its queue: --resume, as train.py does it (open_run, then checkpoint.load), stops in one line
    naming the file, and the code never runs (torch.load(weights_only=False) ran it)."""
    import torch

    out, marker = tmp_path / "out", tmp_path / "planted-ran"
    shutil.copytree(three_saves["plain"], out)
    for step in ("step_1", "step_2"):
        shutil.rmtree(out / step)
    plant(out / "final" / name, marker)
    message = None
    try:
        resumed, _ = checkpoint.open_run(run_args(out, resume=True), 0, 1)
        model = tiny_llama(64)
        checkpoint.load(resumed, model, torch.optim.AdamW(model.parameters()), torch.Generator(), 0)
    except SystemExit as error:
        message = str(error)
    except Exception:  # what the planted object then breaks: the code has run already
        pass
    finally:
        checkpoint.unlock()
    assert not marker.exists(), "the planted pickle ran"
    assert message and "\n" not in message
    assert f"{out / 'final' / name} (it holds code, not data: a pickled exec" in message


def test_recover_never_replaces_an_intact_checkpoint_by_a_damaged_one(tmp_path):
    """A replacement of final/ that a kill interrupted, where the newer checkpoint is complete but
    damaged (its weights cut short): recover keeps the intact older one, whichever name it has
    (final/ with a .tmp-final beside it, or .old-final beside a final/), and --resume takes it."""
    for newer, older in ((".tmp-final", "final"), ("final", ".old-final")):
        out = tmp_path / newer.strip(".")
        write_checkpoint(out / older, 1)
        cut_short(write_checkpoint(out / newer, 2) / "model.safetensors")
        checkpoint.recover(out)
        passed_over = []
        assert checkpoint.latest(out, passed_over) == out / older, newer
        assert checkpoint.step_of(out / older) == 1
        weights = out / newer / "model.safetensors"
        assert passed_over == [f"{weights} (cut short: {weights.stat().st_size} bytes, its header "
                               f"alone is longer)"], passed_over


def test_a_garbage_line_in_metrics_jsonl_is_named_by_its_number(tmp_path, three_saves):
    """A whole line of metrics.jsonl that is not a row stops --resume in one line naming the file
    and the line's number, before anything is loaded or written; a torn last line is still
    dropped (`test_a_resume_drops_rows_past_its_checkpoint_by_a_new_file`)."""
    out = tmp_path / "out"
    shutil.copytree(three_saves["plain"], out)
    rows = [json.dumps({"step": 1, "reward": 0.5}), "\x00garbage{", json.dumps({"step": 2})]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    before = folder_bytes(out)
    with pytest.raises(SystemExit) as error:
        checkpoint.open_run(run_args(out, resume=True), 0, 1)
    checkpoint.unlock()
    message = str(error.value)
    assert f"{out / 'metrics.jsonl'} line 2 is not JSON" in message and "\n" not in message
    assert folder_bytes(out) == before
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        checkpoint.start_log(run_args(out, resume=True), 1, resumed=True)


def test_rng_and_queue_files_hold_tensors_and_plain_data_and_older_ones_still_load(
        tmp_path, three_saves):
    """What --resume reads of a checkpoint loads with torch.load(weights_only=True) and nothing
    allowed beyond it; the files of a checkpoint written before (numpy's RNG key as an array, the
    queue's rollout.Rollout) load too, with only those types allowed, to the same RNG streams."""
    import random

    import numpy as np
    import torch

    import rollout

    final = three_saves["plain"] / "final"
    for name in ("rng_rank0.pt", "queue_rank0.pt", "optimizer.pt"):
        torch.load(final / name, weights_only=True)  # raises on any other type
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    generator = torch.Generator().manual_seed(5)
    older = {"torch": torch.get_rng_state(), "cuda": [], "python": random.getstate(),
             "numpy": np.random.get_state(), "sampler": generator.get_state()}
    draws = lambda: (torch.rand(2).tolist(), random.random(), np.random.rand(),  # noqa: E731
                     torch.rand(1, generator=generator).item())
    expected = draws()
    torch.save(older, tmp_path / "rng_rank0.pt")
    torch.save([{**three_saves["batch"], "out": three_saves["batch"]["out"]}],
               tmp_path / "queue_rank0.pt")
    checkpoint.set_rng_state(checkpoint.load_data(tmp_path / "rng_rank0.pt"), generator)
    assert draws() == expected
    (batch,) = checkpoint.load_data(tmp_path / "queue_rank0.pt")
    assert isinstance(checkpoint.on_device(batch, "cpu")["out"], rollout.Rollout)


# ---------------------------------------------------------------- a full disk
@pytest.mark.parametrize("when", ["before", "while writing"])
def test_a_full_disk_says_so_in_one_line_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch, tiny_llama, smollm2_tokenizer, one_thread, when):
    """A disk without room for the next checkpoint: found before writing (free space below the
    weights + AdamW state), or while writing (torch.save's zip writer then says only 'unexpected
    pos'). Either way one line with the bytes a save needs and what is free, step_1 intact, no
    .tmp-step_2 left."""
    import collections

    import torch

    policy = tiny_llama(64)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()

    def save(step):
        trainer_state = {"step": step, "data_position": 0, "world_size": 1}
        checkpoint.save(tmp_path / f"step_{step}", policy, smollm2_tokenizer, optimizer,
                        torch.Generator(), collections.deque(), trainer_state, 0, keep_last=1)

    save(1)
    # fp32 weights and AdamW's two moments, 4 bytes a number; AdamW's step, a float32 a weight;
    # or step_1's size on disk (the tokenizer too), the larger
    needed = max(sum(p.numel() * 3 * 4 + 4 for p in policy.parameters()),
                 sum(f.stat().st_size for f in (tmp_path / "step_1").rglob("*") if f.is_file()))
    usage = shutil.disk_usage

    def full(path):  # `when` == "before": short of room already; else full after the first query
        full.calls += 1
        room = 1000 if when == "before" or full.calls > 1 else 10**12
        return usage(path)._replace(free=room)

    full.calls = 0
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", full)
    if when == "while writing":
        def cut_short(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 "
                               "vs 598")
        monkeypatch.setattr(checkpoint.torch, "save", cut_short)
    with pytest.raises(SystemExit) as error:
        save(2)
    message = str(error.value)
    assert "\n" not in message
    assert (f"needs about {needed:,} bytes, 1,000 are free" if when == "before" else
            f"needs more than the 1,000 bytes free (estimated at {needed:,})") in message
    assert "--keep-last 1 the folder holds 2 checkpoints" in message
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert checkpoint.missing(tmp_path / "step_1") is None


def test_a_resumed_run_maps_nothing_of_the_checkpoint_it_resumed(
        tmp_path, tiny_llama, smollm2_tokenizer, one_thread):
    """Loaded as train.py loads it (the weights by from_pretrained, then checkpoint.load), then
    removed as --keep-last removes it: no file of the checkpoint stays mapped into the process, so
    its disk space is free at once (safetensors and torch.load(mmap=True) had kept the weights and
    the AdamW state mapped from the deleted files until the run ended)."""
    import collections

    import torch

    from systems.model import load_model

    policy = tiny_llama(64)
    optimizer = torch.optim.AdamW(policy.parameters())
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    trainer_state = {"step": 1, "data_position": 0, "world_size": 1}
    checkpoint.save(tmp_path / "step_1", policy, smollm2_tokenizer, optimizer, torch.Generator(),
                    collections.deque(), trainer_state, 0)
    resumed = load_model(str(tmp_path / "step_1"))
    resumed_optimizer = torch.optim.AdamW(resumed.parameters())
    checkpoint.load(tmp_path / "step_1", resumed, resumed_optimizer, torch.Generator(), 0)
    checkpoint.retire(tmp_path / "step_1")
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if str(tmp_path) in line]
    assert mapped == []
    for name, tensor in resumed.state_dict().items():  # and the values are the checkpoint's
        assert torch.equal(tensor, policy.state_dict()[name]), name


def test_a_new_run_refused_a_folder_leaves_no_lock_file_in_it(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="is not empty: pass --resume"):
        checkpoint.open_run(run_args(tmp_path), 0, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_second_run_on_a_running_out_stops_and_a_killed_ones_lock_is_taken_over(
        tmp_path, letter_model):
    """Real processes: a run going (--save-every 1), a second `--resume` on its --out stops at once
    naming the first's pid, and the first's metrics.jsonl goes on unharmed; the first SIGKILLed,
    a third `--resume` takes its lock over, says so, and continues from its newest checkpoint."""
    import signal
    import time

    from test_train import ROOT, flags, metrics, run_module

    out = tmp_path / "out"
    argv = flags(letter_model(tmp_path), out, "--steps", "500", "--save-every", "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    first = subprocess.Popen([sys.executable, "-m", "test_train", *argv], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while checkpoint.latest(out) is None and time.time() < deadline:
            time.sleep(0.5)
        second = run_module([*argv, "--resume"])
        assert second.returncode == 1
        assert f"pid {first.pid}); wait for it to end" in second.stderr.strip().splitlines()[-1]
        assert first.poll() is None  # the first goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = [row["step"] for row in metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # one row a step, none twice
    newest = checkpoint.step_of(checkpoint.latest(out))
    third = run_module([*argv[:-4], "--steps", str(newest + 1), "--resume"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the lock of {out} from a run that is gone (host " in third.stdout
    assert f"pid {first.pid}" in third.stdout and f"resuming {out / f'step_{newest}'}" in third.stdout
    assert [row["step"] for row in metrics(out)] == list(range(1, newest + 2))
