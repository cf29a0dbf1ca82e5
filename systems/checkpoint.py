"""Checkpoints and runs that never mix: what train.py writes to --out and how --resume continues it.

A checkpoint OUT/step_N (or OUT/final) holds the policy's weights as safetensors (loadable by
from_pretrained, vLLM, lm-eval), the tokenizer, the AdamW state, every rank's RNG state and queue
of batches sampled ahead (--async-lag, on the CPU), and trainer_state.json (steps done, prompts
consumed, world size, the run-defining flags with --dtype resolved). A resumed run continues bit
for bit. Under FSDP (--fsdp) the fp32 weights and the AdamW state are saved sharded instead, with
torch.distributed.checkpoint (DCP) into OUT/NAME/sharded/: each rank writes its own shard, and
nothing is gathered onto rank 0 (at 7B a full gather is ~92 GB of rank 0's host memory); only final/
also gets the gathered weights, as bf16 safetensors for eval.py and vLLM (config.json says bfloat16;
--resume reads the fp32 shards). --keep-last N keeps the N
newest step_N checkpoints (final/ is never removed).

A kill at any moment, or a power loss, leaves the last complete checkpoint usable:
  1. every rank writes its files into OUT/.tmp-NAME and fsyncs them (DCP syncs its shards and
     .metadata); a barrier;
  2. rank 0 fsyncs every file of it and its folders, then writes trainer_state.json (synced, by a
     rename): a checkpoint is complete once it is there with every rank's files, each DCP shard as
     long as .metadata says (`missing`);
  3. an older OUT/NAME (final/ at a resume's end) is renamed OUT/.old-NAME, .tmp-NAME renamed
     OUT/NAME, OUT fsynced, and only then is .old-NAME removed (and `rotate` the older step_N).
A removal first renames the folder .del-NAME, so one that a kill cut short is known to be partial.
At every moment a complete checkpoint with the newest step is on disk under one of the three names;
`latest` looks at all of them, and `recover` (at --resume, before anything reads --out) finishes a
replacement that a kill interrupted and removes the .del-NAME folders.

Runs never mix: rank 0 holds OUT/.lock while it runs (`lock`: a second process on OUT stops at once,
naming the holder's host and pid); a new run needs an empty --out; --resume takes the newest
intact checkpoint (complete, and each of its files reads back as what it holds: `damaged`; it says
which incomplete or damaged ones it passed over) and refuses one written with other run-defining
flags (naming them), by another number of ranks, or in another compute dtype; with no complete
checkpoint it starts over only where no step was logged (`cannot_start_over`). A run's log is
never destroyed (`start_log`). A resume runs no one's code: the .pt files hold tensors and plain
data, read with torch.load(weights_only=True) (`load_data`); DCP's .metadata is a pickle, read as
PyTorch reads it.
"""
import atexit
import collections
import dataclasses
import fcntl
import gc
import json
import os
import random
import re
import shutil
import socket
import zipfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

import rollout
from systems.runtime import barrier, fail, stop_if_any_rank, unwrap

# flags that do not change what a run computes (the gradient does not depend on the micro-batch, the
# sharding, recomputation or one policy pass; the samples do not depend on the sampler's chunks or
# on compiling, nor the log-probs on attention by sequences, up to float rounding); every other flag
# must match the checkpoint's for --resume
RESUMABLE_CHANGES = {"out", "resume", "steps", "save_every", "eval_every", "eval_tasks",
                     "eval_limit", "micro_batch", "recompute", "fsdp", "max_bad_steps",
                     "report_to", "generate_rows", "keep_last", "compile_sampler", "by_segments",
                     "one_policy_pass", "share_prefix"}
SHARDED = "sharded"  # the DCP folder of an FSDP checkpoint
LOCK = ".lock"  # OUT/.lock: held by the run writing OUT (its rank 0), naming its host and pid
_lock = None  # the descriptor of the lock this process holds, if any


def run_flags(args):
    """The flags that define a run, as stored in its checkpoints."""
    return {k: v for k, v in vars(args).items() if k not in RESUMABLE_CHANGES}


