"""Advantages and the policy-gradient loss (paper sec. 2 and 4.1).

The paper trains with REINFORCE leave-one-out advantages (RLOO, Ahmadian et al. 2024) and a loss
normalized by the total number of response tokens in the batch (sec. 4.1); `policy_loss` is the
PPO-clip surrogate of eq. 4 (sec. 2) with that normalization. Sequences are laid out in contiguous
groups of `group_size` samples of the same prompt. For comparison, `group_mean` (Dr. GRPO: Z. Liu et
al. 2025, arXiv 2503.20783, the paper's sec. 4.2) and `group_normalized` (GRPO, Shao et al. 2024)
baselines are one function each.
"""

import math

import torch


def _groups(returns, group_size):
    if group_size < 2 or returns.numel() % group_size:
        raise ValueError(f"group_size must be >= 2 and divide the batch ({returns.numel()}), "
                         f"got {group_size}")
    return returns.detach().reshape(-1, group_size)


def rloo(returns, group_size):
    """A_i = R_i - mean_{j != i} R_j within each group; its baseline adds no expected gradient."""
    R = _groups(returns, group_size)
    # A_i = R_i - (sum_j R_j - R_i) / (G - 1)
    return (R - (R.sum(1, keepdim=True) - R) / (group_size - 1)).reshape(-1)


def group_mean(returns, group_size):
    """Dr. GRPO: A_i = R_i - mean_j R_j (includes R_i, so E[grad] shrinks by (G - 1) / G)."""
    R = _groups(returns, group_size)
    return (R - R.mean(1, keepdim=True)).reshape(-1)


def group_normalized(returns, group_size, eps=1e-6):
    """GRPO: A_i = (R_i - mean_j R_j) / (std_j R_j + eps), the group-normalized advantage."""
    R = _groups(returns, group_size)
    return ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + eps)).reshape(-1)


def policy_loss(logp, old_logp, advantages, mask, num_tokens, clip_eps=0.2):
    """PPO-clip surrogate summed over tokens / num_tokens -> (loss, clip_frac). The ratio and clip
    are eq. 4's; the normalization by the batch's response tokens is sec. 4.1's (eq. 4 itself
    averages each sequence over its own length).

    logp, old_logp, mask: (B, T) per token; advantages: (B,) one per sequence (eq. 7, A_t = A for
    all t) or (B, T) one per token (a per-token KL reward, kl.kl_to_go). On-policy (old_logp =
    logp.detach()) the gradient is -(1/num_tokens) sum_i A_i grad log pi(y_i). clip_frac =
    sum(mask * clipped) / num_tokens, with clipped = tokens whose clipped branch is active (their
    gradient is zero), so summing it over micro-batches and ranks gives the global fraction.
    """
    # eq. 4: ratio w_t = pi(y_t | y<t) / pi_old(y_t | y<t)
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.detach()
    adv = adv if adv.dim() == 2 else adv.unsqueeze(-1)
    # eq. 4: -min(w_t A, clip(w_t, 1 - eps, 1 + eps) A)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = (mask * torch.maximum(unclipped, clipped)).sum() / num_tokens
    clip_frac = (mask * (clipped > unclipped)).sum().detach() / num_tokens
    return loss, clip_frac


def truncated_is_loss(logp, behaviour_logp, advantages, mask, num_tokens, cap=8.0):
    """prime-rl's loss for asynchronous samples -> (loss, truncated_frac): -min(w_t, cap) A per
    token, w_t = pi(y_t | y<t) / mu(y_t | y<t) against the behaviour policy mu that sampled, no
    epsilon clip; summed over tokens / num_tokens like policy_loss. Its gradient is -w_t A grad log
    pi(y_t | y<t) where w_t <= cap, else 0; truncated_frac = sum(mask * (w_t > cap)) /
    num_tokens."""
    log_ratio = logp - behaviour_logp.detach()
    # (B,) per sequence -> (B, 1), broadcast over tokens; (B, T) per token (kl.kl_to_go) as it is
    adv = advantages.detach().reshape(len(advantages), -1)
    # -min(w_t, C) A_t: the truncated importance weight, as exp(min(log w_t, log C)): the same value
    # and gradient, and no exp(log w_t) to overflow
    loss = (mask * -torch.exp(log_ratio.clamp(max=math.log(cap))) * adv).sum() / num_tokens
    truncated_frac = (mask * (log_ratio > math.log(cap))).sum().detach() / num_tokens
    return loss, truncated_frac
