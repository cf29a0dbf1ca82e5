"""Each library's KL configurations as KL terms for lab/check_kl.py (paper sec. 3, Table 1; sec. 3.2
off-policy; issue 60, item 2).

Every preset is one plain function term(logp, ref_logp, old_logp, mask) -> (B, T), written from
reading the library's code at the commit named above it (the math re-written here, not their
code): the same estimator, clamps, detaches, ratios and straight-through tricks, so that autograd
through `logp` gives the gradient the library's backward gives. PRESETS says where the library
puts the term (place), how its loss averages it (aggregate) and which ratio its policy loss
weights the advantage with (ratio, for the reward places), the keys lab/check_kl.py reads.

    logp      log pi(y_t | y<t) of the sampled tokens, differentiable
    ref_logp  log pi_ref of the same tokens
    old_logp  log mu, the behaviour policy's (on-policy: logp.detach())
    mask      1.0 on response tokens (the checker multiplies the term by it)

Estimators, with log r = log pi_ref - log pi (the paper's eqs. 11 and 14):

    K1 = log pi - log pi_ref = -log r          K2 = 1/2 (log pi - log pi_ref)^2
    K3 = r - 1 - log r                          (each library writes exp(log r) - 1 - log r)

Where a library computes the KL of the reward from the log-probs stored at sampling time (TRL
RLOO, verl, OpenRLHF, SkyRL), the term reads `old_logp`: off-policy that is log mu, not log pi.
"""

import torch


def _k1(logp, ref_logp):
    # eq. 11: K1 = log pi - log pi_ref
    return logp - ref_logp


def _k2(logp, ref_logp):
    # K2 = 1/2 (log pi - log pi_ref)^2
    return 0.5 * (logp - ref_logp) ** 2


def _k3_of_log_r(log_r):
    # eq. 14: K3 = r - 1 - log r, as the libraries write it
    return torch.exp(log_r) - 1 - log_r


def _k3(logp, ref_logp):
    return _k3_of_log_r(ref_logp - logp)


def _k3_clamped(logp, ref_logp):
    """verl's low_var_kl and SkyRL's k3: log r clamped to [-20, 20], then K3 to [-10, 10] (a clamped
    value has zero gradient)."""
    log_r = (ref_logp - logp).clamp(-20, 20)
    return _k3_of_log_r(log_r).clamp(-10, 10)


def _stored(value, logp):
    """A term computed from stored log-probs (old_logp) only: no gradient reaches logp. `0 * logp`
    keeps it in the autograd graph so a checker can differentiate it (the gradient is exactly 0)."""
    return value + 0.0 * logp


def _straight_through(value, surrogate):
    """The value of `value`, the gradient of `surrogate`: sg[value] + surrogate - sg[surrogate]."""
    return value.detach() + surrogate - surrogate.detach()


# ---------------------------------------------------------------------------------------------
# The paper's four configurations (Table 1), exact estimators, no clamp. The on-policy runs used
# verl (app. B); the asynchronous ones prime-rl (sec. 4.2, app. B): see the tba-prime preset below.


# Table 1, K1-in-reward: R - sum_t sg[K1_t] (eqs. 7, 10, 12)
def paper_k1_reward(logp, ref_logp, old_logp, mask):
    # eq. 11: K1_t = log pi - log pi_ref
    return _k1(logp, ref_logp)


# Table 1, K1-in-loss: sum_t K1_t in the loss (eq. 13: expected gradient 0)
def paper_k1_loss(logp, ref_logp, old_logp, mask):
    # eq. 11: K1_t = log pi - log pi_ref
    return _k1(logp, ref_logp)


# Table 1, K3-in-reward (eqs. 15, 19)
def paper_k3_reward(logp, ref_logp, old_logp, mask):
    # eq. 14: K3_t = r - 1 - log r
    return _k3(logp, ref_logp)


# Table 1, K3-in-loss (eqs. 16, 41)
def paper_k3_loss(logp, ref_logp, old_logp, mask):
    # eq. 14: K3_t = r - 1 - log r
    return _k3(logp, ref_logp)


