"""On-policy RLOO fine-tuning of an LLM with a KL penalty (paper sec. 2-4, app. B).

The paper's sec. 4.1 setup, with verl's defaults where the paper is silent (AdamW, weight decay
0.01, gradient clipping at 1.0, constant learning rate, PPO clip 0.2). One step of `main`:
  1. rollout    --group-size completions for each of --prompts-per-step prompts, from the policy
  2. reward     each completion's verifiable reward R in [0, 1] (data.score, reward.py)
  3. log-probs  log pi(y_t | x, y<t) of every sampled token under the policy (no grad) and the
                frozen reference pi_ref, the initial policy (logprobs.py: each group is one
                packed sequence)
  4. shape      return_i = R_i - beta * sum_t sg[KL_t] if --place is reward/both (eq. 7), else R_i
  5. advantage  RLOO: A_i = return_i - mean of the other G - 1 returns of the same prompt
  6. loss       PPO-clip surrogate (eq. 4) + beta * sum_t KL_t when --place is loss or both (eq. 9),
                both summed over the response tokens of the (mini)batch and divided by their count
                `num_tokens`
  7. step       one AdamW step per minibatch: --minibatches 1 is strictly on-policy (the ratio is
                exactly 1), 4 the paper's off-policy variant (Fig. 2 centre)
--place none (or --beta 0) never loads the reference.

Precision: fp32 master weights and AdamW state. The no-grad log-probs that feed the KL and the ratio
are fp32 (--logprob-dtype; on CUDA fp32 from bf16 tensor cores, systems/split_matmul.py): in bf16 their
rounding alone puts a floor under every KL (docs/precision.md). The gradient pass runs in bf16
autocast where the device has it and takes its values from the fp32 pass,
logp + sg[logp_fp32 - logp], so only the gradient's direction carries bf16 rounding. Sampling uses a
bf16 copy of the weights (runtime.make_sampler), refreshed after every step; `mismatch_kl` measures
the gap between sampler and trainer, so "on-policy" is measured, not assumed. Distributed: torchrun
gives DDP (gloo on CPU, NCCL on CUDA), --fsdp FSDP2. Each rank samples its share of the prompts;
`num_tokens` counts every rank's tokens, so a step's gradient is the same for any --micro-batch and
any number of ranks (test_train.py checks both to 1e-5).
Checkpoints and --resume: systems/checkpoint.py.

    python train.py --kl k1 --place reward          # SmolLM2-135M-Instruct on arith, on a CPU
    torchrun --nproc_per_node=8 train.py --kl k3 --place loss --fsdp --model Qwen/Qwen2.5-7B ...
"""
import argparse
import collections
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import advantage
from systems import checkpoint
from systems import cuda_decode
import data
import kl
import logprobs
from systems import report
import rollout
from systems import runtime
from systems.hub import HubUnreachable
from systems.model import load_model, load_tokenizer, stop_token_ids

ADVANTAGES = {"rloo": advantage.rloo, "drgrpo": advantage.group_mean,
              "grpo": advantage.group_normalized}

