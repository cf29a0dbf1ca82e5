"""Checkpoints and runs that never mix: what train.py writes to --out and how --resume continues it.

A checkpoint OUT/step_N (or OUT/final) holds the policy's weights as safetensors (loadable by
from_pretrained, vLLM, lm-eval), the tokenizer, the AdamW state, every rank's RNG state and queue
of batches sampled ahead (--async-lag), and trainer_state.json (steps done, prompts consumed, world
size, the run-defining flags). It is written to a temporary directory and renamed, so a killed save
leaves no checkpoint behind, and a resumed run continues bit for bit.

Runs never mix: a new run needs an empty --out; --resume takes the newest complete checkpoint and
refuses one written with other run-defining flags (naming them) or by another number of ranks.
"""
import collections
import json
import os
import random
import shutil

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from runtime import barrier, fail, stop_if_any_rank, unwrap

# flags that do not change what a run computes (the gradient does not depend on the micro-batch, the
# sharding or recomputation); every other flag must match the checkpoint's for --resume
RESUMABLE_CHANGES = {"out", "resume", "steps", "save_every", "eval_every", "eval_tasks",
                     "eval_limit", "micro_batch", "grad_checkpointing", "fsdp", "max_bad_steps"}


def run_flags(args):
    """The flags that define a run, as stored in its checkpoints."""
    return {k: v for k, v in vars(args).items() if k not in RESUMABLE_CHANGES}


def flag_changes(saved, args):
    """The flags a resumed run sets differently from the checkpoint's, as 'name: old -> new'
    strings."""
    now = run_flags(args)
    return [f"--{k.replace('_', '-')}: {saved.get(k)} -> {now.get(k)}"
            for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]


def latest(out):
    """The complete checkpoint (OUT/step_N or OUT/final) with the most steps; a killed save's
    .tmp-* is none."""
    done = [p.parent for p in out.glob("*/trainer_state.json")
            if not p.parent.name.startswith(".tmp-")]
    return max(done, key=lambda d: json.loads((d / "trainer_state.json").read_text())["step"],
               default=None)


def open_run(args, rank, world_size):
    """(checkpoint to resume or None, its trainer_state or {}), after the checks that keep runs
    apart. Every rank calls this: rank 0 looks at --out before anyone writes to it."""
    stop_if_any_rank(f"{args.out} is not empty: pass --resume to continue that run, or another "
                     f"--out" if rank == 0 and not args.resume and args.out.is_dir()
                     and any(args.out.iterdir()) else None)
    checkpoint = latest(args.out) if args.resume else None
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
    stop_if_any_rank(f"{checkpoint / f'rng_rank{rank}.pt'} is missing: the checkpoint is incomplete"
                     if not (checkpoint / f"rng_rank{rank}.pt").exists() else None)
    return checkpoint, trainer_state


def rng_state(generator):
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(), "numpy": np.random.get_state(),
            "sampler": generator.get_state()}


def set_rng_state(state, generator):
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    generator.set_state(state["sampler"])


def load(checkpoint, policy, optimizer, generator, rank):
    """Restore the AdamW state and this rank's RNG streams (the weights were loaded with the
    model); return this rank's queue of batches sampled ahead (--async-lag)."""
    set_optimizer_state_dict(policy, optimizer, torch.load(checkpoint / "optimizer.pt", mmap=True),
                             options=StateDictOptions(full_state_dict=True))
    set_rng_state(torch.load(checkpoint / f"rng_rank{rank}.pt", weights_only=False), generator)
    queue = checkpoint / f"queue_rank{rank}.pt"
    return collections.deque(torch.load(queue, weights_only=False) if queue.exists() else [])


def save(path, policy, tokenizer, optimizer, generator, queue, trainer_state, rank):
    """Write the checkpoint `path` (all ranks call this): to path/../.tmp-NAME, then renamed to
    path."""
    tmp = path.parent / f".tmp-{path.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # collectives on every rank: under FSDP they gather the shards (onto rank 0's CPU)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(policy, options=options)
    optimizer_state = get_optimizer_state_dict(policy, optimizer, options=options)
    torch.save(rng_state(generator), tmp / f"rng_rank{rank}.pt")
    torch.save(list(queue), tmp / f"queue_rank{rank}.pt")  # sampled ahead, not yet trained on
    if rank == 0:
        unwrap(policy).save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    barrier()


def start_log(args, start_step, resumed):
    """Write OUT/config.json and keep OUT/metrics.jsonl's steps up to the checkpoint (rank 0 only):
    a resumed run forgets the steps logged after its checkpoint, which it does again."""
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in vars(args).items()}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    metrics = args.out / "metrics.jsonl"
    rows = metrics.read_text().splitlines() if metrics.exists() and resumed else []
    metrics.write_text("".join(r + "\n" for r in rows
                               if json.loads(r).get("step", 0) <= start_step))
    return metrics
