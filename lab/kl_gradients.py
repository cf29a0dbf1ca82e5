"""Table 1 measured on a real LLM: the bias and variance of each configuration's KL gradient (paper
sec. 3, Table 1, eqs. 6-16, 29, 41, 45), on SmolLM2-135M-Instruct and the `arith` task.

pi_ref is the base model; pi the same after N steps of no-KL RLOO training on `arith` (train.main,
--kl k1 --place none, checkpoints step_N), or any --policy DIR. For each distance:

1. Samples. Groups of G responses y ~ pi (temperature 1, rollout.generate with the fp32 policy) to
   prompts drawn uniformly, with replacement, from the held-out split: the groups are i.i.d.
2. The trainer's estimators (the sampled rows). For each group, the loss train.py builds with the
   task score set to 0: kl.shape_rewards -> advantage.rloo -> advantage.policy_loss + kl.kl_loss
   (on-policy, ratio 1), log-probs from logprobs.token_logprobs in fp32. Autograd gives its
   coefficients dloss/dlogp (B, T) through the real functions and one vector-Jacobian product
   through the model the parameter gradient. `task_pg`: the real score, no KL.
3. Exact per-prefix estimators (the exact rows; issue 27). At each visited prefix h_t = (x, y<t),
   with p = pi(.|h_t) and q = pi_ref(.|h_t) over the whole vocabulary and KL_t = KL(p || q):
     p3   sum_t sum_v (p_v - q_v) grad log p_v = sum_t grad KL(q || p)   E = E[K3-in-loss] (eq. 41)
     p2   sum_t sum_v p_v (log p_v/q_v - KL_t) grad log p_v             E = E[K2-in-loss]
          (the path-wise gradient of KL_t at h_t, the prefix's tokens held fixed)
     f    sum_s grad log p(y_s|h_s) (sum_{t>s} KL_t - b_s)              the score-function part
     verl as p2 + f - p3 with K3 clamped as verl's low_var_kl           E = E[K3-in-reward, clamp]
   grad KL = E[p2 + f] (eq. 29, each K1_t replaced by E[K1_t | h_t] = KL_t), E[K3-in-reward] =
   E[p2 + f - p3] (eq. 45 at every prefix), K1-in-loss's is 0 (eq. 13). No score-function noise
   in p2, p3, and no pi_ref/pi tail in any (the ratio is summed over the vocabulary, not
   sampled). b_s, f's baseline, is the mean KL to go at position s of the group's other sequences
   that reach position s (0 if none): a function of the other sequences only, so f stays exactly
   unbiased (tests/test_kl_gradients.py enumerates every group of the toy model). `f_plain` is f
   without it.
   Each sampled row is checked against its exact expectation (EXPECTED). Per prefix also:
   chi^2(q || p) = sum_v q_v^2 / p_v - 1, the exact variance of the ratio pi_ref/pi at that token
   (K3's tail), and verl's clamp deficit sum_v p_v (K3_v - clamped K3_v). And K3's value checked
   without its tail: per sequence, the sampled K3 over the tokens whose ratio pi_ref / pi is at most
   R (at most max(R - 1 - log R, log pi/pi_ref) a token: no tail of large ratios) against its exact
   expectation sum_t sum_{v: r_v <= R} p_v K3_v, and the expected number of tokens over R, for R in
   TAIL_RATIOS. With --grad-tail R,... the same for the gradient rows (issue 36, item 2): K3-in-loss
   and K3-in-reward through the trainer's functions with K3 counted on the sampled tokens of ratio
   <= R only (no tail of large ratios: |1 - r| <= R), each minus its exact expectation (p3 over
   {v: r_v <= R}; eq. 45's row with K3 1{r <= R}), one row each: E = 0.
4. Scale. beta = 1 and num_tokens = G: each group's vector is a per-sequence estimate in nats
   (eq. 6); beta multiplies every row alike (no cosine or relative bias depends on it).
5. Dimensions (kl_coords.py). Gradients w.r.t. the last decoder layer, a fixed random subset of
   --coords coordinates in each of its attention and MLP blocks. Each block is a view of its own,
   and the layer is a third: the two blocks' inner products reweighted by parameters per kept
   coordinate (0.88M / 16,384 and 2.65M / 16,384), an unbiased estimate of the whole layer's
   (issue 27, item 3). --layers whole (issue 36): every parameter, the tied embedding once; the
   same last-layer blocks (the same coordinates) and 2 x --coords more over the rest of the model
   in four blocks, stratified by size; views "layer" and "model" (and every block, every layer's
   attention, every layer's MLP) from the same groups, so the two compare paired. Its entries come
   from each module's input and output gradient (kl_coords.entry_gradients: no full gradient).
6. Statistics (kl_stats.py): U-statistics over pairs of distinct units, intervals from their
   Hoeffding decomposition. Per biased row: cos(E[g], grad KL), ||bias|| / ||grad KL||,
   n* = tr Var / ||bias||^2 (one sequence's variance of the sampled row: the batch size at which its
   squared bias overtakes its noise, Fig. 1 on the LLM); f's share of grad KL; each sampled row
   against its exact expectation; with --layers whole, per biased row the model's cosine minus
   the layer's (paired); with --grad-tail, each truncated row's check.
7. Chunks (lab/kl_chunks.py). Groups are sampled in chunks seeded by (--seed, distance, chunk) and
   saved under --chunks as they finish, so a stopped run resumes, and more --groups extends it. Each
   chunk records pi's hash and the machine (CPU, its flags, GPU): another kind of CPU trains another pi
   (bf16 rounds differently), and chunks of another pi or machine are never pooled (refused).
8. At scale (--batch-groups B > 1, GPUs). B groups in one pass: token_logprobs packs each group
   into one sequence, and a Linear's weight gradient is sum_l delta_l a_l^T, so per-pack products
   give every group's gradient exactly (batch_gradients, tested against group_gradients). Each
   batch's mean is then one unit (var = G B tr Cov of a unit). --layers whole batches the same way
   (packed_gradients: per pack, each module's input and output gradient).

    python -m lab.kl_gradients              # trains pi if absent, then steps 20 and 5, 1,536 groups
    python -m lab.kl_gradients --analyze    # the statistics of the saved chunks only
    python -m lab.kl_gradients --device cuda --groups 8192 --batch-groups 32 \\
        --chunks runs/kl-gradients/chunks-gpu --out studies/kl-gradients-gpu
    python -m lab.kl_gradients --layers whole --grad-tail 10,100 --groups 768 \\
        --chunks runs/kl-gradients-whole/chunks --out studies/kl-gradients-whole \\
        --figure studies/kl-gradients-whole/figure.png    # issue 36: the whole model
"""
import argparse
import functools
import json
import math
import random
import re
import resource
import time
from pathlib import Path

