"""On-policy RLOO fine-tuning of an LLM with a KL penalty (paper sec. 2-4, app. B).

One step of `main` (each configuration's lines carry a comment `Table 1:` and its name, the four
of Table 1 or `both` or `weighted`; README.md, "Finding a configuration", greps exactly them):
  1. rollout    --group-size completions for each of --prompts-per-step prompts, from the policy
  2. reward     each completion's verifiable reward R in [0, 1] (data.score, reward.py)
  3. log-probs  log pi(y_t | x, y<t) of every sampled token under the policy (no grad) and the
                frozen reference pi_ref, the initial policy (logprobs.py: each group is one
                packed sequence); on one CPU process on-policy in fp32 the policy's come from the
                gradient pass itself, its graphs kept for step 7 (policy_logprobs)
  4. shape      return_i = R_i - beta * sum_t sg[KL_t] if --place is reward/both (eq. 7), else R_i
  5. advantage  RLOO: A_i = return_i - mean of the other G - 1 returns of the same prompt
  6. loss       PPO-clip surrogate (eq. 4) + beta * sum_t KL_t when --place is loss or both (eq. 9),
                both summed over the response tokens of the (mini)batch and divided by their count
                `num_tokens`
  7. step       one AdamW step per minibatch: --minibatches 1 is strictly on-policy (the ratio is
                exactly 1), 4 the paper's off-policy variant (Fig. 2 centre)
--place none (or --beta 0) never loads the reference. The flags and their checks: flags.py.

Where it departs from the paper, or fills in what the paper leaves unsaid:
- Batch size: sec. 4.1 sets the "total training batch size and mini-batch size to 256"; we read 256
  as prompts (--prompts-per-step 256), verl's convention (the paper ran verl, app. B), and "5
  rollouts per prompt (i.e. group size G = 4)" as 5 samples a prompt (--group-size 5, app. B's K).
- Of the optimizer the paper gives the learning rate (1e-6); the rest is verl's defaults: AdamW with
  weight decay 0.01, the gradient's norm clipped at 1.0, a constant learning rate, PPO clip 0.2.
- The losses are summed over tokens and divided by the batch's response tokens (sec. 4.1), not
  averaged over each sequence's own tokens as eq. 4 writes them.
- K3 is exact unless --kl-clamp verl, verl's bounds, which the paper's K3 runs likely had (our
  inference: the paper does not say).
- Sec. 4.2's asynchronous runs used prime-rl (app. B), whose async level is a maximum lag;
  --async-lag N always trains N batches behind.
- The defaults are a run for a CPU (SmolLM2-135M-Instruct on arith); docs/gpu.md has the paper's.

Precision: fp32 master weights and AdamW state. The no-grad log-probs that feed the KL and the ratio
are fp32 (--logprob-dtype; on A100/H100-class cards fp32 from bf16 tensor cores,
systems/split_matmul.py): in bf16 their rounding alone puts a floor under every KL
(docs/precision.md). The gradient pass runs in bf16 autocast where the device has it and takes its
values from the fp32 pass, logp + sg[logp_fp32 - logp], so only the gradient's direction carries
bf16 rounding. Sampling uses a bf16 copy of the weights (runtime.make_sampler), refreshed after
every step; `mismatch_kl` measures the gap between sampler and trainer, so "on-policy" is measured,
not assumed. Distributed: torchrun gives DDP (gloo on CPU, NCCL on CUDA), --fsdp FSDP2. Each rank
samples its share of the prompts; `num_tokens` counts every rank's tokens, so a step's gradient is
the same for any --micro-batch and any number of ranks (test_train.py checks both to 1e-5).
Checkpoints and --resume: systems/checkpoint.py.

    python train.py --kl k1 --place reward          # SmolLM2-135M-Instruct on arith, on a CPU
    torchrun --nproc_per_node=8 train.py --kl k3 --place loss --fsdp --model Qwen/Qwen2.5-7B ...
"""
import collections
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm

import advantage
import data
import kl
import logprobs
import rollout
from flags import ADVANTAGES, check_flags, parser  # train.parser, train.check_flags: lab/, tests/
from systems import activations, checkpoint, optim, report, runtime
from systems.hub import HubUnreachable
from systems.metrics import importance_weights, step_metrics
from systems.model import load_model, load_tokenizer, stop_token_ids


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
    runtime.resolve_device_defaults(args, device)  # what a GPU run has yet to decide, as --dtype
    print0 = print if rank == 0 else lambda *a, **k: None
    torch.manual_seed(args.seed)
    # the sampler's random stream: each rank its own
    generator = torch.Generator(device=device).manual_seed(1000 * args.seed + rank)
    resume_from, trainer_state = checkpoint.open_run(args, rank, world_size)
    loaded = load(args, resume_from)
    runtime.stop_if_any_rank(loaded if isinstance(loaded, str) else None, "train.py")
    examples, eval_sets, tokenizer, policy, stop_ids = loaded
    sampler = runtime.make_sampler(policy, device, dtype, args.fsdp)  # rollout.generate, eval
    decoder = runtime.sampler_decoder(device, args.compile_sampler)  # a GPU's, else rollout's own
    # --recompute auto on a CPU: "none" where the memory allows (systems/activations.py)
    worst_shape, room = activation_room(args, policy, examples, tokenizer, world_size)
    args.recompute = runtime.recompute_choice(args.recompute, device, policy.config, worst_shape,
                                              room)
    runtime.checkpoint_activations(policy, args.recompute)  # --recompute
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
    print0(runtime.describe_run(args, policy, world_size, device, dtype, examples, resume_from))

    G, prompts_per_rank, bad_in_a_row = args.group_size, args.prompts_per_step // world_size, 0
    steps = range(start_step + 1, args.steps + 1)
    bar = tqdm(steps, initial=start_step, total=args.steps, disable=rank != 0)
    for step in bar:
        # ------------------------------------------------------------ rollout
        t0 = time.time()
        # --async-lag N: the batch trained on was sampled N updates ago (the first ones by the
        # initial weights), so N + 1 batches are sampled ahead, each with the step of its weights
        while len(queue) <= args.async_lag:
            problems = data.prompt_batch(examples, position + rank * prompts_per_rank,
                                         prompts_per_rank, args.seed)
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
                                   decoder=decoder)
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
        # under every KL and ratio); the policy's from the gradient pass itself where that is exact
        policy_logp, entropy, graph_logp = policy_logprobs(args, policy, prompts, tokens, mask,
                                                           logprob_dtype, room)
        ref_logp = policy_logp if reference is None else logprobs.no_grad_logprobs(
            reference, prompts, tokens, mask, args.temperature, logprob_dtype, args.micro_batch,
            by_segments=args.by_segments, share_prefix=args.share_prefix)[0]

        # ------------------------------------------------------------ shape (eq. 7)
        # Table 1: K1-in-reward, K3-in-reward, both (--place reward; both adds the loss's term
        # below): the return R - beta * sum_t sg[KL_t], the KL's gradient a score function
        # through the advantage (eq. 8)
        returns = kl.shape_rewards(scores, policy_logp, ref_logp, mask, args.kl, args.place,
                                   args.beta, args.kl_clamp)

        # ------------------------------------------------------------ advantage
        # mu, the policy that sampled: the sampler's own log-probs, or (--behaviour trainer, lag 0)
        # the fp32 pass at the same weights
        behaviour_logp = out.token_logprobs if args.behaviour == "sampler" else policy_logp
        # RLOO (sec. 4.1): A_i = return_i - mean of the other G - 1 returns of the same prompt
        batch = Batch(prompts, tokens, mask, policy_logp, ref_logp, behaviour_logp,
                      ADVANTAGES[args.advantage](returns, G), graph_logp)

        # ------------------------------------------------------------ loss and step (update)
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
            from eval import pass1_row  # here: only runs with --eval-every need eval.py
            row.update(pass1_row(args, sampler, decoder, tokenizer, eval_sets, len(prompts), rank,
                                 world_size))
        if rank == 0:
            checkpoint.log_row(metrics_path, row)
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
            checkpoint.save_run(args, step, position, world_size, policy, tokenizer, optimizer,
                                generator, queue, rank)

    report.close()
    checkpoint.save_run(args, max(args.steps, start_step), position, world_size, policy, tokenizer,
                        optimizer, generator, queue, rank, name="final")
    print0(f"saved {args.out / 'final'}")
    runtime.finish()


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
    # policy_logp with its graph, a (rows, T) tensor for each micro-batch by its first row, where
    # the log-probs step kept them for the update (policy_logprobs); else None
    graph_logp: dict = None