def flag_changes(saved, args):
    """The flags a resumed run sets differently from the checkpoint's, as 'name: old -> new'
    strings."""
    now = run_flags(args)
    return [f"--{k.replace('_', '-')}: {saved.get(k)} -> {now.get(k)}"
            for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]


def missing(directory):
    """The first file the checkpoint `directory` lacks, or None when it is complete."""
    try:
        state = json.loads((directory / "trainer_state.json").read_text())
        world_size = state["world_size"]
    except (OSError, ValueError, KeyError):  # being written, or not a checkpoint
        return "trainer_state.json"
    needed = ["config.json", *(f"{kind}_rank{rank}.pt" for rank in range(world_size)
                               for kind in ("rng", "queue"))]
    if not state.get("sharded"):
        needed.append("optimizer.pt")
    final = directory.name.endswith("final")  # final, or .tmp-final / .old-final
    if not has_weights(directory) and (final or not state.get("sharded")):
        return "model.safetensors"
    absent = next((name for name in needed + weight_files(directory)
                   if not (directory / name).is_file()), None)
    return absent or (missing_shard(directory / SHARDED) if state.get("sharded") else None)


def weight_files(directory):
    """The safetensors files that the index of weights saved in several files names (from_pretrained
    reads them all), or [] where there is no index."""
    try:
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        return sorted(set(index["weight_map"].values()))
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ["model.safetensors.index.json"]  # there, but unreadable: as good as lost


def missing_shard(sharded):
    """The first file of the DCP checkpoint `sharded` that its .metadata names and that is absent
    or shorter than the bytes .metadata places in it (every rank's shard), or None."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(sharded).read_metadata()
    except Exception:  # absent, or cut short
        return f"{SHARDED}/.metadata"
    ends = collections.Counter()
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends[info.relative_path], info.offset + info.length)
    return next((f"{SHARDED}/{name}" for name, end in sorted(ends.items())
                 if not (sharded / name).is_file() or (sharded / name).stat().st_size < end),
                None)


def has_weights(directory):
    """Whether the checkpoint holds the full weights as safetensors (from_pretrained loads it)."""
    return any(directory.glob("*.safetensors"))


def step_of(directory):
    return json.loads((directory / "trainer_state.json").read_text())["step"]


def latest(out, passed_over=None):
    """The intact checkpoint with the most steps: OUT/NAME, or the .tmp-NAME / .old-NAME of a
    replacement a kill interrupted (OUT/NAME first at the same step); None if there is none. The
    complete ones are checked newest first (`damaged`) until one is intact; each damaged one is
    added to the list `passed_over` as 'FILE (why)'."""
    done = [d for d in out.glob("*") if d.is_dir() and not d.name.startswith(".del-")
            and missing(d) is None]
    for directory in sorted(done, key=lambda d: (step_of(d), not d.name.startswith(".")),
                            reverse=True):
        damage = damaged(directory)
        if damage is None:
            return directory
        if passed_over is not None:
            passed_over.append(f"{directory}{os.sep}{damage}")
    return None


def damaged(directory):
    """What of the complete checkpoint `directory` does not read back as what it holds, as 'FILE
    (why)', or None: trainer_state.json and config.json parse, each safetensors file's header does
    and the file is as long as it says, each .pt file loads as data (`load_data`: optimizer.pt
    mapped, not read), and a sharded checkpoint's shards are as long as its .metadata says
    (`missing`). What train.py then loads is read once more: these files are small, or mapped."""
    state = json.loads((directory / "trainer_state.json").read_text())  # `missing` parsed it
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return "trainer_state.json (no step in it)"
    try:
        json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"config.json (does not parse: {one_line(error)})"
    for file in sorted(directory.glob("*.safetensors")):
        fault = safetensors_fault(file)
        if fault:
            return f"{file.name} ({fault})"
    names = [*(f"{kind}_rank{rank}.pt" for rank in range(state["world_size"])
               for kind in ("rng", "queue")), *(() if state.get("sharded") else ["optimizer.pt"])]
    for name in names:
        try:
            load_data(directory / name, mmap=name == "optimizer.pt")
        except Exception as error:  # cut short, not a PyTorch file, or code in it
            return f"{name} ({not_data(directory / name, error)})"
    return None


def safetensors_fault(file):
    """Why the safetensors `file` cannot be whole, or None: an 8-byte header length, a JSON
    header, and as many bytes after it as its last tensor ends at (as the safetensors format
    says)."""
    size = file.stat().st_size
    with open(file, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        if size < 8 or length > size - 8:
            return f"cut short: {size:,} bytes, its header alone is longer"
        try:
            header = json.loads(stream.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items()
                       if key != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            return f"its header does not parse: {one_line(error)}"
    if size != 8 + length + end:
        return f"{size:,} bytes where its header says {8 + length + end:,}"
    return None


def not_data(file, error):
    """Why the .pt `file` did not load as data, in a few words."""
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if refused:
        return f"it holds code, not data: a pickled {refused.group(1)}, which is not run"
    if not zipfile.is_zipfile(file):  # torch.save writes a zip, its directory at the end
        return "cut short, or not a PyTorch file: no zip directory at its end"
    unpickler = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))
    return f"does not load: {unpickler.group(1)[:200] if unpickler else one_line(error)}"


def one_line(error):
    """The first line of an exception's message (its type where it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__


