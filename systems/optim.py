"""The update's bookkeeping over ranks and micro-batches, which train.update calls: the token count
both losses divide by (every rank's), the micro-batches and the context each backward runs in, the
backward scaled for the ranks' averaging, and the optimizer step that skips a non-finite loss or
gradient. With these, a step's gradient is the same for any --micro-batch and any number of ranks
(test_train.py checks both to 1e-5).
"""
import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import logprobs
from systems import runtime, segment_attention


def tokens_on_all_ranks(mask):
    """num_tokens: the response tokens of `mask` summed over all ranks."""
    num_tokens = mask.sum()
    if dist.is_initialized():
        dist.all_reduce(num_tokens)
    return num_tokens


def micro_batches(args, policy, prompts, minibatch):
    """The minibatch's micro-batches of rows (--micro-batch sequences, each RLOO group whole: rows
    of `prompts`), each with the context its backward runs in: DDP all-reduces gradients in the
    backward of the last micro-batch only (no_sync in the others). By sequences, the policy attends
    by segments until the backward ends: --recompute runs the forward again there."""
    parts = minibatch.split(
        logprobs.micro_batch_sizes([prompts[r] for r in minibatch], args.micro_batch))
    for i, rows in enumerate(parts):
        no_sync = isinstance(policy, DDP) and i < len(parts) - 1
        with segment_attention.attention(policy) if args.by_segments else contextlib.nullcontext():
            yield rows, policy.no_sync() if no_sync else contextlib.nullcontext()


def backward_over_ranks(loss):
    """loss.backward(), scaled by the number of ranks: DDP and FSDP average gradients over the
    ranks, and num_tokens counts all ranks' tokens already, so the step's gradient is the sum over
    every rank's tokens / num_tokens, whatever the number of ranks."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    (loss * world_size).backward()


def optimizer_step(args, policy, optimizer, sums):
    """Clip the gradient's norm to --max-grad-norm and take the AdamW step, unless the loss or the
    gradient is not finite. Returns (the sums of [pg_loss, kl_loss, clip_frac] over all ranks,
    the grad norm before clipping, whether the step was taken)."""
    losses = list(runtime.all_reduce_sums(
        dict(zip(("pg_loss", "kl_loss", "clip_frac"), sums.tolist())), sums.device).values())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
    # a non-finite loss or gradient (K3-in-reward's r = pi_ref/pi can overflow): skip the update,
    # show it in the log, do not crash
    stepped = math.isfinite(grad_norm) and math.isfinite(sum(losses))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, grad_norm, stepped
