"""train.py's flags: its argparse parser, grouped as the paper's sections, and check_flags, which
names the first bad one in a line. Where the paper gives a flag's value, its help names it
("paper: ...", from sec. 4.1, 4.2 and app. B); the other flags are ours or verl's defaults.
docs/gpu.md has the paper's recipe as a command.
"""
import argparse
import os
from pathlib import Path

import advantage
import kl
from systems import report
from systems.recompute import CHOICES as RECOMPUTE

# --advantage: the baseline, a function of (returns, group size) in advantage.py
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
                   help="prompts per step over all ranks (paper: a 'total training batch size' of "
                        "256, read as prompts: verl's convention, each sampled --group-size times)")
group.add_argument("--minibatches", type=int, default=1,
                   help="optimizer steps per sampled batch: 1 = on-policy (paper), "
                        "4 = off-policy (Fig. 2 centre)")
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
                        "Inductor fusing each layer's small kernels (cuda_decode.compiled_step: "
                        "a layer's two regions compiled at the first step, for every layer); "
                        "default: on the devices runtime.COMPILED_SAMPLER_ON names (none until a "
                        "GPU has timed it)")
group.add_argument("--generate-rows", type=int, default=0,
                   help="rows one generate call decodes at a time, sampling and --eval-every's "
                        "evaluation (0 = auto: as many as fit their KV cache in half the GPU "
                        "memory free; all on a CPU); the same samples in fp32 whatever the count, "
                        "in bf16 only with the same count: fix it for bf16 samples that repeat")
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
                        "W&B (WANDB_MODE=offline: files in OUT/wandb), from rank 0 "
                        "(systems/report.py)")
group = parser.add_argument_group("system")
group.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype of the sampler and the gradient pass (weights and AdamW "
                        "state stay fp32); auto = bf16 where the device has it")
group.add_argument("--logprob-dtype", default="auto",
                   choices=("auto", "float32", "bf16x6", "bfloat16"),
                   help="dtype of the log-probs that feed the KL, the ratio and the loss values: "
                        "float32 = exact, bf16x6 = fp32 from six bf16 tensor-core products "
                        "(systems/split_matmul.py), bfloat16 = the fast, noisy way; auto = bf16x6 "
                        "on the cards where it pays (A100, H100, H200, B200: "
                        "runtime.BF16X6_PAYS_ON), "
                        "float32 on every other card and on a CPU (docs/precision.md)")
group.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per forward/backward (the gradient does not depend on it; 8 "
                        "keeps the default run under 4 GiB whatever the responses' lengths under "
                        "--recompute full; auto takes up to half a CPU machine's memory: "
                        "systems/activations.py)")
group.add_argument("--recompute", default="auto", choices=("auto", *RECOMPUTE),
                   help="what each decoder layer recomputes in the backward pass instead of "
                        "keeping it (systems/recompute.py; the same gradient): full = all but its "
                        "input (~1 GB less memory at the defaults; ~30% more gradient-pass time "
                        "on an AVX2 CPU: docs/benchmarks.md), selective = the elementwise ops, "
                        "its matmuls' and attention's outputs kept, none = nothing; auto = on a "
                        "CPU none where "
                        "the memory allows (systems/activations.py), else full; on CUDA "
                        "runtime.CUDA_RECOMPUTE (lab/memory_plan.py plans each)")
group.add_argument("--one-policy-pass", action=argparse.BooleanOptionalAction, default=True,
                   help="on-policy on one CPU process with --dtype = --logprob-dtype, the "
                        "policy's log-probs come from the gradient pass itself, its graphs kept "
                        "for the update where the memory allows (train.policy_logprobs); "
                        "--no-one-policy-pass: a no-grad pass and a gradient pass, as elsewhere")
group.add_argument("--grad-checkpointing", dest="recompute", action="store_const", const="full",
                   default=argparse.SUPPRESS, help="= --recompute full (kept for older commands)")
group.add_argument("--no-grad-checkpointing", dest="recompute", action="store_const",
                   const="none", default=argparse.SUPPRESS,
                   help="= --recompute none (kept for older commands)")
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
        (args.kl != "k2" or args.place in ("loss", "none"),
         "--kl k2 goes in the loss only (K2-in-loss, compared in docs/kl_gradients.md; not in the "
         "paper): in the reward it is a configuration of neither Table 1 nor sec. 3"),
        (not args.out or not Path(args.out).is_file(),
         f"--out {args.out} is a file: pass a folder"),
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