def retire(directory):
    """Remove a checkpoint directory: first renamed .del-NAME (one atomic step), so a kill in the
    middle of the removal leaves a folder that is known to be partial (`recover` removes it)."""
    if not directory.exists():
        return
    doomed = directory.parent / f".del-{directory.name}"
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(directory, doomed)
    shutil.rmtree(doomed)


def replace(path, tmp):
    """Put the complete checkpoint `tmp` at `path` (steps 3 of the module docstring); the new name
    is on disk (the parent folder fsynced) before the old checkpoint is removed."""
    old = path.parent / f".old-{path.name}"
    retire(old)
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    sync_directory(path.parent)
    retire(old)


def recover(out):
    """Finish the replacements a kill interrupted: a complete .tmp-NAME goes to NAME; an .old-NAME
    is removed where NAME is complete, and otherwise put back. A .del-NAME (a removal that a kill
    cut short) is removed, and said so."""
    for doomed in out.glob(".del-*"):
        print(f"removing {doomed}, left partial by a removal that was killed")
        shutil.rmtree(doomed)
    for tmp in out.glob(".tmp-*"):
        if tmp.is_dir() and intact(tmp):
            replace(out / tmp.name[len(".tmp-"):], tmp)
    for old in out.glob(".old-*"):
        path = out / old.name[len(".old-"):]
        if path.exists() and intact(path):
            retire(old)
        elif missing(path) and intact(old):  # NAME incomplete or absent: the old one back
            retire(path)
            os.rename(old, path)
        # else NAME complete but damaged: both stay, and `latest` takes .old-NAME if intact
    sync_directory(out)


def intact(directory):
    return missing(directory) is None and damaged(directory) is None


def open_run(args, rank, world_size):
    """(checkpoint to resume or None, its trainer_state or {}), after the checks that keep runs
    apart. Every rank calls this: rank 0 locks --out (`lock`), looks at it, recovers it, and
    chooses the checkpoint (`choose`), before anyone reads it."""
    problem = None
    if rank == 0:
        ours = not (args.out / LOCK).exists()  # a lock file this run adds, to remove if it stops
        problem = lock(args.out)
        if not problem and not args.resume and any(p.name != LOCK for p in args.out.iterdir()):
            problem = (f"{args.out} is not empty: pass --resume to continue that run, or another "
                       f"--out")
            if ours:  # removed while locked: a run that opened it meanwhile locks it after
                (args.out / LOCK).unlink()  # this, and finds it gone (`lock`)
                unlock()
    stop_if_any_rank(problem)
    checkpoint = None
    if args.resume and rank == 0:
        if args.out.is_dir():
            recover(args.out)
        checkpoint, problem = choose(args)
    checkpoint, problem = from_rank0((checkpoint, problem))
    if problem:
        fail(problem)
    if checkpoint is None:
        return None, {}
    trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
    changed = flag_changes(trainer_state["flags"], args) if "flags" in trainer_state else []
    if changed:
        fail(f"{checkpoint} was run with other flags ({'; '.join(changed)}); resume with the same "
             f"flags or another --out")
    if trainer_state["world_size"] != world_size:
        fail(f"{checkpoint} was written by {trainer_state['world_size']} ranks; "
             f"resume with as many")
    return checkpoint, trainer_state


