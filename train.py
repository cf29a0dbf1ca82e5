"""On-policy RLOO fine-tuning with a KL penalty (paper sec. 2-4 and app. B): `torchrun train.py --kl k1 --place reward`.

The exact variant, the paper's sec. 4.1 setup (verl's defaults where the paper is silent: AdamW, weight decay
0.01, gradient clipping at 1.0, constant learning rate, PPO clip 0.2). One step:
  1. rollout    sample --group-size completions for each of --prompts-per-step prompts from the current policy
  2. reward     score each completion with its verifiable reward R in [0, 1] (reward.py via data.score)
  3. log-probs  log pi(y_t | x, y<t) of every sampled token under the policy (no grad) and the frozen reference;
                each group goes through the model as one packed sequence, its prompt computed once (token_logprobs)
  4. shape      return_i = R_i - beta * sum_t sg[KL_t] when --place is reward or both (eq. 7), else R_i
  5. advantage  RLOO: A_i = return_i - mean of the other G - 1 returns of the same prompt
  6. loss       PPO-clip surrogate (eq. 4) + beta * sum_t KL_t when --place is loss or both (eq. 9); both are sums
                over every response token of the (mini)batch divided by their total count `num_tokens`
  7. step       one AdamW step per minibatch: --minibatches 1 is the paper's strictly on-policy default (the ratio
                is exactly 1), --minibatches 4 its off-policy variant (Fig. 2 centre)
The reference pi_ref is the initial policy, frozen; --place none (or --beta 0) never loads it.

Precision: fp32 master weights and AdamW state. The no-grad log-probs that feed the KL and the ratio (policy and
reference) are fp32 (--logprob-dtype): in bf16 their rounding alone puts a floor under every KL, far above the
drift of a small step (docs/precision.md). The gradient pass runs in bf16 (autocast) where the device supports
it, and takes its values from the fp32 pass, logp + sg[logp_fp32 - logp], so K_t and the ratio in the loss are
exact and only the gradient's direction carries bf16 rounding. Sampling uses a bf16 copy of the weights (its
rotary buffers stay fp32), refreshed after every step; `mismatch_kl` measures the gap between sampler and
trainer, so "on-policy" is measured, not assumed. The reference is the initial fp32 weights, computed exactly
like the policy's no-grad pass, so the KL of step 1 is exactly 0.
Distributed: torchrun gives DDP (gloo on CPU, NCCL on CUDA), --fsdp gives FSDP2. Each rank samples its share of
the prompts; `num_tokens` counts every rank's tokens, so a step's gradient is the same for any --micro-batch and
any number of ranks (test_train.py checks both to 1e-5).

    python train.py --kl k1 --place reward                      # SmolLM2-135M-Instruct on arith, on a CPU
    torchrun --nproc_per_node=8 train.py --kl k3 --place loss --fsdp --model Qwen/Qwen2.5-7B --task math ...
"""
import argparse
import contextlib
import copy
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import advantage
import data
import kl
import rollout
from hub import HubUnreachable
from model import load_model, load_tokenizer, stop_token_ids

parser = argparse.ArgumentParser(description="KL-regularized RLOO fine-tuning of an LLM (A Comedy of Estimators)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--kl", required=True, choices=kl.KINDS,
                    help="token-level estimator: k1 = log pi/pi_ref (eq. 11), k2 = (log pi/pi_ref)^2 / 2, "
                         "k3 = r - 1 - log r with r = pi_ref/pi (eq. 14)")
parser.add_argument("--place", required=True, choices=kl.PLACES,
                    help="where the estimate goes: the reward (eq. 7), the loss (eq. 9), both (sec. 3.1), or none")
parser.add_argument("--beta", type=float, default=0.05, help="KL coefficient (paper: 0.05, 0.1, 0.3, 1)")
parser.add_argument("--kl-clamp", default="none", choices=kl.CLAMPS,
                    help="none = the exact estimator; verl = verl's low_var_kl bounds on K3 (log r in [-20, 20], "
                         "K3 in [-10, 10]), as the paper's on-policy K3 runs had them")
parser.add_argument("--model", default="smollm2-135m",
                    help="policy and reference: a hub id, a local save_pretrained directory, or smollm2-135m")
parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the hub")
parser.add_argument("--task", default="arith", help="training task: a data.py task (math, countdown, arith...) "
                                                    "or a .jsonl file")
parser.add_argument("--group-size", type=int, default=4, help="completions per prompt, the RLOO group (paper: 5)")
parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step over all ranks (paper: 256)")
parser.add_argument("--minibatches", type=int, default=1,
                    help="optimizer steps per sampled batch: 1 = strictly on-policy (paper), 4 = off-policy (Fig. 2)")
parser.add_argument("--micro-batch", type=int, default=16,
                    help="sequences per forward/backward (gradient accumulation; the gradient does not depend on it)")
parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (paper: 1e-6)")
parser.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip range of the ratio (eq. 4; verl's default)")
parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm to this")
parser.add_argument("--max-new-tokens", type=int, default=40, help="response length cap (paper: 1024)")
parser.add_argument("--temperature", type=float, default=1.0,
                    help="sampling temperature; the trainer's log-probs use it too (paper: 1.0)")
parser.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling; training takes only 1.0, the distribution its log-probs are under "
                         "(paper: 1.0)")
parser.add_argument("--steps", type=int, default=20, help="training steps, one sampled batch each (paper: 250)")
parser.add_argument("--eval-every", type=int, default=0, help="evaluate (Pass@1, eval.py) every N steps; 0 = never")
parser.add_argument("--eval-tasks", default=None,
                    help="comma-separated data.py tasks to evaluate on, test split (default: the training task)")
parser.add_argument("--eval-limit", type=int, default=None, help="evaluate on N problems of each task (a fixed subset)")
parser.add_argument("--save-every", type=int, default=0, help="checkpoint OUT/step_N every N steps; 0 = only final")
parser.add_argument("--out", default=None,
                    help="output directory, new or empty unless --resume (default: runs/TASK-MODEL-KL-in-PLACE-"
                         "BETA-seedSEED)")
parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
parser.add_argument("--seed", type=int, default=0, help="seeds the prompt order and the sampler")
parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="compute dtype of the sampler and of the gradient pass (weights and AdamW state stay "
                         "fp32); auto = bf16 where the device has it")
parser.add_argument("--logprob-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of the log-probs that feed the KL, the ratio and the loss values (reference, "
                         "old policy; the gradient pass takes its values from them): float32 = exact, "
                         "bfloat16 = the fast, noisy way (README: the KL noise floor)")
parser.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward (memory)")
parser.add_argument("--fsdp", action="store_true", help="shard weights, gradients and AdamW state (FSDP2, torchrun)")
parser.add_argument("--max-bad-steps", type=int, default=3,
                    help="stop after this many updates in a row with a non-finite loss or gradient")


def fail(message):
    """Stop with a one-line message and exit status 1."""
    raise SystemExit(f"train.py: error: {message}")


