"""Evaluation: mean@k accuracy on verifiable tasks, the paper's protocol (sec. 4.1, app. B).

The paper samples k = 32 answers per problem at temperature 1.0, top-p 1.0, with the default chat
template, scores each with the verifiable reward R = 1[Extract(y) = y*] (sec. 2), and reports
mean@32 on MATH500, MATH^2 and the MMLU college physics/chemistry/biology subsets (Fig. 5-6),
"across 3 seeds" (sec. 4.1): one run here is one seed (--seed), three runs make the paper's.
During training it reports Pass@1 on a held-out set (Fig. 2-4). Both are `evaluate` below;
`train.py --eval-every` calls it with samples=1. App. B also lists vLLM's min_p = 1.0, which read
literally keeps only the most likely token (greedy decoding); we apply no min-p filter, as its
temperature 1.0 and 32 samples per problem suggest the paper did not either (our inference).

Metrics, for n problems with k samples each, c_i of which are correct on problem i
(correct: reward == 1):
- accuracy = mean@k = (1/n) sum_i c_i / k, the paper's metric.
- stderr = std_i(c_i / k) / sqrt(n), sample std (ddof=1) over problems: the standard error of mean@k
  as an estimate of the expected accuracy on problems drawn like these (0.0 when n = 1, where it is
  undefined).
- pass@1 = mean@k: c_i / k is the unbiased estimate of the probability that one sample is correct,
  so with k samples pass@1 is mean@k (with k = 1 it is the plain fraction of problems solved).
- pass@m for m = 2, 4, 8, ..., and m = k: the unbiased estimator of Chen et al. (2021),
  pass@m = (1/n) sum_i [1 - C(k - c_i, m) / C(k, m)], the chance that at least one of m samples is
  correct.
- by_subject / by_level: {value: {accuracy, stderr, n}} over the problems carrying that field.

Outputs: OUT/eval.json, {task: {accuracy, stderr, n, samples, pass@1, pass@2, ..., by_subject?,
by_level?}}, and OUT/completions.jsonl, one line per sample (task, index, sample, problem, answer,
completion, extracted, reward, subject/level), so any score can be audited:
data.score(example, completion) reproduces `reward`, and `summarize` of a task's lines reproduces
its eval.json entry.

Sharding: the (problem, sample) pairs are laid out in a fixed order and cut into batches of
`batch_size` sequences; batch b is sampled with its own generator seeded from (seed, b) and runs on
rank b % world_size. One process and torchrun with any number of ranks thus run the very same
generate calls and return the same completions and numbers (which do depend on seed and batch_size).
On a GPU the model's q/k/v and gate/up weights are joined (cuda_decode.fuse_projections), as
train.py's sampler has them: one GEMM each a decode step.

    python eval.py --model runs/a/final --tasks math500,mmlu-college-physics --samples 32 \
        --out runs/a
    torchrun --nproc_per_node=8 eval.py --model Qwen/Qwen2.5-7B --tasks math500 --dtype bfloat16 \
        --out DIR
"""
import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data
from systems import runtime
from reward import extract_boxed
from systems.model import load_model, load_tokenizer, stop_token_ids
from rollout import generate
from systems.cuda_decode import attention_choice, fuse_projections

parser = argparse.ArgumentParser(description="mean@k evaluation of a model on verifiable tasks")
parser.add_argument("--model", required=True,
                    help="a save_pretrained directory, a hub id, or smollm2-135m")
parser.add_argument("--tasks", required=True,
                    help="comma-separated data.py task names or .jsonl paths")
parser.add_argument("--samples", type=int, default=32,
                    help="samples per problem, k of mean@k (paper: 32)")
parser.add_argument("--out", required=True, help="directory for eval.json and completions.jsonl")
parser.add_argument("--limit", type=int, default=None,
                    help="N problems per task (a fixed subset, data.load_task)")
parser.add_argument("--max-new-tokens", type=int, default=1024,
                    help="response length cap (paper: 1024)")
parser.add_argument("--no-chat-template", action="store_true",
                    help="plain-text prompts, no chat template")
parser.add_argument("--batch-size", type=int, default=16, help="sequences per generate call")
parser.add_argument("--seed", type=int, default=0,
                    help="sampling seed, 0-4095: each seed its own draws (the problems do not "
                         "depend on it)")
parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="model dtype; auto = bf16 where the device computes it natively "
                         "(systems/runtime.py)")

BREAKDOWNS = ("subject", "level")  # example fields that get a per-value breakdown


def pass_at_k(n, c, k):
    """Chen et al. (2021): unbiased estimate of P(at least one of k samples is correct), from
    n samples, c correct."""
    if n - c < k:
        return 1.0
    # pass@k = 1 - C(n - c, k) / C(n, k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_at_k(correct):
    """accuracy (mean@k) and its standard error over problems, from a (problems, k) array of 0/1."""
    per_problem = correct.mean(axis=1)  # c_i / k
    n = len(per_problem)
    stderr = float(per_problem.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return {"accuracy": float(per_problem.mean()), "stderr": stderr, "n": n}


def summarize(records):
    """The metrics of one task from its completion records (every sample of every problem)."""
    samples = defaultdict(list)  # problem index -> its records
    for record in records:
        samples[record["index"]].append(record)
    problems = [samples[i] for i in sorted(samples)]
    correct = np.array([[r["reward"] >= 1.0 for r in rows] for rows in problems], dtype=np.float64)
    k = correct.shape[1]
    metrics = mean_at_k(correct)
    metrics["samples"] = k
    metrics["pass@1"] = metrics["accuracy"]
    for m in sorted({2 ** p for p in range(1, k.bit_length())} | {k} - {1}):  # 2, 4, 8, ..., and k
        metrics[f"pass@{m}"] = float(np.mean([pass_at_k(k, int(c), m)
                                              for c in correct.sum(axis=1)]))
    for key in BREAKDOWNS:
        values = sorted({str(rows[0][key]) for rows in problems if key in rows[0]})
        if values:
            metrics[f"by_{key}"] = {
                value: mean_at_k(correct[[key in rows[0] and str(rows[0][key]) == value
                                          for rows in problems]])
                for value in values
            }
    return metrics


def completion_record(example, index, sample, completion):
    """One line of completions.jsonl: enough to audit the score
    (data.score(example, completion) == reward)."""
    record = {"index": index, "sample": sample, "problem": example["problem"],
              "answer": example["answer"], "completion": completion,
              "extracted": extract_boxed(completion), "reward": data.score(example, completion)}
    record.update({key: example[key] for key in BREAKDOWNS if key in example})
    return record


def batch_seed(seed, b):
    """The seed of batch b's own stream under --seed `seed`: b + seed * 2**20, which every
    generator keeps whole (the CPU's mt19937 keeps only the low 32 bits, so the old
    seed * 2**32 + b gave every seed the same draws). Seed 0 is the old stream, b; seeds differ
    for up to 2**20 batches and 4,096 seeds."""
    if not 0 <= seed < 2**12 or b >= 2**20:
        raise ValueError(f"eval seeds are 0-4095 and batches fewer than 2**20, got seed {seed}, "
                         f"batch {b}")
    return b + seed * 2**20


def evaluate(model, tokenizer, examples, samples=1, max_new_tokens=1024, temperature=1.0, top_p=1.0,
             batch_size=16, chat_template=True, seed=0, rank=0, world_size=1, generate_rows=0,
             decoder=None):
    """Sample `samples` completions per example, score them, return (metrics, completion records).
    `generate_rows`: rows one generate call decodes at a time, the same samples (0: as many as fit,
    runtime.rows_that_fit, a whole batch on a CPU; train.py's --generate-rows). `decoder`:
    rollout.generate's (None: the device's, runtime.sampler_decoder; train.py passes its own).

    Every rank must call this with the same arguments (it all-gathers); all ranks return the same
    result. Pass a plain model (model.module under DDP). chat_template=False: plain
    "Question/Answer" prompts (--no-chat-template); responses stop at model.stop_token_ids either
    way (EOS and the end of turn).
    """
    if not examples:
        raise ValueError("evaluate: no examples (is --limit 0 or the task file empty?)")
    if world_size > 1 and not dist.is_initialized():
        raise RuntimeError("evaluate(world_size > 1) needs torch.distributed initialized "
                           "(run under torchrun)")
    prompts = [data.prompt_ids(tokenizer, example, chat_template) for example in examples]
    # every (problem, sample) pair in a fixed order, cut into batches of batch_size sequences
    pairs = [(i, j) for i in range(len(examples)) for j in range(samples)]
    batches = [pairs[start:start + batch_size] for start in range(0, len(pairs), batch_size)]
    device = next(model.parameters()).device
    decoder = decoder or runtime.sampler_decoder(device)
    # EOS and the template's end of turn, plain prompts too
    eos_token_id = stop_token_ids(model, tokenizer)
    records = []
    for b in tqdm(range(rank, len(batches), world_size), desc="eval", disable=rank != 0,
                  leave=False):
        generator = torch.Generator(device=device).manual_seed(batch_seed(seed, b))
        batch_prompts = [prompts[i] for i, _ in batches[b]]
        max_rows = generate_rows or runtime.rows_that_fit(model, batch_prompts, max_new_tokens)
        with torch.no_grad():
            rollout = generate(model, batch_prompts, max_new_tokens, temperature, top_p,
                               eos_token_id, generator, max_rows=max_rows, decoder=decoder)
        for (i, j), ids in zip(batches[b], rollout.response_ids):
            completion = tokenizer.decode(ids, skip_special_tokens=True)
            records.append(completion_record(examples[i], i, j, completion))
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, records)
        records = [record for part in gathered for record in part]
    records.sort(key=lambda record: (record["index"], record["sample"]))
    return summarize(records), records