import numpy as np
import torch

import advantage
import data
import kl
import logprobs
from lab import kl_coords
from lab.kl_chunks import (chunk_seed, load_distance, policy_hash, run_key, save_chunk,
                            saved_chunks)
from lab import kl_stats as S
from lab.kl_coords import choose_subsets, coordinates  # noqa: F401 (the script's API)
import rollout
from lab import study
import train
from systems import runtime
from systems.model import load_model, load_tokenizer, stop_token_ids

# name: (estimator, place, clamp, KL to go)
CONFIGS = {"k1_reward": ("k1", "reward", "none", False), "k1_loss": ("k1", "loss", "none", False),
           "k1_both": ("k1", "both", "none", False), "k3_reward": ("k3", "reward", "none", False),
           "k3_loss": ("k3", "loss", "none", False), "k3_both": ("k3", "both", "none", False),
           "k2_loss": ("k2", "loss", "none", False),
           "k3_reward_verl": ("k3", "reward", "verl", False),
           "k1_to_go": ("k1", "none", "none", True), "task_pg": ("k1", "none", "none", False)}
SUMS = {"k1_both": ("k1_reward", "k1_loss"), "k3_both": ("k3_reward", "k3_loss")}  # sec. 4.3
EXACT = ("p2", "p3", "f", "f_plain", "verl")  # the exact per-prefix rows (docstring, step 3)
ROWS = list(CONFIGS) + list(EXACT)  # X[:, i] is row ROWS[i]
EXPECTED, BIASED = S.EXPECTED, S.BIASED  # each sampled row's expectation in the exact rows
# K3's tail: the sampled K3 without the tokens whose ratio pi_ref / pi exceeds R, against its exact
# expectation (no tail of large ratios: its check can pass where the whole K3's cannot)
TAIL_RATIOS = (10, 100, 1000)