def choose(args):
    """(the checkpoint --resume continues, or None; why it must stop instead, one line, or None),
    on rank 0. It takes the newest intact checkpoint (`latest`); the named checkpoints newer than
    that one but incomplete (a rank's files lost) or damaged are passed over, in one line, or the
    run stops rather than start again from nothing. With no checkpoint at all it starts over only
    where no step was logged (`cannot_start_over`). Nothing in --out is changed here."""
    passed_over = []
    checkpoint = latest(args.out, passed_over)
    newer = step_of(checkpoint) if checkpoint else -1
    for directory in sorted(args.out.glob("[!.]*")):
        if not (directory / "trainer_state.json").is_file() or missing(directory) is None:
            continue
        try:
            if step_of(directory) > newer:
                passed_over.append(f"{directory / missing(directory)} (missing)")
        except (OSError, ValueError, KeyError, TypeError) as error:
            passed_over.append(f"{directory / 'trainer_state.json'} (does not parse: "
                               f"{one_line(error)})")
    try:
        logged_rows(args.out / "metrics.jsonl")
    except ValueError as error:
        return None, f"{error}; mend or remove that line, then --resume"
    if passed_over and checkpoint is None:
        first = passed_over[0]
        if first.endswith(" (missing)"):
            return None, (f"{first.removesuffix(' (missing)')} is missing: the checkpoint is "
                          f"incomplete and no older one is; remove it to start again, or use "
                          f"another --out")
        return None, (f"{first}: the checkpoint is damaged and no older one is intact; nothing "
                      f"was changed; remove it to start again, or use another --out")
    if passed_over:
        print(f"passing over checkpoints that are incomplete or damaged ({'; '.join(passed_over)}):"
              f" resuming {checkpoint}")
    return checkpoint, None if checkpoint else cannot_start_over(args)


def from_rank0(value):
    """Rank 0's `value` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def lock(out):
    """Take OUT/.lock for this process, or say in one line who holds it, or why OUT cannot be a
    run's folder. One run per folder: the lock is an flock(2) on OUT/.lock, which the kernel
    releases when its process ends however it ends (SIGKILL, a crash), so a lock whose process is
    gone is free and is taken over (and said so: the file still names it). Once locked, the path
    must still name the locked file: a run that removed it in between (`open_run`, under its own
    lock) leaves a lock on a file no other run can see, so it is taken again. It holds where flock
    does: on local filesystems, and on NFS (Linux emulates flock with a POSIX lock that the server
    arbitrates between hosts; per host only under the mount options nolock or local_lock). Where
    the filesystem has no locks at all, a warning, and no lock."""
    global _lock
    unlock()
    while True:
        try:
            out.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            return unusable(out, error)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not same_file(descriptor, out / LOCK):  # its holder removed it meanwhile
                os.close(descriptor)
                continue
            holder = os.read(descriptor, 4096).decode(errors="replace").strip() or "starting"
            os.close(descriptor)
            return (f"{out} is in use by another run ({holder}); wait for it to end, stop it, or "
                    f"pass another --out")
        except OSError as error:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
            os.close(descriptor)
            print(f"warning: cannot lock {out} ({error.strerror}): nothing stops a second run "
                  f"writing it")
            return None
        if same_file(descriptor, out / LOCK):
            break
        os.close(descriptor)  # removed or replaced since it was opened: lock the one there now
    previous = os.read(descriptor, 4096).decode(errors="replace").strip()
    if previous:
        print(f"took over the lock of {out} from a run that is gone ({previous})")
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
    os.fsync(descriptor)
    _lock = descriptor
    return None


def same_file(descriptor, path):
    """Whether `path` names the file open as `descriptor`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def unusable(out, error):
    """The one-line message of an --out that cannot hold a run (`error`: what mkdir or open
    raised)."""
    if out.is_symlink() and not out.exists():
        return (f"--out {out} is a symlink to {os.readlink(out)}, which does not exist: create "
                f"that folder, or pass another --out")
    above = next((folder for folder in (out, *out.parents) if folder.exists()), None)
    if above is not None and not above.is_dir():
        return f"--out {out}: {above} is a file, not a folder; pass another --out"
    return f"--out {out} cannot be written ({error.strerror}); pass another --out"