# ---------------------------------------------------------------------------------------------
# TRL. huggingface/trl@f2cd57710ae345ea6428ae95363267fcf38a3dc8 trl/trainer/grpo_trainer.py
# _compute_loss ~L3054-3076 (ratio coef_1, per-token K3, the correction), L3121 (KL added to the
# per-token loss after the policy term's masks), L3139-3142 (loss_type "dapo", the default: sum
# over the batch's tokens / their count). grpo_config.py L791 (loss_type="dapo"), L750
# (importance_sampling_level="token"), L962 (use_bias_correction_kl=False at this commit; its
# PR #6503, commit 6672ba322e06 on the PR branch, flips the default to True: TRL 1.10).


# GRPOConfig(beta>0, use_bias_correction_kl=False): per-token K3 in the loss, no clamp
def trl_grpo_k3(logp, ref_logp, old_logp, mask):
    # eq. 14: K3_t = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1
    return _k3(logp, ref_logp)


# GRPOConfig(beta>0) at TRL 1.10 (use_bias_correction_kl=True), importance_sampling_level="token"
def trl_grpo_k3_corrected(logp, ref_logp, old_logp, mask):
    # coef_1 = exp(log pi - log pi_old), differentiable: term = coef_1 * K3_t
    # (d/dlogp_t = coef_1 * K1_t: on-policy the token-level reverse KL's path-wise gradient)
    coef_1 = torch.exp(logp - old_logp)
    return coef_1 * _k3(logp, ref_logp)


# GRPOConfig(beta>0, importance_sampling_level="sequence"), the correction on (TRL 1.10): coef_1
# is one ratio per sequence, exp(mean_t log pi/pi_old) over the completion's tokens, broadcast
# onto every token's K3 (issue #6586)
def trl_grpo_k3_corrected_sequence(logp, ref_logp, old_logp, mask):
    # log w_i = sum_t m_t (log pi - log pi_old) / max(sum_t m_t, 1): GSPO's sequence ratio
    tokens = mask.sum(-1, keepdim=True).clamp(min=1.0)
    log_w = ((logp - old_logp) * mask).sum(-1, keepdim=True) / tokens
    coef_1 = torch.exp(log_w)
    return coef_1 * _k3(logp, ref_logp)


# RLOOTrainer(beta=0.05, the default). huggingface/trl@f2cd577 trl/trainer/rloo_trainer.py
# ~L1526-1535: per-token K1 from the log-probs stored at sampling time (old_per_token_logps), summed
# over the completion, subtracted from the reward before the leave-one-out baseline; ~L1683-1694:
# the policy loss weights each sequence's advantage by exp(sum_t log pi/pi_old) (the sequence's
# full ratio, PPO-clipped), mean over sequences.
def trl_rloo_k1(logp, ref_logp, old_logp, mask):
    # eq. 11 at the behaviour policy: K1_t = log mu - log pi_ref
    return _stored(_k1(old_logp, ref_logp), logp)


# ---------------------------------------------------------------------------------------------
# NeMo-RL. NVIDIA-NeMo/RL@7ea279abfbeb698b092856d0dab61e7cf39bc909 (after PR #2506, 33bce20d7,
# and #2958, 2206ae11f): nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn ~L469-515;
# nemo_rl/algorithms/utils.py calculate_kl ~L42-101. Defaults (ClippedPGLossConfig ~L111-153,
# examples/configs/grpo_math_1B.yaml L80-104): reference_policy_kl_type "k3", penalty 0.01,
# kl_input_clamp_value 20, kl_output_clamp_value 10, token_level_loss true (token-mean),
# use_on_policy_kl_approximation false.


def _nemo_weighted_k3(logp, ref_logp, weight):
    """calculate_kl after #2958: log r clamped to [-20, 20]; where that clamp is active the weight
    is detached; K3 times the weight, then clamped to [-10, 10]."""
    log_r = ref_logp - logp
    log_r_clamped = log_r.clamp(-20, 20)
    weight = torch.where(log_r == log_r_clamped, weight, weight.detach())
    return (weight * _k3_of_log_r(log_r_clamped)).clamp(-10, 10)