parser = argparse.ArgumentParser(description="The bias and variance of every Table 1 "
                                             "configuration's KL gradient on a real LLM.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
group = parser.add_argument_group("models")
group.add_argument("--model", default="smollm2-135m",
                   help="pi_ref, and the model trained into pi (a hub id, a directory, "
                        "smollm2-135m)")
group.add_argument("--policy", default=None,
                   help="measure this policy directory against --model instead of training one")
group.add_argument("--steps", default="20,5",
                   help="distances, in this order: checkpoints step_N of a no-KL run on arith, "
                        "trained if absent")
group.add_argument("--train-dir", default="runs/kl-gradients/no-kl-seed0",
                   help="the no-KL training run (train.py --kl k1 --place none --save-every 5)")
group = parser.add_argument_group("samples")
group.add_argument("--groups", type=int, default=1536,
                   help="groups of G responses per distance (rounded up to whole chunks)")
group.add_argument("--chunk-groups", type=int, default=32,
                   help="groups per chunk: the unit of saving, resuming and seeding")
group.add_argument("--group-size", type=int, default=4, help="G, the RLOO group (train.py's)")
group.add_argument("--prompts-per-batch", type=int, default=8,
                   help="groups sampled together (rollout.generate's batch)")
group.add_argument("--batch-groups", type=int, default=1,
                   help="groups differentiated in one pass (GPUs: 32); above 1 each batch's mean "
                        "gradient is one unit of the statistics")
group.add_argument("--max-new-tokens", type=int, default=40, help="response length cap")
group = parser.add_argument_group("coordinates")
group.add_argument("--layers", default="-1.self_attn,-1.mlp",
                   help="one block per entry, INDEX or INDEX.SUBMODULE of the decoder layers (the "
                        "last layer's attention, its MLP), or 'all': two disjoint random subsets "
                        "of the whole parameter vector, or 'whole': every parameter, the last "
                        "layer's blocks as the default's and the rest of the model in four "
                        "(kl_coords.py)")
group.add_argument("--coords", type=int, default=16384,
                   help="random coordinates kept per block (0: all of the block's; 'whole': 2x "
                        "this over the rest of the model)")
group.add_argument("--grad-tail", default="",
                   help="ratios R, comma-separated (e.g. 10,100): per R two more rows, the "
                        "sampled K3-in-loss and K3-in-reward over the tokens of ratio pi_ref / pi "
                        "<= R minus their exact expectations (issue 36, item 2)")
group.add_argument("--presets", default="",
                   help="more sampled rows: KL terms of lab/kl_presets.py (IDs, comma-separated, "
                        "or 'unmatched': those whose exact toy verdict equals no row above), "
                        "each through lab/check_kl.py's loss (issue 60, item 4)")
group.add_argument("--basis", default="coords", choices=("coords", "displacement"),
                   help="coords: --coords random coordinates per block; displacement: per row of "
                        "each matrix, the component along theta_pi - theta_ref")
group = parser.add_argument_group("run")
group.add_argument("--device", default="cpu", help="cpu or cuda")
group.add_argument("--seed", type=int, default=0, help="seeds prompts, samples (with the "
                                                       "distance and chunk), coordinates")
group.add_argument("--chunks", default="runs/kl-gradients/chunks",
                   help="directory of the saved chunks (per-group gradients, ~2 MB a group)")
group.add_argument("--out", default="studies/kl-gradients-exact",
                   help="directory for results.json and results.csv")
group.add_argument("--figure", default="assets/kl_gradients_exact.png", help="the figure's path")
group.add_argument("--reverse", action="store_true",
                   help="sample the chunks last first, passing over any saved meanwhile: two "
                        "processes, one with --reverse, share a distance")
group.add_argument("--analyze", action="store_true",
                   help="no sampling: the statistics of the chunks already saved under --chunks")
group.add_argument("--replot", action="store_true",
                   help="only redraw --figure from OUT/results.json")


# ---------------------------------------------------------------- the trainer's estimators

def config_loss(name, logp, ref_logp, mask, scores, group_size, beta, num_tokens):
    """The loss train.py minimizes for one configuration, on-policy (old_logp = sg[logp])."""
    kind, place, clamp, to_go = CONFIGS[name]
    # eq. 7: R - beta sum_t sg[KL_t] (reward, both); R otherwise
    returns = kl.shape_rewards(scores, logp, ref_logp, mask, kind, place, beta, clamp)
    advantages = advantage.rloo(returns, group_size)
    if to_go:  # OpenRLHF: A_t = rloo(R) - beta sum_{s>=t} KL_s (docs/peers.md)
        advantages = advantages[:, None] - beta * kl.kl_to_go(logp, ref_logp, mask, kind, clamp)
    pg_loss, _ = advantage.policy_loss(logp, logp.detach(), advantages, mask, num_tokens)
    # eq. 9: + beta sum_t KL_t / num_tokens (loss, both)
    return pg_loss + kl.kl_loss(logp, ref_logp, mask, kind, place, beta, num_tokens, clamp)


def coefficients(logp, ref_logp, mask, scores, group_size, beta=1.0, num_tokens=None, names=None):
    """dloss/dlogp (B, T) of each configuration's loss: the gradient of the loss w.r.t. the
    parameters is sum_{i,t} coefficient_it grad log pi(y_it | x, y<t). The KL rows get score 0."""
    num_tokens = group_size if num_tokens is None else num_tokens
    result = {}
    for name in names or CONFIGS:
        leaf = logp.detach().clone().requires_grad_()
        score = scores if name == "task_pg" else torch.zeros_like(scores)
        loss = config_loss(name, leaf, ref_logp.detach(), mask, score, group_size, beta, num_tokens)
        result[name] = torch.autograd.grad(loss, leaf)[0]
    return result


# ---------------------------------------------------------------- any KL term (lab/check_kl.py's)

# row name -> (term, place, aggregate, ratio): --presets, or lab/check_kl.py --model's term
TERMS = {}
# the row each known exact gradient of lab/check_kl.py is in the exact rows (EXPECTED's terms)
KNOWN_ROWS = {"grad KL": {"g": 1}, "0": {}, "K3-in-loss": {"p3": 1},
              "token-level reverse KL": {"g": 1, "f": -1}, "K3-in-reward": {"g": 1, "p3": -1}}
# the exact rows' configurations: a preset equal to one of them on the toy inherits its row
MEASURED = set(KNOWN_ROWS)


def preset_terms(spec):
    """{row: (term, place, aggregate, ratio)} of --presets: IDs of lab/kl_presets.py, or
    "unmatched", every preset whose exact on-policy verdict is none of MEASURED's (and not verl's
    clamped K3-in-reward, a row of its own here)."""
    from lab import check_kl, kl_presets
    ids = [i for i in spec.split(",") if i]
    if ids == ["unmatched"]:
        ids = [i for i, p in kl_presets.PRESETS.items() if i != "verl-k3plus-reward"
               and check_kl.check(p["term"], p["place"], p["aggregate"] or "token-mean",
                                  p["ratio"] or "token")["on_policy"]["equals"] not in MEASURED]
    unknown = [i for i in ids if i not in kl_presets.PRESETS]
    if unknown:
        raise SystemExit(f"--presets: unknown {', '.join(unknown)} (lab/kl_presets.py)")
    return {f"preset:{i}": (p["term"], p["place"], p["aggregate"] or "token-mean",
                            p["ratio"] or "token")
            for i, p in ((i, kl_presets.PRESETS[i]) for i in ids)}


def term_parent(term, place, aggregate, ratio):
    """The known gradient a term equals on the toy at its near settings (all four, else the two
    of fixed length; lab/check_kl.SETTINGS), or None: the row its measurement is paired with."""
    from lab import check_kl
    by_setting = check_kl.check(term, place, aggregate, ratio)["on_policy"]["equals_by_setting"]
    near = [by_setting[name] for name in check_kl.SETTING_NAMES if "far" not in name]
    for names in (near, near[:2]):  # SETTING_NAMES: T=3, T=5, EOS<=3, EOS<=5 first
        if names[0] is not None and len(set(names)) == 1:
            return names[0]
    return None


def term_coefficients(logp, ref_logp, mask, group_size, num_tokens=None):
    """dloss/dlogp (B, T) of each TERMS row, on-policy (old_logp = sg[logp]), no task score:
    check_kl.token_losses with RLOO's baseline in the reward places, summed over tokens / G like
    the rows above. seq-mean weighs each token 1 / T_y: the constant E[T] that the checker undoes
    is applied at the analysis (term_scales), from the distance's measured mean length."""
    from lab import check_kl
    num_tokens = group_size if num_tokens is None else num_tokens
    ref, m = ref_logp.detach().double(), mask.double()
    result = {}
    for name, (term, place, aggregate, ratio) in TERMS.items():
        leaf = logp.detach().double().clone().requires_grad_()
        weight = m / m.sum(-1, keepdim=True).clamp(min=1) if aggregate == "seq-mean" else m
        losses = check_kl.token_losses(term, place, ratio, leaf, ref, leaf.detach(), m,
                                       group_size)
        loss = (weight * losses).sum() / num_tokens
        result[name] = torch.autograd.grad(loss, leaf)[0].to(logp.dtype)
    return result


@functools.lru_cache(maxsize=None)  # asked once a group (term_exact_coefficients): checked once
def elementwise(term):
    """Whether the term is a function of each token's (logp, ref_logp, old_logp) alone, in value
    and gradient (random inputs, on- and off-policy, as (4, 6) and as (24, 1)): then its exact
    per-prefix expectation sums it over the vocabulary (term_exact_coefficients)."""
    from lab import check_kl
    generator = torch.Generator().manual_seed(0)
    logp, ref_logp, old_logp = (-3 * torch.rand(3, 4, 6, generator=generator,
                                                dtype=torch.float64))
    for old in (None, old_logp):
        results = []
        for shape in ((4, 6), (24, 1)):
            leaf = logp.reshape(shape).clone().requires_grad_()
            behaviour = leaf.detach() if old is None else old.reshape(shape)
            try:
                value = check_kl.call_term(term, leaf, ref_logp.reshape(shape), behaviour,
                                           torch.ones(shape, dtype=torch.float64), False)
                grad = torch.autograd.grad(value.sum(), leaf, allow_unused=True)[0]
            except (check_kl.TermError, RuntimeError):
                return False
            grad = torch.zeros_like(leaf) if grad is None else grad
            results.append((value.detach().reshape(-1), grad.reshape(-1)))
        if not all(torch.allclose(a, b, rtol=1e-12, atol=1e-12)
                   for a, b in zip(*results)):
            return False
    return True


def has_exact_row(term, place, aggregate, ratio):
    """An exact per-prefix row for the term: elementwise, and summed over tokens (not seq-mean,
    whose 1 / T_y depends on the tokens to come)."""
    return aggregate != "seq-mean" and elementwise(term)


def term_exact_coefficients(logp_all, ref_all, mask, group_size, num_tokens=None):
    """{"exact:" + row: (c_all (B, T, V), c_token (B, T) or None)}: for each TERMS row with an
    exact form (has_exact_row), its expectation over the sampled tokens given each prefix, the
    term evaluated at every token of the vocabulary (on-policy, old_logp = logp):
      loss places   sum_v p_v d term_v / d logp_v grad log p_v               (eq. 9's, per prefix)
      reward places sum_v p_v (k_v - kbar) grad log p_v at s, and the score part with the mean
                    term to go after s, kbar_t = sum_v p_v k_v, as the "verl" row (eq. 45)
    Rows of another term are absent (their sampled row only)."""
    num_tokens = group_size if num_tokens is None else num_tokens
    lp, lq, m = logp_all.detach().double(), ref_all.detach().double(), mask.double()
    B, T, V = lp.shape
    p, w = lp.exp(), (m / num_tokens)[..., None]
    flat = lambda x: x.reshape(B * T, V)  # noqa: E731 (each prefix a row of the vocabulary)
    ones = torch.ones(B * T, V, dtype=torch.float64, device=lp.device)
    rows = {}
    for name, (term, place, aggregate, ratio) in TERMS.items():
        if not has_exact_row(term, place, aggregate, ratio):
            continue
        c_all, c_token = torch.zeros_like(lp), None
        # the term called directly (its contract was checked on the sampled row, call_term)
        if place in ("loss", "both"):
            leaf = flat(lp).clone().requires_grad_()
            (d,) = torch.autograd.grad(term(leaf, flat(lq), leaf.detach(), ones).sum(), leaf)
            c_all = c_all + p * d.reshape(B, T, V) * w
        if place in ("reward", "reward-to-go", "both"):
            with torch.no_grad():
                k = term(flat(lp), flat(lq), flat(lp), ones).reshape(B, T, V)
            kbar = (p * k).sum(-1)
            c_all = c_all + p * (k - kbar[..., None]) * w
            c_token = score_coefficients(kbar, m, group_size, num_tokens).to(logp_all.dtype)
        rows[f"exact:{name}"] = (c_all.to(logp_all.dtype), c_token)
    return rows


def term_fingerprint(term, place, aggregate, ratio):
    """sha256 (16 hex digits) of a term's source and its place, aggregate and ratio."""
    import hashlib
    import inspect
    try:
        source = inspect.getsource(term)
    except (OSError, TypeError):  # defined where its source cannot be read: its code object
        source = repr(term.__code__.co_code)
    return hashlib.sha256(f"{source}/{place}/{aggregate}/{ratio}".encode()).hexdigest()[:16]


def term_scales(seqs, terms):
    """{row: scale} of the seq-mean rows of `terms` (a chunk record's): E[T], the distance's mean
    response length (a ratio estimate: its own error, ~1%, is not in the intervals)."""
    mean_length = float(np.mean(seqs["length"]))
    return {name: mean_length for name, t in terms.items() if t["aggregate"] == "seq-mean"}


# ---------------------------------------------------------------- exact per-prefix estimators

def vocab_logprobs(model, prompts, tokens, mask):
    """(logp (B, T), logprobs.token_logprobs' log-probs of the sampled tokens; logp_all (B, T, V),
    log pi(. | x, y<t) over the vocabulary) from one forward pass: a hook keeps the output layer's
    logits, indexed as token_logprobs indexes them (checked against its logp)."""
    kept = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, out: kept.append(out))
    try:
        logp, _ = logprobs.token_logprobs(model, prompts, tokens, mask, 1.0, torch.float32)
    finally:
        hook.remove()
    _, _, _, pack, column = logprobs.pack_layout(prompts, mask)  # the kept column of token t
    device = kept[0].device
    logp_all = kept[0][pack.to(device)[:, None], column.to(device)]
    logp_all = logp_all.float().log_softmax(-1)
    picked = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * mask
    if not torch.allclose(picked, logp, atol=1e-5):
        raise RuntimeError("vocab_logprobs: logprobs.token_logprobs indexes its logits otherwise")
    return logp, logp_all