def unlock():
    """Release this process's lock (at exit, or before it takes another): the file is emptied, so
    the next run takes it without a word."""
    global _lock
    if _lock is not None:
        os.ftruncate(_lock, 0)
        os.close(_lock)
        _lock = None


atexit.register(unlock)


def cannot_start_over(args):
    """Why --resume, finding no complete checkpoint in --out, must not start the run over there
    (one line), or None. Starting over would truncate a run's metrics.jsonl and replace its
    config.json (and log into its W&B run): it is refused once a step is logged, or where
    config.json names other run-defining flags. A run killed before its first step starts over."""
    metrics = args.out / "metrics.jsonl"
    logged = metrics.read_bytes().count(b"\n") if metrics.is_file() else 0
    if logged:
        return (f"{args.out} holds {logged} steps in metrics.jsonl but no complete checkpoint to "
                f"resume (a run saves only final/ unless --save-every): nothing to continue from; "
                f"move the folder away to start over, or pass another --out")
    config = args.out / "config.json"
    saved = json.loads(config.read_text()) if config.is_file() else {}
    changed = flag_changes({k: v for k, v in saved.items() if k not in RESUMABLE_CHANGES}, args)
    if saved and changed:
        return (f"{config} is another run's ({'; '.join(changed)}), and {args.out} holds no "
                f"checkpoint to resume: pass those flags or another --out")
    return None


def rng_state(generator):
    """Every RNG stream's state as tensors and plain data (numpy's MT19937 key as a tensor)."""
    numpy = np.random.get_state(legacy=False)
    numpy["state"]["key"] = torch.from_numpy(numpy["state"]["key"].astype(np.int64))
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(), "numpy": numpy, "sampler": generator.get_state()}


def set_rng_state(state, generator):
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    numpy = state["numpy"]
    if isinstance(numpy, dict):  # else an older checkpoint's tuple, the key an array already
        key = numpy["state"]["key"].numpy().astype(np.uint32)
        numpy = {**numpy, "state": {**numpy["state"], "key": key}}
    np.random.set_state(numpy)
    generator.set_state(state["sampler"])


# what the RNG and queue files of checkpoints written before they held only tensors and plain
# data also hold: numpy's key array and rollout.Rollout; torch.load(weights_only=True) rebuilds
# these types and runs nothing else
_reconstruct = np.zeros(1).__reduce__()[0]  # numpy's array rebuilder (numpy._core under numpy 2)
OLDER_FORMAT = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), rollout.Rollout, _reconstruct,
                (_reconstruct, "numpy.core.multiarray._reconstruct")]


def load_data(path, mmap=False):
    """A checkpoint's .pt file, loaded as data: tensors and plain Python values (and the types of
    OLDER_FORMAT) are rebuilt, and any other object a pickle names is refused, never run."""
    with torch.serialization.safe_globals(OLDER_FORMAT):
        return torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")