parser = argparse.ArgumentParser(description="KL-regularized RLOO fine-tuning of an LLM",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
group = parser.add_argument_group("KL regularization (sec. 3, Table 1)")
group.add_argument("--kl", required=True, choices=kl.KINDS,
                   help="token-level estimator: k1 = log pi/pi_ref (eq. 11), "
                        "k2 = (log pi/pi_ref)^2 / 2, k3 = r - 1 - log r with r = pi_ref/pi "
                        "(eq. 14)")
group.add_argument("--place", required=True, choices=kl.PLACES,
                   help="where the estimate goes: the reward (eq. 7), the loss (eq. 9), both, "
                        "none; weighted = w sg[K1] in the loss, w = prod_t pi/mu: unbiased "
                        "off-policy")
group.add_argument("--beta", type=float, default=0.05,
                   help="KL coefficient (paper: 0.05, 0.1, 0.3, 1; 0.005 in the asynchronous runs "
                        "of sec. 4.2)")
group.add_argument("--kl-clamp", default="none", choices=kl.CLAMPS,
                   help="none = the exact estimator; verl = verl's low_var_kl bounds on K3 "
                        "(log r in [-20, 20], K3 in [-10, 10]); the paper ran verl, so its K3 runs "
                        "likely had them (our inference: the paper does not say)")
group = parser.add_argument_group("RLOO and PPO (sec. 2, 4.1)")
group.add_argument("--group-size", type=int, default=4,
                   help="completions per prompt, the RLOO group (paper: 5; sec. 4.1's '5 rollouts "
                        "per prompt (i.e. group size G = 4)', app. B's K = 5)")
group.add_argument("--prompts-per-step", type=int, default=8,
                   help="prompts per step over all ranks (paper: 256)")
group.add_argument("--minibatches", type=int, default=1,
                   help="optimizer steps per sampled batch: 1 = on-policy (paper), "
                        "4 = off-policy (Fig. 2)")
group.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (paper: 1e-6)")
group.add_argument("--clip-eps", type=float, default=0.2,
                   help="PPO clip range of the ratio (eq. 4; verl's default)")
group.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the global gradient norm to this")
group.add_argument("--steps", type=int, default=20,
                   help="training steps, one sampled batch each (paper: 250)")
group.add_argument("--advantage", default="rloo", choices=ADVANTAGES,
                   help="rloo = leave-one-out baseline (sec. 4.1); drgrpo = group mean (Dr. GRPO, "
                        "the asynchronous runs of sec. 4.2); grpo = group mean and std")
group = parser.add_argument_group("asynchronous RL (sec. 4.2)")
group.add_argument("--async-lag", type=int, default=0,
                   help="train on batches sampled N steps earlier, by the weights of N batches ago "
                        "(prime-rl's async level, always its most; with --minibatches k that is "
                        "N * k updates; paper: 10); 0 = on-policy")
group.add_argument("--behaviour", default="sampler", choices=("sampler", "trainer"),
                   help="mu of every importance ratio (--minibatches > 1, --async-lag, --place "
                        "weighted): sampler = the log-probs the sampler drew with, trainer = the "
                        "fp32 trainer's at the weights that sampled (lag 0 only)")
group.add_argument("--loss", default="ppo", choices=("ppo", "truncated"),
                   help="ppo = PPO clip (eq. 4); truncated = prime-rl's -min(w, C) A per token, "
                        "w against the log-probs of the sampler")
group.add_argument("--is-cap", type=float, default=8.0,
                   help="C of --loss truncated (prime-rl: 8) and of --is-weight truncated")
group.add_argument("--is-weight", default="exact",
                   choices=("exact", "truncated", "self-normalized"),
                   help="w of --place weighted: exact = prod_t pi/mu (unbiased; capped at e^30, "
                        "past which an update overflows), truncated = min(w, --is-cap), "
                        "self-normalized = w / mean w over the minibatch (both biased, less "
                        "variance: docs/toy.md)")
group = parser.add_argument_group("sampling")
group.add_argument("--max-new-tokens", type=int, default=40,
                   help="response length cap (paper: 1024)")
group.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; the trainer's log-probs use it too (paper: 1.0)")
group.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: training takes only 1.0, the distribution its log-probs "
                        "are under")