def pass1_row(args, sampler, decoder, tokenizer, eval_sets, batch_size, rank, world_size):
    """train.py --eval-every: Pass@1 on each --eval-tasks set (`evaluate`, one sample each) with
    train.py's sampler and decoder, as metrics.jsonl keys."""
    row = {}
    for name, examples in eval_sets.items():
        result, _ = evaluate(sampler, tokenizer, examples, samples=1,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, batch_size=batch_size, seed=args.seed, rank=rank,
                             world_size=world_size, generate_rows=args.generate_rows,
                             decoder=decoder)
        row.update({f"eval/{Path(name).stem}/{key}": result[key]
                    for key in ("accuracy", "stderr", "pass@1", "n")})
    return row


def main(argv=None):
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch_size < 1:
        parser.error("--samples and --batch-size must be at least 1")
    if not 0 <= args.seed < 2**12:
        parser.error(f"--seed must be 0-4095, got {args.seed}")
    rank, world_size, device, dtype = runtime.start(args.dtype)
    try:  # problems first (fast, and they name bad task names), then the model
        tasks = {name: data.load_task(name, split="test", limit=args.limit)
                 for name in args.tasks.split(",")}
        tokenizer = load_tokenizer(args.model)
        model = load_model(args.model, dtype=dtype).to(device)
    except (ValueError, OSError, RuntimeError) as error:
        parser.error((str(error) or type(error).__name__).splitlines()[0])

    if device.type in runtime.FUSED_PROJECTIONS_ON:  # one GEMM for q/k/v, one for gate/up
        fuse_projections(model)
    if device.type == "cuda" and rank == 0:  # what generate will attend with, by its own rule
        print(attention_choice(device, next(model.parameters()).dtype)[1])
    out = Path(args.out)
    results, completions = {}, []
    for name, examples in tasks.items():
        metrics, records = evaluate(model, tokenizer, examples, samples=args.samples,
                                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                    chat_template=not args.no_chat_template, seed=args.seed,
                                    rank=rank, world_size=world_size)
        results[name] = metrics
        completions += [{"task": name, **record} for record in records]
        # rewrite both files after each task, so a long run keeps what it has finished
        if rank == 0:
            print(f"{name:32s} mean@{args.samples} {metrics['accuracy']:.4f} "
                  f"± {metrics['stderr']:.4f}  pass@1 {metrics['pass@1']:.4f}  n={metrics['n']}")
            for key in BREAKDOWNS:
                for value, sub in metrics.get(f"by_{key}", {}).items():
                    print(f"  {key} {value:26s} {sub['accuracy']:.4f} ± {sub['stderr']:.4f}  "
                          f"n={sub['n']}")
            out.mkdir(parents=True, exist_ok=True)
            (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
            with open(out / "completions.jsonl", "w") as file:
                file.writelines(json.dumps(record) + "\n" for record in completions)
    runtime.finish()


if __name__ == "__main__":
    main()