def load(checkpoint, policy, optimizer, generator, rank):
    """Restore the AdamW state (and a sharded checkpoint's weights: else they were loaded with the
    model) and this rank's RNG streams; return this rank's queue of batches sampled ahead
    (--async-lag)."""
    if json.loads((checkpoint / "trainer_state.json").read_text()).get("sharded"):
        # each rank reads its own shards
        state = {"model": get_model_state_dict(policy),
                 "optimizer": get_optimizer_state_dict(policy, optimizer)}
        dcp.load(state, checkpoint_id=checkpoint / SHARDED)
        set_model_state_dict(policy, state["model"])
        set_optimizer_state_dict(policy, optimizer, state["optimizer"])
    else:
        set_optimizer_state_dict(policy, optimizer,
                                 load_data(checkpoint / "optimizer.pt", mmap=True),
                                 options=StateDictOptions(full_state_dict=True))
    release_files(policy, optimizer)
    set_rng_state(load_data(checkpoint / f"rng_rank{rank}.pt"), generator)
    device = next(policy.parameters()).device
    queue = load_data(checkpoint / f"queue_rank{rank}.pt")
    return collections.deque(on_device(batch, device) for batch in queue)


@torch.no_grad()
def release_files(policy, optimizer):
    """Copy into memory of their own the weights and AdamW state that are still mapped from a
    checkpoint's files (safetensors' and torch.load's mmap): else a resumed run keeps the disk
    space of the checkpoint it resumed until it exits, even after --keep-last removes it. (FSDP's
    shards and what DCP reads in are copies already.)"""
    for param in unwrap(policy).parameters():
        if not isinstance(param, DTensor):
            param.data = param.data.clone()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                state[key] = value.clone()
    gc.collect()  # the loaded state dict, if a reference cycle holds it, and its mapping with it


def on_device(batch, device):
    """A batch of the --async-lag queue with its rollout's tensors on `device` (from a checkpoint:
    the rollout as its tensors by name, or an older checkpoint's rollout.Rollout)."""
    out = batch["out"]
    fields = out if isinstance(out, dict) else dataclasses.asdict(out)
    return {**batch, "out": rollout.Rollout(**{name: tensor.to(device)
                                               for name, tensor in fields.items()})}


def as_data(batch):
    """A batch of the --async-lag queue as a checkpoint holds it: the rollout as its tensors by
    name, on the CPU (so any device resumes it), and no object but plain data."""
    out = batch["out"]
    return {**batch, "out": {field.name: getattr(out, field.name).cpu()
                             for field in dataclasses.fields(out)}}


def save_run(args, step, position, world_size, policy, tokenizer, optimizer, generator, queue,
             rank, name=None):
    """train.py's save: to OUT/step_N (or OUT/NAME), with the state that --resume continues from."""
    trainer_state = {"step": step, "data_position": position, "world_size": world_size,
                     "flags": run_flags(args), "sharded": args.fsdp}
    save(args.out / (name or f"step_{step}"), policy, tokenizer, optimizer, generator, queue,
         trainer_state, rank, args.keep_last)


def save(path, policy, tokenizer, optimizer, generator, queue, trainer_state, rank, keep_last=0):
    """Write the checkpoint `path` (all ranks call this), as the module docstring says;
    trainer_state["sharded"] saves the weights and AdamW state with DCP. A disk too full for it
    stops the run in one line, before writing where the free space is short already, the previous
    checkpoint intact."""
    tmp = path.parent / f".tmp-{path.name}"
    # the weights and AdamW state, or the last checkpoint of the kind on disk (the tokenizer too)
    alike = [directory for directory in path.parent.glob("step_*" if path.name.startswith("step_")
                                                         else path.name)
             if directory.is_dir() and missing(directory) is None]
    needed = max([checkpoint_bytes(policy, optimizer, bf16_export=trainer_state.get("sharded")
                                   and path.name == "final"),
                  *(sum(file.stat().st_size for file in directory.rglob("*") if file.is_file())
                    for directory in alike)])
    short = None
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        short = no_room(path, needed, keep_last)
        if not short:
            tmp.mkdir(parents=True)
    stop_if_any_rank(short)
    error = None
    try:
        write_files(tmp, path.name, policy, tokenizer, optimizer, generator, queue,
                    trainer_state, rank)
    except Exception as caught:  # torch.save's zip writer says "unexpected pos", not ENOSPC
        if shutil.disk_usage(path.parent).free >= FULL and "No space left" not in str(caught):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        error = no_room(path, needed, keep_last, failed=True)
    stop_if_any_rank(error)  # and every rank's files are written
    if rank == 0:
        # every file on disk, then the folders, before the mark of a complete checkpoint
        sync_files(*(file for file in tmp.rglob("*") if file.is_file()))
        for folder in (*(folder for folder in tmp.rglob("*") if folder.is_dir()), tmp):
            sync_directory(folder)
        write_durably(tmp / "trainer_state.json",
                      (json.dumps(trainer_state, indent=2) + "\n").encode())
        replace(path, tmp)
        if keep_last and path.name.startswith("step_"):
            rotate(path.parent, keep_last)
    barrier()