group.add_argument("--compile-sampler", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the fixed-shape decode step (CUDA's loop) with torch.compile, "
                        "Inductor fusing each layer's small kernels (cuda_decode.compiled_step; "
                        "about 2 minutes at the first step at 7B); default: on the devices "
                        "runtime.COMPILED_SAMPLER_ON names (none until a GPU has timed it)")
group.add_argument("--generate-rows", type=int, default=0,
                   help="rows one generate call decodes at a time, sampling and --eval-every's "
                        "evaluation, the same samples (0 = auto: as many as fit their KV cache in "
                        "half the GPU memory free; all on a CPU)")
group = parser.add_argument_group("model and data")
group.add_argument("--model", default="smollm2-135m",
                   help="policy and reference: a hub id, a save_pretrained directory, "
                        "or smollm2-135m")
group.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own code from the hub")
group.add_argument("--task", default="arith",
                   help="training task: a data.py task (math, countdown, arith...) "
                        "or a .jsonl file")
group.add_argument("--eval-every", type=int, default=0,
                   help="evaluate (Pass@1, eval.py) every N steps; 0 = never")
group.add_argument("--eval-tasks", default=None,
                   help="comma-separated data.py tasks to evaluate on, test split "
                        "(default: the training task)")
group.add_argument("--eval-limit", type=int, default=None,
                   help="evaluate on N problems of each task")
group.add_argument("--seed", type=int, default=0, help="seeds the prompt order and the sampler")
group = parser.add_argument_group("output")
group.add_argument("--out", default=None,
                   help="output directory, new or empty unless --resume "
                        "(default: runs/TASK-MODEL-KL-in-PLACE-BETA-seedSEED)")
group.add_argument("--save-every", type=int, default=0,
                   help="checkpoint OUT/step_N every N steps; 0 = only OUT/final")
group.add_argument("--keep-last", type=int, default=0,
                   help="keep only the N newest OUT/step_N (0 = all); OUT/final always stays")
group.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out")
group.add_argument("--max-bad-steps", type=int, default=3,
                   help="stop after this many updates in a row with a non-finite loss or gradient")
group.add_argument("--report-to", default="none", choices=report.CHOICES,
                   help="also log metrics.jsonl's rows live to TensorBoard (event files in OUT) or "
                        "W&B (WANDB_MODE=offline: files in OUT/wandb), from rank 0 (systems/report.py)")
group = parser.add_argument_group("system")
group.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype of the sampler and the gradient pass (weights and AdamW "
                        "state stay fp32); auto = bf16 where the device has it")
group.add_argument("--logprob-dtype", default="auto",
                   choices=("auto", "float32", "bf16x6", "bfloat16"),
                   help="dtype of the log-probs that feed the KL, the ratio and the loss values: "
                        "float32 = exact, bf16x6 = fp32 from six bf16 tensor-core products "
                        "(systems/split_matmul.py), bfloat16 = the fast, noisy way; auto = float32 on a "
                        "CPU, on CUDA the pick of docs/precision.md's registered rule (bf16x6)")
group.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per forward/backward (the gradient does not depend on it; 8 "
                        "keeps the default run under 4 GiB whatever the responses' lengths)")
group.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each decoder layer's activations in the backward pass: the "
                        "same gradient, ~1 GB less memory at the defaults, no slower on a CPU "
                        "(docs/benchmarks.md)")
group.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and AdamW state over the ranks "
                        "(FSDP2, under torchrun)")


def check_flags(args, world_size):
    """The first bad flag as a one-line message, or None."""
    per_rank = args.prompts_per_step // world_size * args.group_size
    for ok, message in [
        (args.group_size >= 2, f"--group-size must be at least 2 (RLOO needs other samples), got "
                               f"{args.group_size}"),
        (args.beta >= 0, f"--beta must be >= 0, got {args.beta}"),
        (args.prompts_per_step > 0 and args.prompts_per_step % world_size == 0,
         f"--prompts-per-step ({args.prompts_per_step}) must be a positive multiple of the "
         f"{world_size} ranks"),
        (1 <= args.minibatches <= per_rank,
         f"--minibatches must be between 1 and the sequences per rank, got {args.minibatches}"),
        (args.micro_batch >= 1 and args.max_new_tokens >= 1 and args.steps >= 0 and args.lr > 0
         and args.generate_rows >= 0,
         "--micro-batch and --max-new-tokens must be >= 1, --steps and --generate-rows >= 0, "
         "--lr > 0"),
        (args.temperature > 0, "--temperature must be > 0"),
        (0 <= args.seed < 2**12, f"--seed must be 0-4095 (eval.py's seeds), got {args.seed}"),
        (args.async_lag >= 0 and args.is_cap > 0, "--async-lag must be >= 0, --is-cap > 0"),
        (args.place != "weighted" or args.kl == "k1", "--place weighted weights K1: use --kl k1"),
        (args.kl_clamp == "none" or (args.kl == "k3" and args.place in ("reward", "loss", "both")),
         "--kl-clamp verl bounds K3 in the reward or the loss only: use --kl k3 with --place "
         "reward, loss or both, or --kl-clamp none"),
        (args.behaviour == "sampler" or not args.async_lag,
         "--behaviour trainer needs --async-lag 0: the weights that sampled N steps ago are gone, "
         "the sampler's log-probs are the only record of mu"),
        (args.top_p == 1, "--top-p < 1 is for eval.py: the trainer's log-probs, ratio and KL are "
                          "under the full softmax, so they would describe another distribution "
                          "than the one sampled"),
        (args.eval_every >= 0 and args.save_every >= 0 and args.keep_last >= 0
         and args.max_bad_steps >= 1,
         "--eval-every, --save-every and --keep-last must be >= 0, --max-bad-steps >= 1"),
        (not args.fsdp or "RANK" in os.environ,
         "--fsdp needs torchrun: torchrun --nproc_per_node=N train.py"),
    ]:
        if not ok:
            return message
    return report.problem(args.report_to)  # the package, W&B's credentials: before any model loads


