"""metrics.jsonl's row: what train.py logs of a step (docs/training.md lists the keys), summed
over all ranks. Besides the reward and the KL to the reference (K1 and K3 per sequence, eq. 5),
how far the sampler mu was from the policy pi trained on its samples: the per-token ratio pi/mu and
the sequence-level importance weight w = prod_t pi/mu with its effective sample size."""
import math

import numpy as np
import torch

import kl
from systems import runtime


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