def update(args, policy, optimizer, batch, minibatch, first):
    """One AdamW step on the rows `minibatch` of the step's batch: the PPO-clip (or truncated IS)
    surrogate of eq. 4 plus the KL loss of eq. 9 where --place puts it, both normalized by the
    minibatch's response tokens on all ranks. Accumulates over micro-batches. Returns ([pg_loss,
    kl_loss, clip_frac] summed over ranks, grad norm, whether the step was taken: a non-finite loss
    or gradient skips it)."""
    mask, advantages = batch.mask, batch.advantages
    no_grad_logp = minibatch_logprobs(args, policy, batch, minibatch, first)
    num_tokens = optim.tokens_on_all_ranks(mask[minibatch])  # both losses' normalizer (sec. 4.1)
    log_weight_cap, log_weight_normalizer = is_weight_bounds(args, batch, minibatch, no_grad_logp)
    sums = torch.zeros(3, dtype=torch.float64, device=batch.tokens.device)
    for rows, gradient_sync in optim.micro_batches(args, policy, batch.prompts, minibatch):
        with gradient_sync:
            # log-probs: log pi(y_t | x, y<t) with a gradient, valued at no_grad_logp
            logp = gradient_logprobs(args, policy, batch, rows, no_grad_logp[rows - minibatch[0]])
            # the ratio's old policy: on-policy (one minibatch, no lag) sg[logp], so the ratio is
            # exactly 1; else mu, the policy that sampled
            on_policy = args.minibatches == 1 and not args.async_lag
            old_logp = logp.detach() if on_policy else batch.behaviour_logp[rows]

            # policy loss, eq. 4: -min(w_t A, clip(w_t, 1 - eps, 1 + eps) A), w_t = pi / pi_old
            if args.loss == "ppo":
                pg_loss, clip_frac = advantage.policy_loss(
                    logp, old_logp, advantages[rows], mask[rows], num_tokens, args.clip_eps)
            else:  # prime-rl's -min(w_t, C) A; clip_frac: the truncated fraction
                pg_loss, clip_frac = advantage.truncated_is_loss(
                    logp, old_logp, advantages[rows], mask[rows], num_tokens, args.is_cap)

            # KL loss
            if args.place == "weighted":
                # Table 1: weighted (beside the table): w sg[K1], w = prod_t pi/mu, unbiased
                # off-policy
                kl_loss = kl.off_policy_kl_loss(logp, batch.behaviour_logp[rows],
                                                batch.ref_logp[rows], mask[rows], args.beta,
                                                num_tokens, log_weight_cap, log_weight_normalizer)
            else:
                # Table 1: K1-in-loss, K3-in-loss, both (--place loss; both adds the reward's
                # term): beta * sum_t KL_t / num_tokens, its gradient path-wise (eq. 9); else 0
                kl_loss = kl.kl_loss(logp, batch.ref_logp[rows], mask[rows], args.kl, args.place,
                                     args.beta, num_tokens, args.kl_clamp)

            optim.backward_over_ranks(pg_loss + kl_loss)
        sums += torch.stack([pg_loss.detach(), kl_loss.detach(), clip_frac]).double()
    return optim.optimizer_step(args, policy, optimizer, sums)


# ---------------------------------------------------------------- log-probs' bookkeeping
def policy_logprobs(args, policy, prompts, tokens, mask, logprob_dtype, room):
    """(log pi_theta (B, T) in --logprob-dtype, no grad; its entropy; the same log-probs with their
    graphs by micro-batch, or None). On-policy (one minibatch, no lag) with --dtype equal to
    --logprob-dtype, one process on a CPU (not under DDP or FSDP), the gradient pass computes
    these very values at these very weights: there the pass runs once, here, and the update
    takes each micro-batch's graph (--one-policy-pass; where every graph fits the memory
    budget, systems/activations.py). Elsewhere a no-grad pass, and the update a pass of its own."""
    if not one_policy_pass(args, policy, prompts, mask, logprob_dtype, room):
        return (*logprobs.no_grad_logprobs(
            policy, prompts, tokens, mask, args.temperature, logprob_dtype, args.micro_batch,
            entropy=True, by_segments=args.by_segments, share_prefix=args.share_prefix), None)
    graphs, entropies, start = {}, [], 0
    for size in logprobs.micro_batch_sizes(prompts, args.micro_batch):
        rows = slice(start, start + size)
        graphs[start], entropy = logprobs.token_logprobs(
            policy, prompts[rows], tokens[rows], mask[rows], args.temperature, logprob_dtype,
            entropy=True, share_prefix=args.share_prefix)
        entropies.append(entropy)
        start += size
    return torch.cat([logp.detach() for logp in graphs.values()]), torch.cat(entropies), graphs