def prompt_batch(examples, start, count, seed):
    """Examples start, ..., start + count - 1 of an endless stream: the task reshuffled (seeded)
    every epoch."""
    n, positions = len(examples), range(start, start + count)
    orders = {epoch: np.random.default_rng([seed, epoch]).permutation(n)
              for epoch in {p // n for p in positions}}
    return [examples[orders[p // n][p % n]] for p in positions]


@torch.no_grad()
def sampler_vs_trainer(sampler_logp, logp, mask, device):
    """The sampler mu against the policy pi being trained, on mu's samples: sums over this rank of
    log mu - log pi per token (mismatch_kl), of the sequences' KL(mu || pi) estimates (K1, K3), of
    the ratio w = pi/mu and of the tokens with w outside [0.5, 2]; and the largest w, all ranks."""
    ratio = (logp - sampler_logp).exp()
    sums = {"mismatch_kl": (mask * (sampler_logp - logp)).sum().item(),
            "behaviour_kl_k1": (mask * kl.estimate(sampler_logp, logp, "k1")).sum(1).sum().item(),
            "behaviour_kl_k3": (mask * kl.estimate(sampler_logp, logp, "k3")).sum(1).sum().item(),
            "ratio": (mask * ratio).sum().item(),
            "ratio_outside": (mask * ((ratio < 0.5) | (ratio > 2))).sum().item()}
    return sums, runtime.all_reduce_max((mask * ratio).max().item(), device)


def importance_weights(log_w, device):
    """Over all ranks' sequences: the largest log w, log mean w (by logsumexp: no overflow), and
    the effective sample size of w as a fraction of n, (sum w)^2 / (n sum w^2) in (0, 1]."""
    top = runtime.all_reduce_max(log_w.max().item(), device)
    scaled = (log_w.double() - top).exp()  # in (0, 1]
    sums = runtime.all_reduce_sums({"w": scaled.sum().item(), "w2": (scaled ** 2).sum().item(),
                                    "n": len(log_w)}, device)
    return {"log_w_max": top, "log_mean_w": top + math.log(sums["w"] / sums["n"]),
            "is_ess": sums["w"] ** 2 / (sums["n"] * sums["w2"])}


def evaluate_pass1(args, sampler, tokenizer, eval_sets, batch_size, rank, world_size):
    """Pass@1 on each --eval-tasks set (eval.evaluate, one sample each), as metrics.jsonl keys."""
    from eval import evaluate  # here: only runs with --eval-every need it

    row = {}
    for name, examples in eval_sets.items():
        result, _ = evaluate(sampler, tokenizer, examples, samples=1,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, batch_size=batch_size, seed=args.seed, rank=rank,
                             world_size=world_size, generate_rows=args.generate_rows)
        row.update({f"eval/{Path(name).stem}/{key}": result[key]
                    for key in ("accuracy", "stderr", "pass@1", "n")})
    return row


def load(args, checkpoint_dir):
    """(training examples, eval sets, tokenizer, fp32 policy, stop ids), or a one-line error."""
    try:
        examples = data.load_task(args.task, split="train", seed=args.seed)
        eval_names = (args.eval_tasks or args.task).split(",") if args.eval_every else []
        eval_sets = {name: data.load_task(name, split="test", limit=args.eval_limit)
                     for name in eval_names}
        tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
        # a sharded (FSDP) step checkpoint has no full weights: checkpoint.load puts them in
        weights = (checkpoint_dir if checkpoint_dir and checkpoint.has_weights(checkpoint_dir)
                   else args.model)
        policy = load_model(str(weights), torch.float32, args.trust_remote_code)
        stop_ids = stop_token_ids(policy, tokenizer)  # EOS and the chat template's end of turn
    except (OSError, ValueError, HubUnreachable) as caught:
        return str(caught).splitlines()[0] if str(caught) else type(caught).__name__
    return examples, eval_sets, tokenizer, policy, stop_ids


@dataclass
class Batch:
    """One step's rollout, scored and log-probed: what each minibatch's update reads, a row per
    completion (each prompt's G completions contiguous: an RLOO group)."""
    prompts: list  # each row's prompt ids
    tokens: torch.Tensor  # (B, T) response ids
    mask: torch.Tensor  # (B, T) response_mask
    policy_logp: torch.Tensor  # (B, T) log pi_theta at the step's start, --logprob-dtype, no grad
    ref_logp: torch.Tensor  # (B, T) log pi_ref (policy_logp when there is no reference)
    behaviour_logp: torch.Tensor  # (B, T) log mu, the policy that sampled (--behaviour)
    advantages: torch.Tensor  # (B,) or (B, T)


def update(args, policy, optimizer, batch, minibatch, first):
    """One AdamW step on the rows `minibatch` of the step's batch: the PPO-clip (or truncated IS)
    surrogate of eq. 4 plus the KL loss of eq. 9 where --place puts it, both normalized by the
    minibatch's response tokens on all ranks. Accumulates over micro-batches (DDP reduces in the
    last one's backward). Returns ([pg_loss, kl_loss, clip_frac] summed over ranks, grad norm,
    whether the step was taken: a non-finite loss or gradient skips it)."""
    device = batch.tokens.device
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    dtype = getattr(torch, args.dtype)
    logprob_dtype = runtime.logprob_dtype(args.logprob_dtype, device)
    mask = batch.mask
    self_normalized = args.place == "weighted" and args.is_weight == "self-normalized"
    # the minibatch's log-probs in --logprob-dtype under the current weights: policy_logp until the
    # first update, then a no-grad pass of their own (only if the gradient pass runs in another
    # dtype, or the self-normalized weight needs them)
    exact_logp = batch.policy_logp[minibatch]
    if not first and (dtype != logprob_dtype or self_normalized):
        exact_logp = logprobs.no_grad_logprobs(
            policy, [batch.prompts[r] for r in minibatch], batch.tokens[minibatch],
            mask[minibatch], args.temperature, logprob_dtype, args.micro_batch)[0]
    log_mean_w = 0.0  # --is-weight self-normalized: log mean_j w_j, all ranks
    if self_normalized:
        log_mean_w = importance_weights(kl.log_importance_weights(
            exact_logp, batch.behaviour_logp[minibatch], mask[minibatch]), device)["log_mean_w"]
    # --place weighted's w: capped at e^30 (exact), or at C (truncated)
    max_log_w = math.log(args.is_cap) if args.is_weight == "truncated" else kl.MAX_LOG_W
    # num_tokens: response tokens of the minibatch on all ranks, both losses' normalizer
    num_tokens = mask[minibatch].sum()
    if dist.is_initialized():
        dist.all_reduce(num_tokens)
    micro_batches = minibatch.split(
        logprobs.micro_batch_sizes([batch.prompts[r] for r in minibatch], args.micro_batch))
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for i, rows in enumerate(micro_batches):
        # DDP all-reduces gradients in the backward of the last micro-batch only
        no_sync = isinstance(policy, DDP) and i < len(micro_batches) - 1
        with policy.no_sync() if no_sync else contextlib.nullcontext():
            logp, _ = logprobs.token_logprobs(policy, [batch.prompts[r] for r in rows],
                                              batch.tokens[rows], mask[rows], args.temperature,
                                              dtype)
            if dtype != logprob_dtype:  # exact_logp's values, this pass's gradient
                logp = logp + (exact_logp[rows - minibatch[0]] - logp).detach()
            # the ratio's old policy: on-policy (one minibatch, no lag) sg[logp], so the ratio is
            # exactly 1; else mu, the policy that sampled
            on_policy = args.minibatches == 1 and not args.async_lag
            old_logp = logp.detach() if on_policy else batch.behaviour_logp[rows]
            if args.loss == "ppo":
                pg_loss, clip_frac = advantage.policy_loss(
                    logp, old_logp, batch.advantages[rows], mask[rows], num_tokens, args.clip_eps)
            else:  # clip_frac: the truncated fraction
                pg_loss, clip_frac = advantage.truncated_is_loss(
                    logp, old_logp, batch.advantages[rows], mask[rows], num_tokens, args.is_cap)
            if args.place == "weighted":  # unbiased off-policy: w sg[K1], w = pi/mu
                kl_loss = kl.off_policy_kl_loss(logp, batch.behaviour_logp[rows],
                                                batch.ref_logp[rows], mask[rows], args.beta,
                                                num_tokens, max_log_w, log_mean_w)
            else:
                kl_loss = kl.kl_loss(logp, batch.ref_logp[rows], mask[rows], args.kl, args.place,
                                     args.beta, num_tokens, args.kl_clamp)
            # DDP and FSDP average gradients over ranks; num_tokens counts all ranks already
            ((pg_loss + kl_loss) * world_size).backward()
        sums += torch.stack([pg_loss.detach(), kl_loss.detach(), clip_frac]).double()
    losses = list(runtime.all_reduce_sums(
        dict(zip(("pg_loss", "kl_loss", "clip_frac"), sums.tolist())), device).values())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
    # a non-finite loss or gradient (K3-in-reward's r = pi_ref/pi can overflow): skip the update,
    # show it in the log, do not crash
    stepped = math.isfinite(grad_norm) and math.isfinite(sum(losses))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, grad_norm, stepped


def step_metrics(args, step, batch, sampled, scores, returns, entropy, updates, seconds):
    """The step's metrics.jsonl row, over all ranks: reward, the KL to the reference (K1 and K3
    per sequence, eq. 5, at the step's start), the updates' losses, how far the sampler mu was
    from the policy pi trained on its samples, and the time spent (sampling, training)."""
    (losses, grad_norms, skipped), (sample_s, train_s) = updates, seconds
    device, mask, out = batch.tokens.device, batch.mask, sampled["out"]
    with torch.no_grad():
        k1 = (mask * kl.estimate(batch.policy_logp, batch.ref_logp, "k1")).sum(1)
        k3 = (mask * kl.estimate(batch.policy_logp, batch.ref_logp, "k3")).sum(1)
    behaviour, ratio_max = sampler_vs_trainer(out.token_logprobs, batch.policy_logp, mask, device)
    # the sequence-level importance weights w = prod_t pi/mu at the step's start
    weights = importance_weights(kl.log_importance_weights(batch.policy_logp,
                                                           batch.behaviour_logp, mask), device)
    total = runtime.all_reduce_sums({
        "sequences": len(batch.prompts), "score": scores.sum().item(),
        "correct": (scores >= 1).sum().item(), "return": returns.sum().item(),
        "kl_k1": k1.sum().item(), "kl_k3": k3.sum().item(), "tokens": mask.sum().item(),
        "entropy": entropy.sum().item(), **behaviour}, device)
    n, num_resp = total["sequences"], total["tokens"]
    use_reference = args.place != "none" and args.beta > 0
    pg_loss, kl_loss, clip_frac = np.mean(losses, axis=0).tolist()
    return {"step": step, "reward": total["score"] / n, "accuracy": total["correct"] / n,
            "return": total["return"] / n,
            "kl_k1": total["kl_k1"] / n if use_reference else None,
            "kl_k3": total["kl_k3"] / n if use_reference else None,
            "loss": pg_loss + kl_loss, "pg_loss": pg_loss, "kl_loss": kl_loss,
            "entropy": total["entropy"] / num_resp, "response_len": num_resp / n,
            "grad_norm": float(np.mean(grad_norms)), "clip_frac": clip_frac,
            "mismatch_kl": total["mismatch_kl"] / num_resp,
            "lag": step - 1 - sampled["weights_step"],
            "behaviour_kl_k1": total["behaviour_kl_k1"] / n,
            "behaviour_kl_k3": total["behaviour_kl_k3"] / n,
            "ratio_mean": total["ratio"] / num_resp, "ratio_max": ratio_max,
            "ratio_outside": total["ratio_outside"] / num_resp,
            "log_w_max": weights["log_w_max"], "is_ess": weights["is_ess"],
            "lr": args.lr, "sample_s": sample_s, "train_s": train_s,  # a constant rate
            "tokens_per_s": num_resp / (sample_s + train_s), "skipped": skipped}


def reference_model(args, device):
    """pi_ref: the initial policy, frozen, in fp32 like the policy's no-grad pass; None when no KL
    is used (--place none or --beta 0)."""
    if args.place == "none" or args.beta == 0:
        return None
    reference = load_model(args.model, torch.float32, args.trust_remote_code)
    reference.requires_grad_(False)
    return runtime.shard(reference) if args.fsdp else reference.to(device)


def main(argv=None):
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.out = Path(args.out or f"runs/{Path(args.task).stem}-{Path(args.model).name}-{args.kl}-in-"
                                f"{args.place}-{args.beta:g}-seed{args.seed}")
    if message := check_flags(args, world_size):
        runtime.fail(message, "train.py")

    # ---------------------------------------------------------------- set-up
    rank, world_size, device, dtype = runtime.start(args.dtype)
    args.dtype = str(dtype).removeprefix("torch.")  # "auto" resolved: a resume must compute alike
    logprob_dtype = runtime.logprob_dtype(args.logprob_dtype, device)
    args.logprob_dtype = str(logprob_dtype).removeprefix("torch.")  # resolved, as --dtype
    if args.compile_sampler is None:  # resolved too
        args.compile_sampler = device.type in runtime.COMPILED_SAMPLER_ON
    print0 = print if rank == 0 else lambda *a, **k: None
    torch.manual_seed(args.seed)
    # the sampler's random stream: each rank its own
    generator = torch.Generator(device=device).manual_seed(1000 * args.seed + rank)
    resume_from, trainer_state = checkpoint.open_run(args, rank, world_size)
    loaded = load(args, resume_from)
    runtime.stop_if_any_rank(loaded if isinstance(loaded, str) else None, "train.py")
    examples, eval_sets, tokenizer, policy, stop_ids = loaded
    sampler = runtime.make_sampler(policy, device, dtype, args.fsdp)  # rollout.generate, eval
    if args.grad_checkpointing:  # recent transformers 5 call it activation_checkpointing_enable
        enable = getattr(policy, "activation_checkpointing_enable",
                         policy.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
        policy.train()  # transformers checkpoints only in train mode: keep dropout off, as in eval
        runtime.no_dropout(policy)
    policy = runtime.wrap(policy, device, args.fsdp)
    reference = reference_model(args, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.01)
    start_step, position = 0, 0  # steps done, prompts consumed (over all ranks)
    queue = collections.deque()  # batches sampled ahead (--async-lag), oldest first
    if resume_from is not None:
        queue = checkpoint.load(resume_from, policy, optimizer, generator, rank)
        runtime.refresh_sampler(sampler, policy)  # the checkpoint's weights, also where sharded
        start_step, position = trainer_state["step"], trainer_state["data_position"]
    if rank == 0:
        metrics_path = checkpoint.start_log(args, start_step, resumed=resume_from is not None)
    report_row = report.open(args, start_step, rank)  # --report-to's writer on rank 0, or None
    num_params = sum(p.numel() for p in runtime.unwrap(policy).parameters())
    print0(f"{args.model}: {num_params / 1e6:.0f}M parameters on {world_size} x {device.type}, "
           f"{str(dtype)[6:]} compute, {args.task} ({len(examples)} problems), "
           f"{args.kl}-in-{args.place} beta={args.beta}"
           + (f", resuming {resume_from}" if resume_from else
              ", no checkpoint to resume" if args.resume else ""))
    if device.type == "cuda":  # what the sampler will attend with, by the rule it follows
        print0(cuda_decode.flash_choice(device, dtype)[1])

    G, prompts_per_rank, bad_in_a_row = args.group_size, args.prompts_per_step // world_size, 0
    steps = range(start_step + 1, args.steps + 1)
    bar = tqdm(steps, initial=start_step, total=args.steps, disable=rank != 0)
    for step in bar:
        # ------------------------------------------------------------ rollout
        t0 = time.time()
        runtime.return_freed_memory()
        # --async-lag N: the batch trained on was sampled N updates ago (the first ones by the
        # initial weights), so N + 1 batches are sampled ahead, each with the step of its weights
        while len(queue) <= args.async_lag:
            problems = prompt_batch(examples, position + rank * prompts_per_rank, prompts_per_rank,
                                    args.seed)
            position += args.prompts_per_step
            # each prompt's G completions are contiguous: an RLOO group
            prompts = [ids for example in problems
                       for ids in [data.prompt_ids(tokenizer, example)] * G]
            max_rows = args.generate_rows or runtime.rows_that_fit(sampler, prompts,
                                                                   args.max_new_tokens)
            if step == start_step + 1 and max_rows and max_rows < len(prompts):
                print0(f"sampling {max_rows} of the {len(prompts)} rows at a time "
                       "(--generate-rows)")
            out = rollout.generate(sampler, prompts, args.max_new_tokens, args.temperature,
                                   args.top_p, stop_ids, generator, max_rows=max_rows,
                                   compiled=args.compile_sampler)
            queue.append({"weights_step": step - 1, "problems": problems, "prompts": prompts,
                          "out": out})
        sampled = queue.popleft()
        prompts, out = sampled["prompts"], sampled["out"]
        tokens, mask = out.tokens, out.response_mask
        runtime.release_sampler(sampler, policy)  # its memory goes to training until the refresh
        sample_s = time.time() - t0

        # ------------------------------------------------------------ reward
        t0 = time.time()
        completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        problems = [example for example in sampled["problems"] for _ in range(G)]
        scores = torch.tensor([data.score(example, completion)
                               for example, completion in zip(problems, completions)],
                              device=device)

        # ------------------------------------------------------------ log-probs
        # policy and reference, in --logprob-dtype (fp32: bf16 rounding would put a noise floor
        # under every KL and ratio)
        policy_logp, entropy = logprobs.no_grad_logprobs(
            policy, prompts, tokens, mask, args.temperature, logprob_dtype, args.micro_batch,
            entropy=True)
        ref_logp = policy_logp if reference is None else logprobs.no_grad_logprobs(
            reference, prompts, tokens, mask, args.temperature, logprob_dtype, args.micro_batch)[0]

        # ------------------------------------------------------------ shape (eq. 7), advantage
        returns = kl.shape_rewards(scores, policy_logp, ref_logp, mask, args.kl, args.place,
                                   args.beta, args.kl_clamp)
        # mu, the policy that sampled: the sampler's own log-probs, or (--behaviour trainer, lag 0)
        # the fp32 pass at the same weights
        behaviour_logp = out.token_logprobs if args.behaviour == "sampler" else policy_logp
        batch = Batch(prompts, tokens, mask, policy_logp, ref_logp, behaviour_logp,
                      ADVANTAGES[args.advantage](returns, G))

        # ------------------------------------------------------------ loss and step
        losses, grad_norms, skipped = [], [], 0  # losses: sums over all ranks, a row per minibatch
        minibatches = torch.arange(len(prompts)).tensor_split(args.minibatches)
        for index, minibatch in enumerate(minibatches):
            minibatch_losses, grad_norm, stepped = update(args, policy, optimizer, batch, minibatch,
                                                          first=index == 0)
            bad_in_a_row = 0 if stepped else bad_in_a_row + 1
            skipped += not stepped
            losses.append(minibatch_losses)
            grad_norms.append(grad_norm)
        runtime.refresh_sampler(sampler, policy)
        train_s = time.time() - t0

        # ------------------------------------------------------------ log
        row = step_metrics(args, step, batch, sampled, scores, returns, entropy,
                           (losses, grad_norms, skipped), (sample_s, train_s))

        if args.eval_every and step % args.eval_every == 0:
            row.update(evaluate_pass1(args, sampler, tokenizer, eval_sets, len(prompts), rank,
                                      world_size))
        if rank == 0:
            with open(metrics_path, "a") as file:
                file.write(json.dumps(row) + "\n")
            if report_row:
                report_row(row)
        bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl_k1'] or 0:.4f}",
                        len=f"{row['response_len']:.0f}")
        if bad_in_a_row >= args.max_bad_steps:
            last_good = checkpoint.latest(args.out) or "none (use --save-every)"
            runtime.fail(f"{bad_in_a_row} updates in a row had a non-finite loss or gradient at "
                         f"step {step}; stopping. The last good checkpoint is {last_good}",
                         "train.py")
        if args.save_every and step % args.save_every == 0:
            save(args, step, position, world_size, policy, tokenizer, optimizer, generator, queue,
                 rank)

    report.close()
    save(args, max(args.steps, start_step), position, world_size, policy, tokenizer, optimizer,
         generator, queue, rank, name="final")
    print0(f"saved {args.out / 'final'}")
    runtime.finish()


def save(args, step, position, world_size, policy, tokenizer, optimizer, generator, queue, rank,
         name=None):
    """checkpoint.save to OUT/step_N (or OUT/NAME), with the state that --resume continues from."""
    trainer_state = {"step": step, "data_position": position, "world_size": world_size,
                     "flags": checkpoint.run_flags(args), "sharded": args.fsdp}
    checkpoint.save(args.out / (name or f"step_{step}"), policy, tokenizer, optimizer, generator,
                    queue, trainer_state, rank, args.keep_last)


if __name__ == "__main__":
    main()