def after(x):
    """sum_{t > s} x_t along the last axis."""
    return x.flip(-1).cumsum(-1).flip(-1) - x


def loo_baseline(to_go, mask, group_size):
    """b_is = the mean of to_go_js over the other sequences j of i's group whose position s exists
    (mask_js = 1), 0 where none does. It depends on the other sequences only, so
    E[grad log pi(y_is | h_is) b_is] = 0 (a sequence's own presence at s is never counted)."""
    B, T = to_go.shape
    value = (mask * to_go).reshape(-1, group_size, T)
    count = mask.reshape(-1, group_size, T)
    others, present = value.sum(1, keepdim=True) - value, count.sum(1, keepdim=True) - count
    return (others / present.clamp(min=1)).reshape(B, T)


def score_coefficients(kl_prefix, m, group_size, num_tokens):
    """sum_{t>s} KL_t - b_s on the sampled token at s (f's coefficient, per-prefix KL_t given)."""
    to_go = after(m * kl_prefix)
    return (to_go - loo_baseline(to_go, m, group_size)) * m / num_tokens


def exact_coefficients(logp_all, ref_all, mask, group_size, num_tokens=None, tail=()):
    """({row: (dloss/dlog pi(v | h) (B, T, V) or None, dloss/dlogp (B, T) or None)} of the exact
    rows (docstring, step 3), and for each R of `tail` p3_below_R and k3r_below_R, the exact
    expectations of truncated_coefficients' rows; per-prefix {kl, forward_kl, chi2, clamp_deficit}
    (B, T), 0 past the end). Computed in float64 from detached log-probs; num_tokens = G like the
    sampled rows."""
    num_tokens = group_size if num_tokens is None else num_tokens
    lp, lq, m = logp_all.detach().double(), ref_all.detach().double(), mask.double()
    p, log_ratio = lp.exp(), lp - lq  # log p/q, computed once: (B, T, V) passes dominate
    kl_t = (p * log_ratio).sum(-1)  # KL(pi(.|h_t) || pi_ref(.|h_t)), exactly
    k3_clamped = kl.estimate(lp, lq, "k3", "verl")  # eq. 14 at every token, clamped as verl
    kl_clamped = (p * k3_clamped).sum(-1)  # E_pi[clamped K3_t | h_t] (unclamped: KL_t)
    w = (m / num_tokens)[..., None]
    score_part = lambda kl_prefix: score_coefficients(kl_prefix, m, group_size, num_tokens)  # noqa

    rows = {
        # grad_z KL_t = p (log p/q - KL_t): the path-wise gradient of KL_t at h_t, E[K2-in-loss]
        "p2": (p * (log_ratio - kl_t[..., None]) * w, None),
        # eq. 41: grad KL(pi_ref || pi)_t = sum_v (p_v - q_v) grad log p_v, E[K3-in-loss]
        "p3": ((p - lq.exp()) * w, None),
        # eq. 29's score-function term, sum_{t>s} KL_t in place of the sampled K1 to go
        "f": (None, score_part(kl_t)),
        "f_plain": (None, after(m * kl_t) * m / num_tokens),
        # K3-in-reward with verl's clamp: E[clamped K3_s grad log p(y_s) | h_s] at s, the clamped
        # token KL to go after it (eq. 45 with the clamp; unclamped it is p2 + f - p3)
        "verl": (p * (k3_clamped - kl_clamped[..., None]) * w, score_part(kl_clamped)),
    }
    # chi^2(pi_ref || pi) = sum_v q_v^2 / p_v - 1 = Var_pi[pi_ref / pi] at the token
    chi2 = torch.logsumexp(lq - log_ratio, -1).exp() - 1
    # verl's clamp deficit, sum_v p_v (K3_v - clamped K3_v): exactly 0 where nothing is clamped
    k3_all = kl.estimate(lp, lq, "k3")  # eq. 14: K3 = r - 1 - log r at every token, r = q/p
    deficit = (p * (k3_all - k3_clamped)).sum(-1)
    prefix = {"kl": kl_t * m, "forward_kl": ((lp - log_ratio).exp() * -log_ratio).sum(-1) * m,
              "chi2": chi2 * m, "clamp_deficit": deficit * m}
    for R in TAIL_RATIOS:  # K3's tail: the tokens whose ratio pi_ref / pi exceeds R
        below = (-log_ratio <= math.log(R)).double()
        # E[K3 1{r <= R} | h_t]; with R -> inf it is KL_t (sum_v q_v = 1), the tail the rest
        prefix[f"k3_below_{R}"] = (p * k3_all * below).sum(-1) * m
        prefix[f"tail_prob_{R}"] = (p * (1 - below)).sum(-1) * m  # P(r > R | h_t)
    for R in tail:  # the K3 rows' exact expectations over the tokens of ratio r = q/p <= R
        below = (-log_ratio <= math.log(R)).double()
        x = k3_all * below  # K3 1{r <= R} at every token, its expectation x_t
        x_t = (p * x).sum(-1)
        # eq. 41 over r <= R: sum_{v: r_v <= R} (p_v - q_v) grad log p_v
        rows[f"p3_below_{R}"] = ((p - lq.exp()) * below * w, None)
        # eq. 45's K3-in-reward with K3 1{r <= R}: at s E[x_s grad log p(y_s)], x_t to go after
        rows[f"k3r_below_{R}"] = (p * (x - x_t[..., None]) * w, score_part(x_t))
    dtype = logp_all.dtype
    return ({name: tuple(None if c is None else c.to(dtype) for c in pair)
             for name, pair in rows.items()}, prefix)