def write_files(tmp, name, policy, tokenizer, optimizer, generator, queue, trainer_state, rank):
    """Every rank's files of the checkpoint NAME into `tmp`, each rank's synced."""
    # collectives on every rank: DCP writes each rank's shards; a full state dict gathers them
    # onto rank 0's CPU
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if trainer_state.get("sharded"):
        dcp.save({"model": get_model_state_dict(policy),
                  "optimizer": get_optimizer_state_dict(policy, optimizer)},
                 checkpoint_id=tmp / SHARDED)
    weights = (get_model_state_dict(policy, options=full)
               if name == "final" or not trainer_state.get("sharded") else None)
    optimizer_state = (None if trainer_state.get("sharded")
                       else get_optimizer_state_dict(policy, optimizer, options=full))
    torch.save(rng_state(generator), tmp / f"rng_rank{rank}.pt")
    # sampled ahead, not yet trained on; on the CPU, so any device can resume it
    torch.save([as_data(batch) for batch in queue], tmp / f"queue_rank{rank}.pt")
    # each rank syncs its own files (on NFS only the writer's host can); DCP synced its shards
    sync_files(tmp / f"rng_rank{rank}.pt", tmp / f"queue_rank{rank}.pt")
    if rank == 0:
        if weights is None:
            unwrap(policy).config.save_pretrained(tmp)
        elif trainer_state.get("sharded"):  # final/: the fp32 weights are in sharded/
            export_bf16(unwrap(policy), tmp, weights)
        else:
            unwrap(policy).save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")


FULL = 16 * 2**20  # a write that failed with less free space than this failed for want of it


def checkpoint_bytes(policy, optimizer, bf16_export):
    """About the bytes of one checkpoint: the fp32 weights, the AdamW state and, for an FSDP run's
    final/, the bf16 export (the tokenizer, RNG states and queue are small beside them)."""
    weights = sum(p.numel() * p.element_size() for p in unwrap(policy).parameters())
    adam = sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))
    return weights + adam + (weights // 2 if bf16_export else 0)


def no_room(path, needed, keep_last, failed=False):
    """The one-line message of a disk too full to save `path`, or None where there is room."""
    free = shutil.disk_usage(path.parent).free
    if free >= needed and not failed:
        return None
    held = (f"with --keep-last {keep_last} the folder holds {keep_last + 1} checkpoints while "
            f"one is saved, the new one written before the oldest goes" if keep_last else
            "without --keep-last every step_N stays")
    # a write that ran out of room needed more than the room it had, whatever the estimate says
    room = (f"it needs more than the {free:,} bytes free (estimated at {needed:,})" if failed
            else f"it needs about {needed:,} bytes, {free:,} are free")
    return (f"no space left on the disk of {path.parent} to save {path.name}: {room} ({held}); "
            f"the previous checkpoint, if any, is intact: free space, then --resume")


def export_bf16(model, directory, weights):
    """The gathered weights as a bf16 Hugging Face checkpoint (config.json says bfloat16), as models
    are released and vLLM serves them: half the size of the fp32 master weights."""
    model.save_pretrained(directory, state_dict={
        name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        for name, tensor in weights.items()})
    # save_pretrained writes the fp32 model's dtype: say what the file holds
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2)
                                           + "\n")