# The default: weight exp(log pi - sg[log pi]) = 1 in value, gradient 1 (the score term of #2506)
def nemo_k3(logp, ref_logp, old_logp, mask):
    # term = exp(x - sg[x]) * K3_t, x = log pi: d/dlogp_t = K3_t + (1 - r_t) = K1_t
    # (old_logp is not used)
    weight = torch.nan_to_num(torch.exp(logp - logp.detach()), nan=0.0, posinf=0.0, neginf=0.0)
    return _nemo_weighted_k3(logp, ref_logp, weight)


# use_on_policy_kl_approximation=true: weight exp(log pi - log pi_gen), differentiable
def nemo_k3_onpolicy_approx(logp, ref_logp, old_logp, mask):
    # term = (pi / mu) * K3_t: d/dlogp_t = (pi_t / mu_t) K1_t
    weight = torch.nan_to_num(torch.exp(logp - old_logp), nan=0.0, posinf=0.0, neginf=0.0)
    return _nemo_weighted_k3(logp, ref_logp, weight)


# Before #2506: NVIDIA-NeMo/RL@2369c0aec03048bd3a5ffd564df14aa0dcb73911
# nemo_rl/algorithms/loss/loss_functions.py ~L386-430, nemo_rl/algorithms/utils.py calculate_kl
# ~L41-83: the plain clamped K3 in the loss (weight ones; with use_on_policy_kl_approximation the
# weight exp(log pi - log pi_gen) was detached)
def nemo_k3_before_2506(logp, ref_logp, old_logp, mask):
    # eq. 14 with log r clamped to [-20, 20] and K3 to [-10, 10]
    return _k3_clamped(logp, ref_logp)


# ---------------------------------------------------------------------------------------------
# slime. THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515 slime/utils/ppo_utils.py
# compute_approx_kl ~L11-52; slime/backends/megatron_utils/loss.py ~L1116-1130 (the KL loss:
# sum_of_sample_mean, i.e. each sample's token mean, summed); cp_utils.py get_sum_of_sample_mean
# ~L47-80; slime/utils/arguments.py ~L934-994 (--kl-loss-type default "k1", --use-kl-loss and
# --use-unbiased-kl off, --kl-loss-coef 0.0). Megatron's --calculate-per-token-loss (off by
# default) would make it a token mean.


# --use-kl-loss (the default --kl-loss-type k1): K1 in the loss, no clamp
def slime_k1_loss(logp, ref_logp, old_logp, mask):
    # eq. 11: K1_t = log pi - log pi_ref
    return _k1(logp, ref_logp)


# --use-kl-loss --kl-loss-type low_var_kl: K3, its output clamped to [-10, 10] (no clamp of log r)
def slime_low_var_kl(logp, ref_logp, old_logp, mask):
    # eq. 14, then clamp(K3, -10, 10)
    return _k3(logp, ref_logp).clamp(-10, 10)


# --use-kl-loss --kl-loss-type low_var_kl --use-unbiased-kl (PR #1004): the differentiable ratio
# exp(log pi - log pi_old) times K3, the product clamped to [-10, 10]
def slime_unbiased_kl(logp, ref_logp, old_logp, mask):
    # clamp((pi / pi_old) * K3_t, -10, 10): d/dlogp_t = (pi_t / pi_old_t) K1_t where unclamped
    importance_ratio = torch.exp(logp - old_logp)
    return (importance_ratio * _k3(logp, ref_logp)).clamp(-10, 10)


# ---------------------------------------------------------------------------------------------
# OpenRLHF. OpenRLHF/OpenRLHF@3c3be6234e0cb353e76bb8019947db9dfe99fca7 openrlhf/models/utils.py
# compute_approx_kl ~L64-95 (every estimator's output clamped to [-10, 10], no clamp of log r),
# compute_reward ~L98-125; openrlhf/trainer/ppo_utils/experience_maker.py ~L205-210 (the reward's
# KL from the log-probs stored at sampling time), ~L276-300 (per-token reward -beta K1_t plus the
# baselined score at the last token, summed from t to the end: gamma = 1);
# openrlhf/trainer/ray/ppo_actor.py ~L319-333 (the KL loss, aggregate_loss: token-mean);
# openrlhf/cli/train_ppo_ray.py ~L419-485 (--algo.kl.init_coef 0.01, --algo.kl.estimator k1,
# --algo.kl.use_loss off, --algo.advantage.estimator gae).