def k3_tail(logp, ref_logp, mask, prefix):
    """Per sequence (B,), for each R of TAIL_RATIOS: the sampled K3 summed over the tokens whose
    ratio pi_ref / pi is at most R (`k3_below_R`), its exact expectation (`k3_below_R_exact`) and
    the expected number of tokens over R (`tail_prob_R`), from exact_coefficients' prefix sums."""
    out, k3 = {}, kl.estimate(logp, ref_logp, "k3")  # eq. 14 at the sampled tokens
    for R in TAIL_RATIOS:
        below = (ref_logp - logp <= math.log(R)) * mask
        out[f"k3_below_{R}"] = (below * k3).sum(1)
        out[f"k3_below_{R}_exact"] = prefix[f"k3_below_{R}"].sum(1)
        out[f"tail_prob_{R}"] = prefix[f"tail_prob_{R}"].sum(1)
    return out


def truncated_coefficients(logp, ref_logp, mask, group_size, R, num_tokens=None):
    """{k3_loss_below_R, k3_reward_below_R: dloss/dlogp (B, T)}: K3-in-loss and K3-in-reward through
    the trainer's functions with K3 counted on the sampled tokens of ratio pi_ref / pi <= R only
    (the KL's mask cut to them, the policy gradient's whole): no tail of large ratios (|1 - r| <= R,
    K3 <= max(R - 1 - log R, log pi/pi_ref)) (issue 36, item 2). Expectations: exact_coefficients'
    p3_below_R and k3r_below_R (tests/test_kl_gradients.py enumerates every group of the toy model)."""
    num_tokens = group_size if num_tokens is None else num_tokens
    below = mask * (ref_logp - logp.detach() <= math.log(R)).to(mask.dtype)
    leaf = logp.detach().clone().requires_grad_()
    in_loss = kl.kl_loss(leaf, ref_logp, below, "k3", "loss", 1.0, num_tokens)  # eq. 9
    # eq. 7: returns 0 - sum_t sg[K3_t 1{r_t <= R}], RLOO, the policy gradient over every token
    returns = kl.shape_rewards(torch.zeros_like(leaf[:, 0]), leaf, ref_logp, below, "k3",
                               "reward", 1.0)
    pg_loss, _ = advantage.policy_loss(leaf, leaf.detach(), advantage.rloo(returns, group_size),
                                       mask, num_tokens)
    return {f"k3_loss_below_{R}": torch.autograd.grad(in_loss, leaf)[0],
            f"k3_reward_below_{R}": torch.autograd.grad(pg_loss, leaf)[0]}


def ratios(args):
    """--grad-tail as a tuple of ints."""
    return tuple(int(r) for r in args.grad_tail.split(",") if r)


