"""Tests of systems/checkpoint.py's on-disk protocol, without training: what makes a checkpoint complete,
which one --resume takes, and a kill at every point of a replacement of final/ (test_train.py kills
real torchrun runs at the worst of these points)."""
import json
import os
import shutil
from pathlib import Path

import pytest

from systems import checkpoint

FILES = ("config.json", "model.safetensors", "optimizer.pt")


def write_checkpoint(directory, step, world_size=2):
    """A checkpoint's files as checkpoint.save leaves them (contents are not read here)."""
    directory.mkdir(parents=True)
    for name in (*FILES, *(f"{kind}_rank{rank}.pt" for rank in range(world_size)
                           for kind in ("rng", "queue"))):
        (directory / name).write_text("x")
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
    assert operations == 6  # retire .old-final (2), two renames, retire .old-final (2)
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