def _openrlhf_estimate(logp, ref_logp, estimator):
    if estimator == "k1":
        value = _k1(logp, ref_logp)
    elif estimator == "k3":
        value = _k3(logp, ref_logp)
    else:
        value = _k2(logp, ref_logp)
    return value.clamp(-10, 10)


# The default estimator k1 without --algo.kl.use_loss: K1 (clamped) as a per-token reward to go
def openrlhf_k1_reward(logp, ref_logp, old_logp, mask):
    # clamp(K1_t, -10, 10) at the behaviour policy: log mu - log pi_ref
    return _stored(_openrlhf_estimate(old_logp, ref_logp, "k1"), logp)


# --algo.kl.use_loss --algo.kl.estimator k3
def openrlhf_k3_loss(logp, ref_logp, old_logp, mask):
    # clamp(K3_t, -10, 10)
    return _openrlhf_estimate(logp, ref_logp, "k3")


# --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.unbiased_gradient: PR #1309's head,
# OpenRLHF/OpenRLHF@d3d1920349588f3ee419ef6883efd8e09a77360c openrlhf/models/utils.py ~L64-125
# (KL_IS_WEIGHT_CLIP = 10), openrlhf/trainer/ray/ppo_actor.py ~L319-327 (log_probs_old = the
# experience's action log-probs)
def openrlhf_unbiased_gradient(logp, ref_logp, old_logp, mask):
    # value clamp(K3_t, -10, 10); gradient that of w K2_t, w = sg[min(pi/pi_old, 10)]:
    # d/dlogp_t = w K1_t (straight-through)
    weight = torch.exp(logp - old_logp).clamp(max=10.0).detach()
    surrogate = weight * _k2(logp, ref_logp)
    return _straight_through(_openrlhf_estimate(logp, ref_logp, "k3"), surrogate)


# ---------------------------------------------------------------------------------------------
# verl. verl-project/verl@1dda039b9c6311889a9c9a26040677e1254814f9 verl/trainer/ppo/core_algos.py
# kl_penalty / kl_penalty_forward ~L2187-2250 (the "+" suffix: the value of the estimator, the
# gradient of K2; stripped correctly since PR #6058, 7e80ab0cf); verl/trainer/ppo/ray_trainer.py
# apply_kl_penalty ~L78-110 (the reward's KL from old_log_probs, per token, then summed over the
# response by the outcome advantage estimators); verl/workers/utils/losses.py ~L132-141 (the KL
# loss, agg_loss with loss_agg_mode "token-mean", the default: verl/trainer/config/actor/actor.yaml
# L86); actor.yaml L103-116 (use_kl_loss false, kl_loss_type low_var_kl), algorithm.py L658-659
# (use_kl_in_reward false, kl_penalty "kl").


# algorithm.use_kl_in_reward=True algorithm.kl_penalty=kl
def verl_k1_reward(logp, ref_logp, old_logp, mask):
    # eq. 11 at the behaviour policy: K1_t = log mu - log pi_ref
    return _stored(_k1(old_logp, ref_logp), logp)


# actor.use_kl_loss=True (kl_loss_type defaults to low_var_kl)
def verl_low_var_kl_loss(logp, ref_logp, old_logp, mask):
    # eq. 14 with log r clamped to [-20, 20] and K3 to [-10, 10]
    return _k3_clamped(logp, ref_logp)


# actor.use_kl_loss=True actor.kl_loss_type=k3+
def verl_k3plus_loss(logp, ref_logp, old_logp, mask):
    # value: clamped K3_t; gradient: that of K2_t = 1/2 (log pi - log pi_ref)^2, i.e. K1_t
    return _straight_through(_k3_clamped(logp, ref_logp), _k2(logp, ref_logp))