def tail_rows(tail):
    """The difference rows of --grad-tail: sampled K3 row over ratios <= R minus its exact
    expectation (E = 0 exactly), for each R."""
    return [f"{name}_below_{R}" for R in tail for name in ("k3_loss", "k3_reward")]


def row_outputs(logp, logp_all, ref_logp, ref_all, mask, scores, group_size, tail=()):
    """({row: [(output, coefficient), ...]} for every row of ROWS but the sums, and the rows of
    tail_rows(tail), per-prefix quantities): the VJPs that give each row's parameter gradient."""
    coefs = coefficients(logp.detach(), ref_logp, mask, scores, group_size)
    outputs = {name: [(logp, c)] for name, c in coefs.items() if name not in SUMS}
    exact, prefix = exact_coefficients(logp_all, ref_all, mask, group_size, tail=tail)
    for R in tail:  # one VJP each: sampled (on logp) minus exact (on logp_all and logp)
        sampled = truncated_coefficients(logp.detach(), ref_logp, mask, group_size, R)
        for name, key in (("k3_loss", f"p3_below_{R}"), ("k3_reward", f"k3r_below_{R}")):
            c_all, c_token = exact.pop(key)
            c_token = sampled[f"{name}_below_{R}"] - (0 if c_token is None else c_token)
            outputs[f"{name}_below_{R}"] = [(logp_all, -c_all), (logp, c_token)]
    for name, (c_all, c_token) in exact.items():
        outputs[name] = ([(logp_all, c_all)] if c_all is not None else []) + (
            [(logp, c_token)] if c_token is not None else [])
    for name, c in term_coefficients(logp.detach(), ref_logp, mask, group_size).items():
        outputs[name] = [(logp, c)]  # --presets: after every other row (stack_rows' order)
    for name, (c_all, c_token) in term_exact_coefficients(logp_all, ref_all, mask,
                                                          group_size).items():
        outputs[name] = [(logp_all, c_all)] + ([(logp, c_token)] if c_token is not None else [])
    return outputs, prefix


def stack_rows(rows):
    """(..., len(ROWS) + len(tail rows), m) from {row: (..., m)}, ROWS then any tail rows, the
    "both" rows as the sums they are (their coefficients are the sums: tests/test_kl_gradients.py)."""
    for name, parts in SUMS.items():
        rows[name] = rows[parts[0]] + rows[parts[1]]
    names = ROWS + [name for name in rows if name not in ROWS]
    return torch.stack([rows[name] for name in names], dim=-2).float().cpu()


def group_gradients(outputs, params, subsets):
    """(len(ROWS), m): each row's gradient at the subsets' coordinates (row_gradients)."""
    return stack_rows(row_gradients(outputs, params, subsets))