def one_policy_pass(args, policy, prompts, mask, logprob_dtype, room):
    """Whether the log-probs step's policy pass is also the update's (policy_logprobs)."""
    device = mask.device
    return (args.one_policy_pass and device.type == "cpu" and args.minibatches == 1
            and not args.async_lag and not args.by_segments
            and runtime.pass_dtypes(args, device)[0] == logprob_dtype
            and runtime.unwrap(policy) is policy and not isinstance(policy, FSDPModule)
            and activations.keeps_graphs(policy.config, activations.micro_batch_shapes(
                policy.config, prompts, mask, args.micro_batch, args.share_prefix),
                args.recompute, room))


# ---------------------------------------------------------------- update's bookkeeping
def minibatch_logprobs(args, policy, batch, minibatch, first):
    """The minibatch's log-probs in --logprob-dtype under the current weights: policy_logp until the
    first update, then a no-grad pass of their own (only if the gradient pass runs in another
    dtype, or the self-normalized weight needs them)."""
    dtype, logprob_dtype = runtime.pass_dtypes(args, batch.tokens.device)
    self_normalized = args.place == "weighted" and args.is_weight == "self-normalized"
    if first or (dtype == logprob_dtype and not self_normalized):
        return batch.policy_logp[minibatch]
    return logprobs.no_grad_logprobs(
        policy, [batch.prompts[r] for r in minibatch], batch.tokens[minibatch],
        batch.mask[minibatch], args.temperature, logprob_dtype, args.micro_batch,
        by_segments=args.by_segments, share_prefix=args.share_prefix)[0]


def gradient_logprobs(args, policy, batch, rows, no_grad_logp):
    """log pi(y_t | x, y<t) of the rows with a gradient, in --dtype (bf16 autocast where the device
    has it) and valued at no_grad_logp (--logprob-dtype's pass): logp + sg[no_grad_logp - logp], so
    the losses' values are that pass's; only the gradient's direction carries --dtype's rounding."""
    if batch.graph_logp:  # the log-probs step's pass, its values no_grad_logp's already
        return batch.graph_logp.pop(int(rows[0]))
    dtype, logprob_dtype = runtime.pass_dtypes(args, batch.tokens.device)
    logp, _ = logprobs.token_logprobs(policy, [batch.prompts[r] for r in rows], batch.tokens[rows],
                                      batch.mask[rows], args.temperature, dtype,
                                      by_segments=args.by_segments, share_prefix=args.share_prefix)
    if dtype != logprob_dtype:  # no_grad_logp's values, this pass's gradient
        logp = logp + (no_grad_logp - logp).detach()
    return logp


def is_weight_bounds(args, batch, minibatch, no_grad_logp):
    """--place weighted's w = prod_t pi/mu: (log of its cap, log of its normalizer). Capped at e^30
    (exact) or at C (truncated); --is-weight self-normalized divides it by mean_j w_j over the
    minibatch on all ranks (else log 1 = 0)."""
    max_log_w = math.log(args.is_cap) if args.is_weight == "truncated" else kl.MAX_LOG_W
    if args.place != "weighted" or args.is_weight != "self-normalized":
        return max_log_w, 0.0
    log_w = kl.log_importance_weights(no_grad_logp, batch.behaviour_logp[minibatch],
                                      batch.mask[minibatch])
    return max_log_w, importance_weights(log_w, batch.tokens.device)["log_mean_w"]


# ---------------------------------------------------------------- set-up and saving
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


def activation_room(args, policy, examples, tokenizer, world_size):
    """(the largest micro-batch this run can make, the bytes its activations may take on a CPU),
    systems/activations.py's; the prompts' length: the longest of the first 64 examples."""
    prompt_tokens = max(len(data.prompt_ids(tokenizer, example)) for example in examples[:64])
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    worst = activations.worst_shape(prompt_tokens, args.group_size, args.micro_batch,
                                    args.prompts_per_step // world_size * args.group_size,
                                    args.max_new_tokens)
    num_params = sum(p.numel() for p in policy.parameters())
    reference = args.place != "none" and args.beta != 0
    return worst, activations.budget(num_params, reference, local_ranks,
                                     world_size if args.fsdp else 1)


def reference_model(args, device):
    """pi_ref: the initial policy, frozen, in fp32 like the policy's no-grad pass; None when no KL
    is used (--place none or --beta 0)."""
    if args.place == "none" or args.beta == 0:
        return None
    reference = load_model(args.model, torch.float32, args.trust_remote_code)
    reference.requires_grad_(False)
    return runtime.shard(reference) if args.fsdp else reference.to(device)


if __name__ == "__main__":
    main()