# actor.use_kl_loss=True actor.kl_loss_type=k1+
def verl_k1plus_loss(logp, ref_logp, old_logp, mask):
    # value: K1_t; gradient: that of K2_t, i.e. K1_t
    return _straight_through(_k1(logp, ref_logp), _k2(logp, ref_logp))


# algorithm.use_kl_in_reward=True algorithm.kl_penalty=k3+ (in the reward only the value counts)
def verl_k3plus_reward(logp, ref_logp, old_logp, mask):
    # clamped K3_t of old_log_probs: the reward keeps the straight-through's value only
    return _stored(_k3_clamped(old_logp, ref_logp), logp)


# ---------------------------------------------------------------------------------------------
# AReaL. inclusionAI/AReaL@4aef98d8d818af55b43621aaadba047ae10f4e77 areal/trainer/ppo/actor.py
# grpo_loss_fn ~L482-512 (KDRL, PR #964): with a teacher and rl_loss_weight > 0 (default 1.0),
# loss = rl_loss_weight * loss + distill_loss_weight * sum_t m_t (log pi - log pi_T) / sum_t m_t
# (distill_loss_weight default 0.005). Here the teacher is pi_ref.
def areal_kdrl(logp, ref_logp, old_logp, mask):
    # K1_t = log pi - log pi_teacher, path-wise
    return _k1(logp, ref_logp)


# ---------------------------------------------------------------------------------------------
# SkyRL. NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265
# skyrl/backends/skyrl_train/utils/ppo_utils.py compute_approx_kl ~L88-126;
# skyrl/backends/skyrl_train/workers/worker.py ~L1070-1080 (the KL loss: each sequence's masked
# mean, then the mean over sequences); skyrl/train/config/config.py ~L826-836 (kl_estimator_type
# "k3", use_kl_loss true, use_kl_in_reward false, kl_loss_coef 0.001).


# The default: trainer.algorithm.use_kl_loss=true kl_estimator_type=k3
def skyrl_k3_loss(logp, ref_logp, old_logp, mask):
    # eq. 14 with log r clamped to [-20, 20] and K3 to [-10, 10]
    return _k3_clamped(logp, ref_logp)


# trainer.algorithm.kl_estimator_type=k2 (what issue #805 / PR #1445 propose as the default)
def skyrl_k2_loss(logp, ref_logp, old_logp, mask):
    # K2_t = 1/2 (log pi - log pi_ref)^2, no clamp
    return _k2(logp, ref_logp)


# ---------------------------------------------------------------------------------------------
# The paper's asynchronous code, as far as it can be read: bbartoldson/tba-prime@
# 115573dc617926772016ec76d36b119aca8fc7b3 (an ancestor of the runs' 59c2f8ae, which is not
# stored) src/zeroband/training/loss.py kl_penalty ~L356-382 (K3 clamped to [-10, 10], no clamp
# of log r, sum over tokens / max_tokens) called at src/zeroband/train.py ~L418-422 with
# batch["logprobs"], the log-probs stored with the batch (no gradient), not the trained model's.
def tba_prime_k3_loss(logp, ref_logp, old_logp, mask):
    # clamp(K3_t, -10, 10) of the stored log-probs: a constant of the loss, gradient exactly 0
    return _stored(_k3(old_logp, ref_logp).clamp(-10, 10), logp)


def _preset(library, configuration, source, place, aggregate, ratio, term, note):
    return dict(library=library, configuration=configuration, source=source, place=place,
                aggregate=aggregate, ratio=ratio, term=term, note=note)


_TRL = "huggingface/trl@f2cd577"
_NEMO = "NVIDIA-NeMo/RL@7ea279a"
_SLIME = "THUDM/slime@624b824"
_ORLHF = "OpenRLHF/OpenRLHF@3c3be62"
_VERL = "verl-project/verl@1dda039"
_SKYRL = "NovaSky-AI/SkyRL@a956457"