def row_gradients(outputs, params, subsets):
    """{row: (m,)}: each row's gradient at the subsets' coordinates, one vector-Jacobian product
    per row of `outputs` ({row: [(output, coefficient), ...]}) through the model."""
    rows = {}
    for i, (name, pairs) in enumerate(outputs.items()):
        tensors, coefs = zip(*pairs)
        grads = torch.autograd.grad(tensors, params, grad_outputs=coefs,
                                    retain_graph=i < len(outputs) - 1, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        rows[name] = torch.cat([coordinates(grads[j], index) for subset in subsets
                                for j, index in subset])
    return rows


def batch_gradients(policy, reference, prompts, tokens, mask, scores, group_size, params, subsets,
                    tail=()):
    """((groups, len(ROWS), m), logp, ref_logp, per-prefix quantities): group_gradients for many
    groups in one pass. The rows of each group (one prompt, contiguous) are one pack of
    logprobs.token_logprobs; a Linear's weight gradient is sum_l delta_l a_l^T over the positions l,
    so the per-pack product of its output gradient delta and its input a is that group's gradient.
    Adjacent groups must differ in prompt (else token_logprobs packs them together)."""
    owners = {id(m.weight): m for m in policy.modules() if isinstance(m, torch.nn.Linear)}
    if any(id(p) not in owners or owners[id(p)].bias is not None for p in params):
        raise SystemExit("--batch-groups > 1 needs --layers made of bias-free Linear weights "
                         "and --basis coords")
    modules = [owners[id(p)] for p in params]
    saved = {}
    hooks = [m.register_forward_hook(lambda m, inputs, out: saved.__setitem__(m, (inputs[0], out)))
             for m in modules]
    try:
        logp, logp_all = vocab_logprobs(policy, prompts, tokens, mask)
    finally:
        for hook in hooks:
            hook.remove()
    groups = len(prompts) // group_size
    if len(saved[modules[0]][0]) != groups:
        raise ValueError("adjacent groups share a prompt: token_logprobs packed them together")
    with torch.no_grad():
        ref_logp, ref_all = vocab_logprobs(reference, prompts, tokens, mask)
    outputs, prefix = row_outputs(logp, logp_all, ref_logp, ref_all, mask, scores, group_size,
                                  tail)
    rows = {}
    for i, (name, pairs) in enumerate(outputs.items()):
        tensors, coefs = zip(*pairs)
        deltas = torch.autograd.grad(tensors, [saved[m][1] for m in modules], grad_outputs=coefs,
                                     retain_graph=i < len(outputs) - 1)
        # (groups, out, in): each pack's gradient of this module's weight
        grads = [torch.bmm(d.transpose(1, 2), saved[m][0].detach())
                 for m, d in zip(modules, deltas)]
        rows[name] = torch.cat([grads[j].reshape(groups, -1)[:, index] for subset in subsets
                                for j, index in subset], dim=1)
        del grads, deltas
    return stack_rows(rows), logp.detach(), ref_logp, prefix


def packed_gradients(policy, reference, prompts, tokens, mask, scores, group_size, params,
                     subsets, tail=()):
    """batch_gradients for coordinates of any parameters (--layers whole): each pack's (group's)
    rows from the owning modules' inputs and output gradients (kl_coords.entry_gradients), the
    tied embedding's two uses summed. One group or many; adjacent groups must differ in prompt."""
    with kl_coords.capture(policy, params) as (saved, owned):
        logp, logp_all = vocab_logprobs(policy, prompts, tokens, mask)
    if len(next(iter(saved.values()))[0]) != len(prompts) // group_size:
        raise ValueError("adjacent groups share a prompt: token_logprobs packed them together")
    with torch.no_grad():
        ref_logp, ref_all = vocab_logprobs(reference, prompts, tokens, mask)
    outputs, prefix = row_outputs(logp, logp_all, ref_logp, ref_all, mask, scores, group_size,
                                  tail)
    rows = kl_coords.entry_gradients(outputs, saved, owned, params, subsets)
    return stack_rows(rows), logp.detach(), ref_logp, prefix
def spread(problems, key):
    """The problems reordered so that no two neighbours have the same key (a prompt drawn twice in
    one batch would be packed with its twin): the most frequent first, into the even slots, then
    the odd ones."""
    counts = {}
    for p in problems:
        counts.setdefault(key(p), []).append(p)
    ordered = [p for group in sorted(counts.values(), key=len, reverse=True) for p in group]
    slots = list(range(0, len(ordered), 2)) + list(range(1, len(ordered), 2))
    result = [None] * len(ordered)
    for slot, p in zip(slots, ordered):
        result[slot] = p
    if any(key(a) == key(b) for a, b in zip(result, result[1:])):
        raise ValueError("one prompt fills over half of a batch: lower --batch-groups")
    return result


# ---------------------------------------------------------------- sampling, in chunks

def measure_chunk(policy, reference, tokenizer, examples, args, device, params, subsets, seed,
                  groups):
    """Sample `groups` groups (prompts and responses seeded by `seed`) and return X (units,
    len(ROWS), m), per-sequence records and the per-prefix chi^2 and clamp deficits."""
    stop_ids = stop_token_ids(policy, tokenizer)
    gen = torch.Generator(device=device).manual_seed(seed)
    prompt_rng = random.Random(seed)
    G, X, done = args.group_size, [], 0
    seqs = {key: [] for key in ("length", "score", "k1", "k3", "kl", "forward_kl", "chi2",
                                "chi2_max", "clamp_deficit")}
    for R in TAIL_RATIOS:
        seqs.update({f"k3_below_{R}": [], f"k3_below_{R}_exact": [], f"tail_prob_{R}": []})
    prefixes = {"chi2": [], "clamp_deficit": []}

    def record(logp, ref_logp, mask, scores, prefix):
        with torch.no_grad():
            seqs["length"] += mask.sum(1).tolist()
            seqs["score"] += scores.tolist()
            for kind in ("k1", "k3"):
                seqs[kind] += (mask * kl.estimate(logp, ref_logp, kind)).sum(1).tolist()
            for name in ("kl", "forward_kl", "chi2", "clamp_deficit"):
                seqs[name] += prefix[name].sum(1).tolist()
            for name, values in k3_tail(logp, ref_logp, mask, prefix).items():
                seqs[name] += values.tolist()
            seqs["chi2_max"] += prefix["chi2"].max(1).values.tolist()
            for name in prefixes:
                prefixes[name] += prefix[name][mask > 0].tolist()

    batched, whole, tail = args.batch_groups > 1, args.layers == "whole", ratios(args)
    gradients = packed_gradients if whole else batch_gradients
    while done < groups:
        count = min(args.batch_groups if batched else args.prompts_per_batch, groups - done)
        problems = [prompt_rng.choice(examples) for _ in range(count)]
        if batched:  # i.i.d. draws; their order within a unit does not matter
            problems = spread(problems, lambda ex: tuple(data.prompt_ids(tokenizer, ex)))
        prompts = [data.prompt_ids(tokenizer, ex) for ex in problems for _ in range(G)]
        with torch.no_grad():
            out = rollout.generate(policy, prompts, args.max_new_tokens, 1.0, 1.0, stop_ids, gen,
                                   decoder=runtime.sampler_decoder(device))
        completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        scores = torch.tensor([data.score(ex, c) for ex, c in
                               zip([ex for ex in problems for _ in range(G)], completions)],
                              dtype=torch.float32, device=device)
        tokens, mask = out.tokens, out.response_mask
        done += count
        if batched:  # one unit: the mean of `count` groups' gradients
            grads, logp, ref_logp, prefix = gradients(policy, reference, prompts, tokens, mask,
                                                      scores, G, params, subsets, tail)
            X.append(grads.mean(0))
            record(logp, ref_logp, mask, scores, prefix)
            continue
        for k in range(count):
            rows = slice(k * G, (k + 1) * G)
            T = int(mask[rows].sum(1).max())  # the group's own padding only
            group_tokens, group_mask = tokens[rows, :T], mask[rows, :T]
            if whole:  # one pack: the group
                grads, logp, ref_logp, prefix = packed_gradients(
                    policy, reference, prompts[rows], group_tokens, group_mask, scores[rows], G,
                    params, subsets, tail)
                X.append(grads[0])
                record(logp, ref_logp, group_mask, scores[rows], prefix)
                continue
            logp, logp_all = vocab_logprobs(policy, prompts[rows], group_tokens, group_mask)
            with torch.no_grad():
                ref_logp, ref_all = vocab_logprobs(reference, prompts[rows], group_tokens,
                                                   group_mask)
            outputs, prefix = row_outputs(logp, logp_all, ref_logp, ref_all, group_mask,
                                          scores[rows], G, tail)
            X.append(group_gradients(outputs, params, subsets))
            record(logp.detach(), ref_logp, group_mask, scores[rows], prefix)
            del logp, logp_all, outputs
    return (torch.stack(X), {key: np.array(v) for key, v in seqs.items()},
            {key: np.array(v) for key, v in prefixes.items()})


# ---------------------------------------------------------------- driver

def policies(args):
    """[(label, policy path)]: --policy, or the no-KL run's step_N checkpoints (trained if
    absent, unless only analyzing)."""
    if args.policy:
        return [(Path(args.policy).name, args.policy)]
    steps = [int(s) for s in args.steps.split(",")]
    train_dir = Path(args.train_dir)
    missing = [s for s in steps if not (train_dir / f"step_{s}").exists()]
    if missing and not args.analyze:
        print(f"training pi: {max(steps)} no-KL steps into {train_dir} (train.py's defaults)")
        train.main(["--kl", "k1", "--place", "none", "--model", args.model,
                    "--steps", str(max(steps)), "--save-every", str(math.gcd(*steps)), "--seed",
                    str(args.seed), "--out", str(train_dir)])
    return [(f"step {s}", str(train_dir / f"step_{s}")) for s in steps]


def sample_distance(label, path, reference, tokenizer, examples, args, device, machine):
    """Sample the chunks of one distance that are not saved yet (resuming); returns pi's hash."""
    policy = load_model(path, torch.float32).to(device).eval()
    key = run_key(args, policy_hash(policy), machine)
    if TERMS:  # the terms' code: chunks of another term are never pooled
        key["flags"]["terms"] = {name: term_fingerprint(*spec) for name, spec in TERMS.items()}
    directory = Path(args.chunks) / re.sub(r"\W+", "_", label)
    records = saved_chunks(directory, key)
    params, subsets, weights = choose_subsets(policy, args.layers, args.coords, args.seed,
                                              reference if args.basis == "displacement" else None)
    blocks = [name for name, _ in kl_coords.pools(policy, args.layers)]
    exact = [f"exact:{name}" for name, spec in TERMS.items() if has_exact_row(*spec)]
    extra = {"rows": ROWS + tail_rows(ratios(args)) + list(TERMS) + exact} \
        if args.grad_tail or TERMS else {}
    if TERMS:  # each term's flags, its exact row, and its toy verdict (the row it is paired with)
        extra["terms"] = {name: {"place": place, "aggregate": aggregate, "ratio": ratio,
                                 "exact": f"exact:{name}" in exact,
                                 "parent": term_parent(term, place, aggregate, ratio)}
                          for name, (term, place, aggregate, ratio) in TERMS.items()}
    if kl_coords.views(args.layers, blocks):
        extra["views"] = kl_coords.views(args.layers, blocks)
    sizes = [sum(len(index) if index.dtype == torch.long else len(index.reshape(len(index), -1))
                 for _, index in subset) for subset in subsets]
    chunks = math.ceil(args.groups / args.chunk_groups)
    for chunk in reversed(range(chunks)) if args.reverse else range(chunks):
        if chunk in records or chunk in saved_chunks(directory, key):  # saved meanwhile
            continue
        t0, cpu0, seed = time.time(), time.process_time(), chunk_seed(args.seed, label, chunk)
        X, seqs, prefixes = measure_chunk(policy, reference, tokenizer, examples, args, device,
                                          params, subsets, seed, args.chunk_groups)
        seconds, cpu_seconds = time.time() - t0, time.process_time() - cpu0  # a shared machine
        save_chunk(directory, chunk, {"X": X, "seqs": seqs, "prefixes": prefixes},
                   {"key": key, "chunk": chunk, "seed": seed, "groups": args.chunk_groups,
                    "seconds": seconds, "cpu_seconds": cpu_seconds, "sizes": sizes,
                    "weights": weights, "blocks": blocks,
                    **extra})
        print(f"{label}: chunk {chunk + 1}/{chunks}, {seconds / args.chunk_groups:.2f} s a group "
              f"({cpu_seconds / args.chunk_groups:.2f} s of CPU), "
              f"KL {seqs['kl'].mean():.3f} nats a sequence (exact)", flush=True)
    del policy
    return key["pi"]


def main(argv=None, terms=None):
    """The run (module docstring); `terms` {row: (term, place, aggregate, ratio)} adds rows as
    --presets does (lab/check_kl.py --model)."""
    args = parser.parse_args(argv)
    TERMS.clear()
    TERMS.update(preset_terms(args.presets) if args.presets else {})
    TERMS.update(terms or {})
    if args.chunk_groups % args.batch_groups:
        parser.error("--chunk-groups must be a multiple of --batch-groups (units of equal size)")
    if args.replot:
        results = json.loads((Path(args.out) / "results.json").read_text())
        S.plot(results, args.figure)
        return results
    start = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    targets = policies(args)
    # the CPU and dtypes: train.py samples pi's training batches in bf16 where the CPU has it, and
    # bf16 rounds differently on other CPUs, so another kind of machine trains another pi
    train_config = Path(args.train_dir) / "config.json"
    train_dtype = (json.loads(train_config.read_text()).get("dtype")
                   if train_config.is_file() and not args.policy else None)
    machine = study.machine("kl_gradients", train_dtype, "float32", torch.get_num_threads())
    if not args.analyze:
        tokenizer = load_tokenizer(args.model)
        examples = data.load_task("arith", split="test")
        reference = load_model(args.model, torch.float32).to(device).requires_grad_(False)
    results = {"model": args.model, "group_size": args.group_size, "flags": vars(args),
               "machine": machine, "distances": []}
    out = Path(args.out)
    for label, path in targets:
        if not args.analyze:
            sample_distance(label, path, reference, tokenizer, examples, args, device, machine)
        rows, seqs, prefixes, record, seconds, chunks = load_distance(label, args, ROWS)
        t0 = time.time()
        G = args.group_size * args.batch_groups  # sequences per unit
        terms = record.get("terms", {})
        for name, scale in term_scales(seqs, terms).items():  # seq-mean's E[T] (term_scales)
            rows[name] = rows[name] * scale
        parents = {name: {"exact": f"exact:{name}" if t["exact"] else None,
                          "parent": None if t["parent"] is None else KNOWN_ROWS[t["parent"]]}
                   for name, t in terms.items()}
        views = S.analyze(rows, record["sizes"], record["weights"], record["blocks"], G,
                          record.get("views"), parents)
        groups = chunks * record["groups"]
        dist = {"label": label, "policy": path, "pi_hash": record["key"]["pi"],
                "measured_on": {k: record["key"][k] for k in ("cpu", "cpu_flags", "gpu")},
                "chunks": chunks, "groups": groups, "sequences": groups * args.group_size,
                "seconds": seconds, "seconds_per_group": seconds / groups,
                "analysis_seconds": time.time() - t0, "coords": record["sizes"],
                "weights": record["weights"],
                **S.per_sequence(seqs, prefixes, args.group_size), "views": views}
        results["distances"].append(dist)
        S.report(label, groups, dist, TAIL_RATIOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        results.update(seconds=time.time() - start, peak_rss_gib=peak)
        out.mkdir(parents=True, exist_ok=True)  # after each distance: a stop keeps what it has
        (out / "results.json").write_text(json.dumps(results, indent=1))
        S.write_csv(results, out / "results.csv")
    if args.figure:
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        S.plot(results, args.figure)
    print(f"{time.time() - start:.0f} s; {out / 'results.json'}, {out / 'results.csv'}, "
          f"{args.figure}")
    return results


if __name__ == "__main__":
    main()