def prompt_batch(examples, start, count, seed):
    """Examples start, ..., start + count - 1 of an endless stream: the task reshuffled (seeded) every epoch."""
    n, positions = len(examples), range(start, start + count)
    orders = {epoch: np.random.default_rng([seed, epoch]).permutation(n) for epoch in {p // n for p in positions}}
    return [examples[orders[p // n][p % n]] for p in positions]


def token_logprobs(model, prompts, responses, response_mask, temperature, dtype, entropy=False):
    """log pi(y_t | x, y<t) of each response token, (B, T) in fp32, and with entropy=True the entropy of pi
    there (detached; else None: the gradient pass skips its two (B, T, vocab) temporaries).

    Rows with the same prompt (an RLOO group is contiguous) are packed into one sequence: the prompt once, then
    each of its responses, every response attending to the prompt and to its own earlier tokens only (a block
    attention mask, position ids restarting after the prompt). Each token sees exactly what it would see in its
    own sequence, but the prompt is computed once per group instead of G times. Prompts are left-padded, so every
    pack's first response starts at column P and only the last K * T + 1 columns reach the output layer.
    """
    B, T = responses.shape
    packs = []  # (prompt, rows): runs of consecutive rows with the same prompt
    for row, prompt in enumerate(prompts):
        if packs and packs[-1][0] == prompt:
            packs[-1][1].append(row)
        else:
            packs.append((prompt, [row]))
    # P: prompt width (left-padded), K: most responses in one pack, L: a pack's length
    P, K = max(len(prompt) for prompt, _ in packs), max(len(rows) for _, rows in packs)
    L, device = P + K * T, responses.device
    input_ids = torch.zeros(len(packs), L, dtype=torch.long, device=device)
    position_ids = torch.zeros_like(input_ids)
    allowed = torch.eye(L, dtype=torch.bool, device=device).repeat(len(packs), 1, 1)  # padding sees itself only
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    pack_of_row, slot_of_row = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    for j, (prompt, rows) in enumerate(packs):
        prompt_start = P - len(prompt)
        input_ids[j, prompt_start:P] = torch.tensor(prompt)
        position_ids[j, prompt_start:P] = torch.arange(len(prompt))
        allowed[j, prompt_start:P, prompt_start:P] = torch.ones(len(prompt), len(prompt), dtype=torch.bool,
                                                                device=device).tril()
        for k, row in enumerate(rows):
            columns = slice(P + k * T, P + (k + 1) * T)
            input_ids[j, columns] = responses[row]
            position_ids[j, columns] = torch.arange(len(prompt), len(prompt) + T)
            allowed[j, columns, prompt_start:P] = True
            allowed[j, columns, columns] = causal
            pack_of_row[row], slot_of_row[row] = j, k
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        # kept column 0 (the prompt's last) predicts every response's token 0; kept column k*T + t predicts token t
        logits = model(input_ids=input_ids, attention_mask=allowed.unsqueeze(1), position_ids=position_ids,
                       use_cache=False, logits_to_keep=K * T + 1).logits
    t = torch.arange(T)
    kept_column = torch.where(t > 0, slot_of_row[:, None] * T + t, 0)  # (B, T): the column predicting token t
    logits = logits[pack_of_row[:, None].to(device), kept_column.to(device)]  # (B, T, vocab)
    logp_all = (logits.float() / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logp * response_mask, None
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * response_mask, entropy * response_mask


def no_grad_logprobs(model, prompts, responses, response_mask, temperature, dtype, micro_batch):
    """token_logprobs and entropies of the whole batch, micro-batch by micro-batch, without gradient."""
    parts = []
    with torch.no_grad():
        for start in range(0, len(prompts), micro_batch):
            rows = slice(start, start + micro_batch)
            parts.append(token_logprobs(model, prompts[rows], responses[rows], response_mask[rows], temperature,
                                        dtype, entropy=True))
    return torch.cat([logp for logp, _ in parts]), torch.cat([entropy for _, entropy in parts])


def shard(model):
    """FSDP2: each decoder layer is one shard group, the rest (embeddings, norm, head) the root group. Weights
    are gathered in fp32, so the fp32 log-prob passes are fp32; the gradient pass casts under autocast."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or ()):  # the decoder layer class, e.g. LlamaDecoderLayer
            fully_shard(module)
    return fully_shard(model)


def make_sampler(policy, device, dtype, fsdp):
    """The copy of the policy that rollout.generate samples from: its weights in the compute dtype, made
    without a second fp32 copy (each weight is cast as it is copied). Buffers keep their dtype: the rotary
    frequencies rounded to bf16 would turn every position's angle (a 0.2% error in a frequency is 0.3
    radians at position 200). In fp32, without FSDP, the policy itself is the sampler."""
    if dtype == torch.float32 and not fsdp:
        return policy.to(device)
    memo = {id(p): torch.nn.Parameter(p.detach().to(device, dtype), requires_grad=False)
            for p in policy.parameters()}  # deepcopy takes these for the weights, copies the rest
    return copy.deepcopy(policy, memo).to(device).eval()


@torch.no_grad()
def refresh_sampler(sampler, policy):
    """Copy the fp32 master weights into the sampler (cast to its dtype); FSDP gathers one weight at a time."""
    if sampler is policy:
        return
    weights = dict(policy.named_parameters())
    for name, param in sampler.named_parameters():
        weight = weights[name]
        param.copy_(weight.full_tensor() if isinstance(weight, DTensor) else weight)


def rng_state(generator):
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available()
            else [], "python": random.getstate(), "numpy": np.random.get_state(), "sampler": generator.get_state()}


def set_rng_state(state, generator):
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    generator.set_state(state["sampler"])


def save_checkpoint(path, policy, tokenizer, optimizer, generator, trainer_state, rank):
    """path/: weights (safetensors, loadable by from_pretrained, vLLM, lm-eval), tokenizer, AdamW state, step and
    every rank's RNG. Written to a temporary directory and renamed, so a killed save leaves no checkpoint behind."""
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
    if rank == 0:
        unwrap(policy).save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    barrier()


def stop_if_any_rank(message):
    """Every rank calls this at the same point: if any rank has a message, every rank stops with it (a rank
    that stopped alone would leave the others waiting in their next collective)."""
    messages = [message]
    if dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
    message = next((m for m in messages if m), None)
    if message:
        fail(message)


# flags that do not change what a run computes (the gradient does not depend on the micro-batch, the sharding or
# recomputation); every other flag must match the checkpoint's for --resume
RESUMABLE_CHANGES = {"out", "resume", "steps", "save_every", "eval_every", "eval_tasks", "eval_limit",
                     "micro_batch", "grad_checkpointing", "fsdp", "max_bad_steps"}


def run_flags(args):
    """The flags that define a run, as stored in its checkpoints."""
    return {k: v for k, v in vars(args).items() if k not in RESUMABLE_CHANGES}


def flag_changes(saved, args):
    """The flags a resumed run sets differently from the checkpoint's, as 'name: old -> new' strings."""
    now = run_flags(args)
    return [f"--{k.replace('_', '-')}: {saved.get(k)} -> {now.get(k)}" for k in sorted(saved.keys() | now.keys())
            if saved.get(k) != now.get(k)]


def latest_checkpoint(out):
    """The complete checkpoint (OUT/step_N or OUT/final) with the most steps; a killed save's .tmp-* is no candidate."""
    done = [p.parent for p in out.glob("*/trainer_state.json") if not p.parent.name.startswith(".tmp-")]
    return max(done, key=lambda d: json.loads((d / "trainer_state.json").read_text())["step"], default=None)


def unwrap(model):
    return model.module if isinstance(model, DDP) else model


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values, device):
    """Sums of a list of floats over all ranks, in one collective."""
    total = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.tolist()


if __name__ == "__main__":
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.out = Path(args.out or f"runs/{Path(args.task).stem}-{Path(args.model).name}-{args.kl}-in-{args.place}-"
                                f"{args.beta:g}-seed{args.seed}")
    for ok, message in [
        (args.group_size >= 2, f"--group-size must be at least 2 (RLOO needs other samples), got {args.group_size}"),
        (args.beta >= 0, f"--beta must be >= 0, got {args.beta}"),
        (args.prompts_per_step > 0 and args.prompts_per_step % world_size == 0,
         f"--prompts-per-step ({args.prompts_per_step}) must be a positive multiple of the {world_size} ranks"),
        (1 <= args.minibatches <= args.prompts_per_step // world_size * args.group_size,
         f"--minibatches must be between 1 and the sequences per rank, got {args.minibatches}"),
        (args.micro_batch >= 1 and args.max_new_tokens >= 1 and args.steps >= 0 and args.lr > 0,
         "--micro-batch and --max-new-tokens must be >= 1, --steps >= 0, --lr > 0"),
        (args.temperature > 0, "--temperature must be > 0"),
        (args.top_p == 1, "--top-p < 1 is for eval.py: the trainer's log-probs, ratio and KL are under the full "
                          "softmax, so they would describe another distribution than the one sampled"),
        (args.eval_every >= 0 and args.save_every >= 0 and args.max_bad_steps >= 1,
         "--eval-every and --save-every must be >= 0, --max-bad-steps >= 1"),
        (not args.fsdp or "RANK" in os.environ, "--fsdp needs torchrun: torchrun --nproc_per_node=N train.py ..."),
    ]:
        if not ok:
            fail(message)
    use_reference = args.place != "none" and args.beta > 0

    # ---------------------------------------------------------------- setup: ranks, device, precision
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bf16_ok = (torch.cuda.is_bf16_supported() if device.type == "cuda"  # CPUs: AVX512-BF16 (and AMX) make it fast
               else getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if bf16_ok else torch.float32
    logprob_dtype = getattr(torch, args.logprob_dtype)
    print0 = print if rank == 0 else lambda *a, **k: None
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=device).manual_seed(1000 * args.seed + rank)  # each rank its own samples

    # ---------------------------------------------------------------- data, models, optimizer
    # runs never mix: a new run needs an empty --out (rank 0 looks, before anyone writes); --resume needs the same
    # flags and ranks as the checkpoint it continues
    stop_if_any_rank(f"{args.out} is not empty: pass --resume to continue that run, or another --out"
                     if rank == 0 and not args.resume and args.out.is_dir() and any(args.out.iterdir()) else None)
    checkpoint = latest_checkpoint(args.out) if args.resume else None
    trainer_state = json.loads((checkpoint / "trainer_state.json").read_text()) if checkpoint else {}
    changed = flag_changes(trainer_state["flags"], args) if "flags" in trainer_state else []
    if changed:
        fail(f"{checkpoint} was run with other flags ({'; '.join(changed)}); resume with the same flags or "
             f"another --out")
    if checkpoint and trainer_state["world_size"] != world_size:
        fail(f"{checkpoint} was written by {trainer_state['world_size']} ranks; resume with as many")
    stop_if_any_rank(f"{checkpoint / f'rng_rank{rank}.pt'} is missing: the checkpoint is incomplete"
                     if checkpoint and not (checkpoint / f"rng_rank{rank}.pt").exists() else None)
    error = None
    try:
        examples = data.load_task(args.task, split="train", seed=args.seed)
        eval_sets = {name: data.load_task(name, split="test", limit=args.eval_limit)
                     for name in (args.eval_tasks or args.task).split(",")} if args.eval_every else {}
        tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
        policy = load_model(str(checkpoint or args.model), torch.float32, args.trust_remote_code)
        eos_token_id = stop_token_ids(policy, tokenizer)  # EOS and the chat template's end of turn
    except (OSError, ValueError, HubUnreachable) as caught:
        error = str(caught).splitlines()[0] if str(caught) else type(caught).__name__
    stop_if_any_rank(error)
    # the sampler: the policy's weights in the compute dtype, used only by rollout.generate and eval
    sampler = make_sampler(policy, device, dtype, args.fsdp)
    if args.grad_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.train()  # transformers only checkpoints in train mode; the models we use have no dropout
    if args.fsdp:
        policy = shard(policy)
    elif dist.is_initialized():
        policy = DDP(policy.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    else:
        policy = policy.to(device)
    # pi_ref: the initial policy, frozen, computed exactly like the policy's no-grad pass (fp32 weights and dtype)
    reference = None
    if use_reference:
        reference = load_model(args.model, torch.float32, args.trust_remote_code).requires_grad_(False)
        reference = shard(reference) if args.fsdp else reference.to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.01)
    start_step, position = 0, 0  # steps done, prompts consumed (over all ranks)
    if checkpoint is not None:
        set_optimizer_state_dict(policy, optimizer, torch.load(checkpoint / "optimizer.pt", mmap=True),
                                 options=StateDictOptions(full_state_dict=True))
        set_rng_state(torch.load(checkpoint / f"rng_rank{rank}.pt", weights_only=False), generator)
        start_step, position = trainer_state["step"], trainer_state["data_position"]
    metrics_path = args.out / "metrics.jsonl"
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "config.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                          for k, v in vars(args).items()}, indent=2) + "\n")
        # a resumed run forgets the steps logged after its checkpoint (they are done again)
        rows = metrics_path.read_text().splitlines() if metrics_path.exists() and checkpoint else []
        metrics_path.write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= start_step))
    print0(f"{args.model}: {sum(p.numel() for p in unwrap(policy).parameters()) / 1e6:.0f}M parameters on "
           f"{world_size} x {device.type}, {str(dtype)[6:]} compute, {args.task} ({len(examples)} problems), "
           f"{args.kl}-in-{args.place} beta={args.beta}" + (f", resuming {checkpoint}" if checkpoint else
                                                            ", no checkpoint to resume" if args.resume else ""))

    if device.type == "cuda":
        print0(rollout.flash_attn_status()[1])
    prompts_per_rank = args.prompts_per_step // world_size
    bad_in_a_row = 0
    bar = tqdm(range(start_step + 1, args.steps + 1), initial=start_step, total=args.steps, disable=rank != 0)
    for step in bar:
        # ------------------------------------------------------------ rollout
        t0 = time.time()
        problems = prompt_batch(examples, position + rank * prompts_per_rank, prompts_per_rank, args.seed)
        position += args.prompts_per_step
        # each prompt's G completions are contiguous: an RLOO group
        batch = [example for example in problems for _ in range(args.group_size)]
        prompts = [ids for example in problems for ids in [data.prompt_ids(tokenizer, example)] * args.group_size]
        out = rollout.generate(sampler, prompts, args.max_new_tokens, args.temperature, args.top_p, eos_token_id,
                               generator)
        tokens, mask = out.tokens, out.response_mask
        sample_s = time.time() - t0

        # ------------------------------------------------------------ reward
        t0 = time.time()
        completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        scores = torch.tensor([data.score(ex, c) for ex, c in zip(batch, completions)], device=device)

        # ------------------------------------------------------------ reference and policy log-probs
        # in --logprob-dtype (fp32: bf16 rounding would put a noise floor under every KL and ratio)
        old_logp, entropy = no_grad_logprobs(policy, prompts, tokens, mask, args.temperature, logprob_dtype,
                                             args.micro_batch)
        ref_logp = old_logp if reference is None else no_grad_logprobs(
            reference, prompts, tokens, mask, args.temperature, logprob_dtype, args.micro_batch)[0]

        # ------------------------------------------------------------ shape rewards (eq. 7) and advantage (RLOO)
        returns = kl.shape_rewards(scores, old_logp, ref_logp, mask, args.kl, args.place, args.beta,
                                   args.kl_clamp)
        advantages = advantage.rloo(returns, args.group_size)

        # ------------------------------------------------------------ loss and step, per minibatch
        losses = []  # (pg_loss, kl_loss, clip_frac) summed over this rank's micro-batches, one row per minibatch
        grad_norms, skipped = [], 0
        for index, minibatch in enumerate(torch.arange(len(batch)).tensor_split(args.minibatches)):
            # the minibatch's log-probs in --logprob-dtype under the current weights: old_logp until the first
            # update, then a no-grad pass of their own (only when the gradient pass runs in another dtype)
            exact_logp = old_logp[minibatch] if index == 0 or dtype == logprob_dtype else no_grad_logprobs(
                policy, [prompts[r] for r in minibatch], tokens[minibatch], mask[minibatch], args.temperature,
                logprob_dtype, args.micro_batch)[0]
            # num_tokens: response tokens of the minibatch on all ranks, the normalizer of both losses
            num_tokens = mask[minibatch].sum()
            if dist.is_initialized():
                dist.all_reduce(num_tokens)
            micro_batches = minibatch.split(args.micro_batch)
            sums = torch.zeros(3, dtype=torch.float64, device=device)
            for i, rows in enumerate(micro_batches):
                # DDP all-reduces gradients in the backward of the last micro-batch only
                last = i == len(micro_batches) - 1
                with contextlib.nullcontext() if last or not isinstance(policy, DDP) else policy.no_sync():
                    logp, _ = token_logprobs(policy, [prompts[r] for r in rows], tokens[rows], mask[rows],
                                             args.temperature, dtype)
                    if dtype != logprob_dtype:  # the values of exact_logp, the gradient of this pass
                        logp = logp + (exact_logp[rows - minibatch[0]] - logp).detach()
                    # on-policy (one minibatch) the ratio is exactly 1: old_logp = sg[logp]
                    old = logp.detach() if args.minibatches == 1 else old_logp[rows]
                    pg_loss, clip_frac = advantage.policy_loss(logp, old, advantages[rows], mask[rows], num_tokens,
                                                               args.clip_eps)
                    kl_loss = kl.kl_loss(logp, ref_logp[rows], mask[rows], args.kl, args.place, args.beta,
                                         num_tokens, args.kl_clamp)
                    # DDP and FSDP average gradients over ranks, but num_tokens already counts all ranks: undo it
                    ((pg_loss + kl_loss) * world_size).backward()
                sums += torch.stack([pg_loss.detach(), kl_loss.detach(), clip_frac]).double()
            sums = all_reduce_sum(sums.tolist(), device)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
            if math.isfinite(grad_norm) and math.isfinite(sums[0] + sums[1]):
                optimizer.step()
                bad_in_a_row = 0
            else:  # skip the update: K3-in-reward can overflow (Fig. 3), and the run must show it, not crash
                skipped += 1
                bad_in_a_row += 1
            optimizer.zero_grad(set_to_none=True)
            losses.append(sums)
            grad_norms.append(grad_norm)
        if skipped < args.minibatches:
            refresh_sampler(sampler, unwrap(policy))
        train_s = time.time() - t0

        # ------------------------------------------------------------ log
        with torch.no_grad():
            k1 = (mask * kl.estimate(old_logp, ref_logp, "k1")).sum(1)  # per sequence (eq. 5)
            k3 = (mask * kl.estimate(old_logp, ref_logp, "k3")).sum(1)
        n, score_sum, correct, return_sum, k1_sum, k3_sum, num_resp, entropy_sum, mismatch = all_reduce_sum([
            len(batch), scores.sum().item(), (scores >= 1).sum().item(), returns.sum().item(), k1.sum().item(),
            k3.sum().item(), mask.sum().item(), entropy.sum().item(),
            (mask * (out.token_logprobs - old_logp)).sum().item()], device)
        pg_loss, kl_loss, clip_frac = np.mean(losses, axis=0).tolist()
        row = {"step": step, "reward": score_sum / n, "accuracy": correct / n, "return": return_sum / n,
               "kl_k1": k1_sum / n if use_reference else None, "kl_k3": k3_sum / n if use_reference else None,
               "loss": pg_loss + kl_loss, "pg_loss": pg_loss, "kl_loss": kl_loss, "entropy": entropy_sum / num_resp,
               "response_len": num_resp / n, "grad_norm": float(np.mean(grad_norms)), "clip_frac": clip_frac,
               "mismatch_kl": mismatch / num_resp, "lr": optimizer.param_groups[0]["lr"], "sample_s": sample_s,
               "train_s": train_s, "tokens_per_s": num_resp / (sample_s + train_s), "skipped": skipped}
        if args.eval_every and step % args.eval_every == 0:
            from eval import evaluate  # here: only runs with --eval-every need it

            for name, eval_examples in eval_sets.items():
                result, _ = evaluate(sampler, tokenizer, eval_examples, samples=1, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, top_p=args.top_p, batch_size=len(batch),
                                     seed=args.seed, rank=rank, world_size=world_size)
                for key in ("accuracy", "stderr", "pass@1", "n"):
                    row[f"eval/{Path(name).stem}/{key}"] = result[key]
        if rank == 0:
            with open(metrics_path, "a") as file:
                file.write(json.dumps(row) + "\n")
        bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl_k1'] or 0:.4f}",
                        len=f"{row['response_len']:.0f}")
        if bad_in_a_row >= args.max_bad_steps:
            last = latest_checkpoint(args.out)
            fail(f"{bad_in_a_row} updates in a row had a non-finite loss or gradient at step {step}; stopping. "
                 f"The last good checkpoint is {last or 'none (use --save-every)'}")
        trainer_state = {"step": step, "data_position": position, "world_size": world_size,
                         "flags": run_flags(args)}
        if args.save_every and step % args.save_every == 0:
            save_checkpoint(args.out / f"step_{step}", policy, tokenizer, optimizer, generator, trainer_state, rank)

    trainer_state = {"step": max(args.steps, start_step), "data_position": position, "world_size": world_size,
                     "flags": run_flags(args)}
    save_checkpoint(args.out / "final", policy, tokenizer, optimizer, generator, trainer_state, rank)
    print0(f"saved {args.out / 'final'}")
    if dist.is_initialized():
        dist.destroy_process_group()
