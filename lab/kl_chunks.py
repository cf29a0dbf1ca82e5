"""The chunks of lab/kl_gradients.py: how a run is saved, resumed and pooled.

A distance's groups are sampled in chunks of --chunk-groups, each seeded by (--seed, distance,
chunk), so any chunk can be redone alone. A chunk is saved as chunk_NNNNN.pt (the per-group gradient
rows, the per-sequence and per-prefix records) and then chunk_NNNNN.json, written last: its record
(seconds, seed, the run's key). The key is what chunks must share to be pooled: pi's hash, the
machine (its CPU and flags, its GPU) and the flags that change a sample; `saved_chunks` refuses a
directory that mixes keys, so another pi or machine is never pooled.
"""
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import torch


def chunk_seed(seed, label, chunk):
    """A chunk's seed, from (--seed, distance, chunk): chunks are independent and each one can be
    redone alone."""
    return int(hashlib.sha256(f"{seed}/{label}/{chunk}".encode()).hexdigest()[:15], 16)


def policy_hash(model):
    """sha256 of the parameters' bytes, by name (16 hex digits): which pi was measured."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


KEY_FLAGS = ("model", "group_size", "chunk_groups", "prompts_per_batch", "batch_groups",
             "max_new_tokens", "layers", "coords", "basis", "seed", "device")


def run_key(args, pi_hash, machine):
    """What chunks must share to be pooled: pi, the machine, the flags that change a sample."""
    flags = {flag: getattr(args, flag) for flag in KEY_FLAGS}
    if args.grad_tail:  # only where set: the chunks saved before the flag keep their key
        flags["grad_tail"] = args.grad_tail
    return {"pi": pi_hash, "cpu": machine["cpu"], "cpu_flags": machine["cpu_flags"],
            "gpu": machine["gpu"], "flags": flags}


def saved_chunks(directory, key=None):
    """{chunk: its JSON record} saved in `directory`; refuses chunks whose key is not `key` (or,
    with no key, not all the same): another pi or machine is never pooled."""
    records = {int(p.stem.split("_")[1]): json.loads(p.read_text())
               for p in sorted(Path(directory).glob("chunk_*.json"))}
    keys = {json.dumps(r["key"], sort_keys=True) for r in records.values()}
    if key is not None:
        keys.add(json.dumps(key, sort_keys=True))
    if len(keys) > 1:
        raise SystemExit(f"{directory} holds chunks of another pi, machine or flags "
                         f"({len(keys)} keys): they are never pooled; use another --chunks")
    return records


def save_chunk(directory, chunk, payload, record):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"chunk_{chunk:05d}"
    torch.save(payload, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path.with_suffix(".pt"))
    path.with_suffix(".json").write_text(json.dumps(record, indent=1))  # written last: complete


def load_distance(label, args, default_rows):
    """The saved chunks of one distance (one key: saved_chunks refuses a mix), pooled:
    ({row: (n, m)}, seqs, prefixes, the first chunk's record, seconds, chunks)."""
    directory = Path(args.chunks) / re.sub(r"\W+", "_", label)
    records = saved_chunks(directory)
    wanted = [c for c in sorted(records) if c < math.ceil(args.groups / args.chunk_groups)]
    if not wanted:
        raise SystemExit(f"no chunks saved in {directory}")
    X, seqs, prefixes = None, [], {}
    for i, chunk in enumerate(wanted):  # filled in place: one copy of the gradients in memory
        part = torch.load(directory / f"chunk_{chunk:05d}.pt", weights_only=False)
        units = len(part["X"])
        if X is None:
            X = torch.empty(len(wanted) * units, *part["X"].shape[1:])
        X[i * units:(i + 1) * units] = part["X"]
        seqs.append(part["seqs"])
        for key, values in part["prefixes"].items():
            prefixes.setdefault(key, []).append(values)
        del part
    # a per-sequence record that older chunks lack (K3's tail) is NaN there: rows stay aligned
    seqs = {key: np.concatenate([c.get(key, np.full(len(c["kl"]), np.nan)) for c in seqs])
            for key in dict.fromkeys(k for c in seqs for k in c)}
    prefixes = {key: np.concatenate(v) for key, v in prefixes.items()}
    seconds = sum(records[c]["seconds"] for c in wanted)
    names = records[wanted[0]].get("rows", default_rows)  # one key, so one list of rows
    return ({name: X[:, i] for i, name in enumerate(names)}, seqs, prefixes, records[wanted[0]],
            seconds, len(wanted))