PRESETS = {
    "paper-k1-reward": _preset(
        "paper", "--kl k1 --place reward", "arXiv 2512.21852 Table 1, eqs. 7, 10-12",
        "reward", "token-mean", "token", paper_k1_reward,
        "the exact K1 summed over the sequence into the reward; on-policy runs used verl (app. B)"),
    "paper-k1-loss": _preset(
        "paper", "--kl k1 --place loss", "arXiv 2512.21852 Table 1, eq. 13",
        "loss", "token-mean", "token", paper_k1_loss,
        "token-normalized like the policy loss (sec. 4.1: the batch's token count)"),
    "paper-k3-reward": _preset(
        "paper", "--kl k3 --place reward", "arXiv 2512.21852 Table 1, eqs. 14, 15, 19",
        "reward", "token-mean", "token", paper_k3_reward,
        "the exact K3, no clamp (verl's clamps in the runs are our inference: docs/peers.md)"),
    "paper-k3-loss": _preset(
        "paper", "--kl k3 --place loss", "arXiv 2512.21852 Table 1, eqs. 14, 16, 41",
        "loss", "token-mean", "token", paper_k3_loss,
        "the exact K3, no clamp"),
    "trl-grpo-k3": _preset(
        "TRL", "GRPOConfig(beta=0.04, use_bias_correction_kl=False)",
        f"{_TRL} trl/trainer/grpo_trainer.py ~L3054-3142; grpo_config.py L791, L962",
        "loss", "token-mean", "token", trl_grpo_k3,
        "loss_type='dapo' (the default) divides by the batch's token count; "
        "loss_type='grpo' would be seq-mean; beta defaults to 0.0 (no KL)"),
    "trl-grpo-k3-corrected": _preset(
        "TRL", "GRPOConfig(beta=0.04) at TRL 1.10 (use_bias_correction_kl=True)",
        f"{_TRL} trl/trainer/grpo_trainer.py ~L3054-3076; PR #6503 (6672ba3) grpo_config.py",
        "loss", "token-mean", "token", trl_grpo_k3_corrected,
        "the default flip is read from PR #6503's commit, not from f2cd577 (there False); "
        "coef_1 is differentiable, PPO's clip does not touch the KL"),
    "trl-grpo-k3-corrected-sequence": _preset(
        "TRL", "GRPOConfig(beta=0.04, importance_sampling_level='sequence') at TRL 1.10",
        f"{_TRL} trl/trainer/grpo_trainer.py ~L3054-3076 (issue #6586)",
        "loss", "token-mean", "sequence", trl_grpo_k3_corrected_sequence,
        "default loss_type 'dapo' (token-mean; TRL warns and suggests loss_type='grpo', seq-mean, "
        "for GSPO); the sequence ratio exp(mean_t log pi/pi_old) multiplies every token's K3"),
    "trl-rloo-k1": _preset(
        "TRL", "RLOOTrainer(RLOOConfig(beta=0.05))",
        f"{_TRL} trl/trainer/rloo_trainer.py ~L1526-1535, ~L1683-1694",
        "reward", "sum", "sequence-product", trl_rloo_k1,
        "K1 of the sampling-time log-probs; the policy loss weights the sequence advantage by "
        "the full ratio exp(sum_t log pi/pi_old) (not GSPO's mean: the checker's "
        "'sequence-product'), mean over sequences (a constant per sequence: 'sum')"),
    "nemo-k3": _preset(
        "NeMo-RL", "ClippedPGLossConfig defaults (reference_policy_kl_type=k3, penalty 0.01)",
        f"{_NEMO} nemo_rl/algorithms/loss/loss_functions.py ~L469-515; "
        "nemo_rl/algorithms/utils.py ~L42-101",
        "loss", "token-mean", "token", nemo_k3,
        "after PR #2506 (+#2958): exp(x - sg x) weight; token_level_loss=true; "
        "the weight never uses pi_old, so off-policy nothing corrects the sampling"),
    "nemo-k3-onpolicy-approx": _preset(
        "NeMo-RL", "use_on_policy_kl_approximation=true",
        f"{_NEMO} nemo_rl/algorithms/loss/loss_functions.py ~L481-505",
        "loss", "token-mean", "token", nemo_k3_onpolicy_approx,
        "weight exp(log pi - generation_logprobs), differentiable since #2506; old_logp plays "
        "the generation (vLLM) log-probs"),
    "nemo-k3-before-2506": _preset(
        "NeMo-RL", "ClippedPGLossConfig defaults before PR #2506",
        "NVIDIA-NeMo/RL@2369c0a nemo_rl/algorithms/loss/loss_functions.py ~L386-430; "
        "nemo_rl/algorithms/utils.py ~L41-83",
        "loss", "token-mean", "token", nemo_k3_before_2506,
        "the plain clamped K3 in the loss"),
    "slime-k1-loss": _preset(
        "slime", "--use-kl-loss --kl-loss-coef 0.01 (--kl-loss-type k1, the default)",
        f"{_SLIME} slime/utils/ppo_utils.py ~L11-52; slime/backends/megatron_utils/loss.py "
        "~L1116-1130",
        "loss", "seq-mean", "token", slime_k1_loss,
        "sum_of_sample_mean: per-sample token mean (single-turn: one sample per rollout); "
        "--calculate-per-token-loss would make it token-mean"),
    "slime-low-var-kl": _preset(
        "slime", "--use-kl-loss --kl-loss-type low_var_kl",
        f"{_SLIME} slime/utils/ppo_utils.py ~L11-52; slime/backends/megatron_utils/loss.py "
        "~L1116-1130",
        "loss", "seq-mean", "token", slime_low_var_kl,
        "K3 clamped to [-10, 10] only (no log r clamp, unlike verl); 76 of slime's scripts use it"),
    "slime-unbiased-kl": _preset(
        "slime", "--use-kl-loss --kl-loss-type low_var_kl --use-unbiased-kl",
        f"{_SLIME} slime/utils/ppo_utils.py ~L11-52; slime/backends/megatron_utils/loss.py "
        "~L1116-1130 (PR #1004)",
        "loss", "seq-mean", "token", slime_unbiased_kl,
        "the clamp acts on ratio * K3; old_log_probs may be the rollout's "
        "(--use-rollout-logprobs); "
        "with the default k1 the term is ratio * K1 (its gradient on-policy: K1 + 1 per token)"),
    "openrlhf-k1-reward": _preset(
        "OpenRLHF", "--algo.kl.init_coef 0.01 --algo.kl.estimator k1 "
        "--algo.advantage.estimator rloo (or reinforce_baseline, dr_grpo, group_norm)",
        f"{_ORLHF} openrlhf/models/utils.py ~L64-125; "
        "openrlhf/trainer/ppo_utils/experience_maker.py ~L205-300",
        "reward-to-go", "token-mean", "token", openrlhf_k1_reward,
        "the baseline acts on the raw reward only; the default estimator 'gae' (a critic, "
        "lambd 1, gamma 1) is not modelled; K1 of the sampling-time log-probs, clamped to +-10"),
    "openrlhf-k3-loss": _preset(
        "OpenRLHF", "--algo.kl.use_loss --algo.kl.estimator k3",
        f"{_ORLHF} openrlhf/models/utils.py ~L64-95; openrlhf/trainer/ray/ppo_actor.py ~L319-333",
        "loss", "token-mean", "token", openrlhf_k3_loss,
        "aggregate_loss token_level_loss=True (global token count); K3 output clamped to +-10"),
    "openrlhf-unbiased-gradient": _preset(
        "OpenRLHF", "--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.unbiased_gradient",
        "OpenRLHF/OpenRLHF@d3d1920 (PR #1309 head) openrlhf/models/utils.py ~L64-125; "
        "openrlhf/trainer/ray/ppo_actor.py ~L319-327",
        "loss", "token-mean", "token", openrlhf_unbiased_gradient,
        "read at the PR's head d3d1920 (the issue says merged Aug 2026; the merged commit is not "
        "stored); w = pi/pi_old clamped at 10 and detached; the gradient does not see the clamp of "
        "the value"),
    "verl-k1-reward": _preset(
        "verl", "algorithm.use_kl_in_reward=True algorithm.kl_penalty=kl",
        f"{_VERL} verl/trainer/ppo/ray_trainer.py ~L78-110; core_algos.py ~L2187-2250",
        "reward", "token-mean", "token", verl_k1_reward,
        "K1 of old_log_probs per token, summed by the outcome estimators (GRPO/RLOO); the "
        "default adv_estimator gae (a critic) is not modelled"),
    "verl-low-var-kl-loss": _preset(
        "verl", "actor_rollout_ref.actor.use_kl_loss=True (kl_loss_type=low_var_kl)",
        f"{_VERL} verl/workers/utils/losses.py ~L132-141; core_algos.py ~L2215-2250",
        "loss", "token-mean", "token", verl_low_var_kl_loss,
        "loss_agg_mode token-mean (the default); clamps log r [-20, 20], K3 [-10, 10] (PR #2928)"),
    "verl-k3plus-loss": _preset(
        "verl", "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_type=k3+",
        f"{_VERL} verl/trainer/ppo/core_algos.py ~L2187-2212; verl/workers/utils/losses.py "
        "~L132-141",
        "loss", "token-mean", "token", verl_k3plus_loss,
        "works since PR #6058 (Apr 2026; before it raised NotImplementedError); the K2 gradient is "
        "unclamped"),
    "verl-k1plus-loss": _preset(
        "verl", "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_type=k1+",
        f"{_VERL} verl/trainer/ppo/core_algos.py ~L2187-2212",
        "loss", "token-mean", "token", verl_k1plus_loss,
        "the value of K1, the gradient of K2 (since PR #6058)"),
    "verl-k3plus-reward": _preset(
        "verl", "algorithm.use_kl_in_reward=True algorithm.kl_penalty=k3+",
        f"{_VERL} verl/trainer/ppo/ray_trainer.py ~L78-110; core_algos.py ~L2187-2250",
        "reward", "token-mean", "token", verl_k3plus_reward,
        "in the reward the straight-through gradient is detached: the clamped K3 of old_log_probs"),
    "areal-kdrl": _preset(
        "AReaL", "KDRL joint loss: teacher = pi_ref, rl_loss_weight=1.0, distill_loss_weight=0.005",
        "inclusionAI/AReaL@4aef98d areal/trainer/ppo/actor.py ~L482-512",
        "loss", "token-mean", "token", areal_kdrl,
        "docs/en/algorithms/distillation.md L68 calls the gradient unbiased; per micro-batch "
        "token mean (sum / loss_mask.sum())"),
    "skyrl-k3-loss": _preset(
        "SkyRL", "trainer.algorithm defaults (use_kl_loss=true, kl_estimator_type=k3, coef 0.001)",
        f"{_SKYRL} skyrl/backends/skyrl_train/utils/ppo_utils.py ~L88-126; "
        "skyrl/backends/skyrl_train/workers/worker.py ~L1070-1080",
        "loss", "seq-mean", "token", skyrl_k3_loss,
        "each sequence's masked mean, then the mean over the micro-batch's sequences"),
    "skyrl-k2-loss": _preset(
        "SkyRL", "trainer.algorithm.kl_estimator_type=k2",
        f"{_SKYRL} skyrl/backends/skyrl_train/utils/ppo_utils.py ~L88-126",
        "loss", "seq-mean", "token", skyrl_k2_loss,
        "available as a flag today; PR #1445 (open, for issue #805) would make it the default"),
    "tba-prime-k3-loss": _preset(
        "tba-prime (the paper's async code)", "grpo.kl_coef set (K3 kl_penalty in the loss)",
        "bbartoldson/tba-prime@115573d src/zeroband/training/loss.py ~L356-382; "
        "src/zeroband/train.py ~L418-422",
        "loss", "sum", "token", tba_prime_k3_loss,
        "read at the ancestor 115573d: K3 of the batch's stored log-probs, no gradient; the runs' "
        "commit 59c2f8ae (their K1/K3 configurations) is not stored"),
}