def rotate(out, keep_last):
    """Remove the complete step_N checkpoints older than the keep_last newest (final/ stays)."""
    steps = sorted((d for d in out.glob("step_*") if d.is_dir() and missing(d) is None),
                   key=step_of)
    for old in steps[:-keep_last]:
        retire(old)


def start_log(args, start_step, resumed):
    """OUT/config.json and OUT/metrics.jsonl (rank 0 only), neither ever destroyed: metrics.jsonl is
    only appended to, but a resume from step N drops the rows a killed run logged after N (it logs
    them again) by writing the rows it keeps to a new file renamed over the old one, so a kill
    keeps one or the other whole; a torn last line (a kill mid-write) goes too. config.json is
    written once; a resume that changes a flag (--steps, ...) keeps the previous file beside it as
    config-until-stepN.json and says so."""
    args.out.mkdir(parents=True, exist_ok=True)
    write_config(args, start_step)
    metrics = args.out / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True) if metrics.exists() else []
    keep = [line for line, row in logged_rows(metrics) if row.get("step", 0) <= start_step]
    if keep != lines or not metrics.exists():
        write_durably(metrics, b"".join(keep))
    return metrics


def logged_rows(metrics):
    """The rows of metrics.jsonl as (line, row) pairs, each whole line parsed (a torn last line, a
    kill mid-write, is left out); [] where there is no file. A line that is not a row (a JSON
    object, its step an integer) raises ValueError naming the file and the line's number."""
    lines = metrics.read_bytes().splitlines(keepends=True) if metrics.is_file() else []
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.endswith(b"\n"):
            break  # the last line, torn
        try:
            row = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{metrics} line {number} is not JSON ({one_line(error)})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
            raise ValueError(f"{metrics} line {number} is not a row of metrics (a JSON object "
                             f"with an integer step)")
        rows.append((line, row))
    return rows


def log_row(metrics, row):
    """Append one row to metrics.jsonl, on disk before the next step (a crash keeps it)."""
    with open(metrics, "a") as file:
        file.write(json.dumps(row) + "\n")
        file.flush()
        os.fsync(file.fileno())


def run_config(args):
    """The flags as config.json holds them (paths as strings)."""
    return {k: str(v) if isinstance(v, os.PathLike) else v for k, v in vars(args).items()}


def write_config(args, start_step):
    """OUT/config.json: the flags. Never replaced silently: the same flags (but --resume) leave it
    as it is; others keep the old one as config-until-stepN.json, named in a line."""
    path, config = args.out / "config.json", run_config(args)
    if path.exists():
        old = json.loads(path.read_text())
        changed = [f"--{k.replace('_', '-')}: {old.get(k)} -> {config.get(k)}"
                   for k in sorted(old.keys() | config.keys())
                   if k not in ("resume", "out") and old.get(k) != config.get(k)]
        if not changed:
            return
        kept = args.out / f"config-until-step{start_step}.json"
        number = 1
        while kept.exists():
            number += 1
            kept = args.out / f"config-until-step{start_step}-{number}.json"
        write_durably(kept, path.read_bytes())
        print(f"config.json: {'; '.join(changed)} (the previous flags kept in {kept})")
    write_durably(path, (json.dumps(config, indent=2) + "\n").encode())


def write_durably(path, content):
    """Write `path` whole or not at all, on disk when this returns: a new file, fsynced, renamed
    over it, the folder fsynced."""
    tmp = path.parent / f".tmp-{path.name}"
    with open(tmp, "wb") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    sync_directory(path.parent)


def sync_files(*paths):
    """fsync files: their bytes on disk, not only in the page cache, when this returns."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def sync_directory(directory):
    """fsync a folder: its entries (files created, renamed or removed) survive a crash."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
