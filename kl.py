"""KL regularization: the three estimators and where they go (paper sec. 3, Table 1).

We regularize the sequence-level reverse KL(pi || pi_ref) with a sum of token-level estimates
(eq. 5), computed from the log-probs of the sampled tokens under the policy (`logp`) and the
reference (`ref_logp`):

    K1_t = log pi/pi_ref                          (eq. 11, the "naive" estimator)
    K2_t = 1/2 (log pi/pi_ref)^2                  (the squared log-ratio, for comparison)
    K3_t = r - 1 - log r,   r = pi_ref/pi         (eq. 14, Schulman's estimator)

An estimate can be placed in two spots (sec. 3.1), and that choice, not the estimator, decides which
gradient you get:

    place="reward": R_i - beta * sum_t sg[KL_t] is the return (eq. 7);
                    score-function gradient (eq. 8)
    place="loss":   beta * sum_t KL_t is added to the loss;  path-wise gradient (eq. 9)
    place="both":   both of the above;  score + path-wise = the full gradient (eq. 6, 29)
    place="none":   no KL at all (beta = 0)
    place="weighted": w sg[K1] in the loss, w = prod_t pi/mu (off_policy_kl_loss; train.py's loop)

In the reward, the KL may also be summed from each token to the end (`kl_to_go`): token t's return
is R - beta sum_{s>=t} sg[KL_s]. The paper suggests it (app. F.3, last paragraph: remove the past
tokens from the sum to reduce variance); OpenRLHF's per-token KL reward with gamma = 1 computes it.
The KL of earlier tokens has no expected gradient (E[grad log pi(y_t | y<t) | y<t] = 0), so for K1
this is still grad KL, usually with less variance (toy.kl_gradient_moments: 4x less at T = 8; not
always, e.g. at T = 2 with pi near pi_ref; test_kl.py checks the mean exactly).

On-policy, the expected gradient of the KL term is then (test_kl.py checks each line exactly):

    k1 reward  E[K1 * grad log pi(y)]               = grad KL              unbiased  (eqs. 10, 12)
    k1 loss    E[sum_t grad K1_t]                   = 0                    biased    (eq. 13)
    k3 reward  grad KL + E[sum_t r_t grad log pi(y)] - grad E[T]           biased    (eqs. 15, 19)
    k3 loss    sum_t E[grad KL(pi_ref(.|y<t) || pi(.|y<t))]  (token fwd KL) biased   (eqs. 16, 41)
    k1/k3 both grad KL                                                     unbiased  (sec. 3.1, 4.3)

The paper (arXiv 2512.21852, app. F.4) numbers two consecutive lines (41): we cite the second,
sum_t E_{y<t}[grad KL(pi_ref || pi)]; the first is the same expectation written with y_t ~ pi_ref.

Off-policy (samples of mu != pi, the ratio pi/mu per token) every line above is biased; "weighted",
E_mu[w K1 grad log pi(y)] = grad KL, is not (test_kl.py: test_off_policy_table1).

T is the response length, EOS included. The "-1" of K3 sums to -T, so with lengths that vary (a
response ends at EOS) K3-in-reward also carries -grad E[T], which eqs. 15 and 43 leave out (it is
0 at a fixed T); either way it is grad KL minus the K3-in-loss gradient (eq. 45). test_kl.py checks
both fixed and EOS-ended lengths.

Shapes: logp, ref_logp, mask are (B, T) per response token. `mask` is multiplied in everywhere, so a
float mask weights tokens (0 on padding). `num_tokens` is the normalizer, the total number of
response tokens in the whole batch (all micro-batches and ranks), the same one
`advantage.policy_loss` uses.
"""

import torch

KINDS = ("k1", "k2", "k3")
PLACES = ("reward", "loss", "both", "none", "weighted")
CLAMPS = ("none", "verl")  # verl's low_var_kl bounds on K3 (the paper ran verl: our inference)
# off_policy_kl_loss caps w at e^30 (1e13): one sequence's update past it overflows fp32
MAX_LOG_W = 30.0


def _check(kind, place):
    if kind not in KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}: choose one of {', '.join(KINDS)}")
    if place not in PLACES:
        raise ValueError(f"unknown KL place {place!r}: choose one of {', '.join(PLACES)}")


def estimate(logp, ref_logp, kind, clamp="none"):
    """Per-token KL estimate, shape (B, T), differentiable in `logp`.

    clamp="verl" bounds K3 as verl's `low_var_kl` does (K1 and K2 are never clamped there): log r to
    [-20, 20], then K3 to [-10, 10]; a clamped value has zero gradient. The default is the exact
    estimator.
    """
    _check(kind, "none")
    if clamp not in CLAMPS:
        raise ValueError(f"unknown KL clamp {clamp!r}: choose one of {', '.join(CLAMPS)}")
    if kind == "k1":
        # Table 1: K1-in-reward, K1-in-loss, both (their estimator, K1)
        # eq. 11: K1_t = log pi - log pi_ref
        return logp - ref_logp
    if kind == "k2":
        # K2_t = 1/2 (log pi - log pi_ref)^2
        return 0.5 * (logp - ref_logp) ** 2
    # Table 1: K3-in-reward, K3-in-loss, both (their estimator, K3)
    # eq. 14: K3_t = r - 1 - log r, written as expm1(log r) - log r: exact when r ~ 1, and >= 0
    log_r = ref_logp - logp
    if clamp == "verl":
        log_r = log_r.clamp(-20, 20)
        return (torch.expm1(log_r) - log_r).clamp(-10, 10)
    return torch.expm1(log_r) - log_r


def shape_rewards(scores, logp, ref_logp, mask, kind, place, beta, clamp="none"):
    """Sequence returns (B,): R - beta * sum_t sg[KL_t] for place reward/both (eq. 7), else R.

    The result is detached: the KL reaches the policy only through the advantage (eq. 8).
    """
    _check(kind, place)
    if place not in ("reward", "both"):
        return scores.detach()
    kl = estimate(logp.detach(), ref_logp.detach(), kind, clamp)
    # Table 1: K1-in-reward, K3-in-reward, both (the reward's half)
    # eq. 7: R - beta * sum_t sg[KL_t]
    return (scores - beta * (mask * kl).sum(-1)).detach()


def kl_loss(logp, ref_logp, mask, kind, place, beta, num_tokens, clamp="none"):
    """Scalar KL loss: beta * sum_{i,t} mask * KL_t / num_tokens for place loss/both (eq. 9),
    else 0."""
    _check(kind, place)
    if place not in ("loss", "both"):
        return logp.new_zeros(())
    kl = estimate(logp, ref_logp.detach(), kind, clamp)
    # Table 1: K1-in-loss, K3-in-loss, both (the loss's half)
    # eq. 9: the path-wise term, beta * sum_t grad KL_t, token-normalized like the policy loss
    return beta * (mask * kl).sum() / num_tokens


def off_policy_kl_loss(logp, behaviour_logp, ref_logp, mask, beta, num_tokens,
                       max_log_w=MAX_LOG_W, log_normalizer=0.0):
    """The KL term for samples of a behaviour policy mu != pi: beta sum_i w_i sg[K1_i] / num_tokens,
    w_i = prod_t pi/mu over sequence i's tokens (mask > 0; `mask` may carry weights), K1_i = sum_t
    log pi/pi_ref detached. Its expected gradient under mu is E_pi[K1 grad log pi(y)] = grad KL:
    unbiased off-policy, where Table 1's configurations are biased (test_kl.py enumerates both);
    on-policy it is K1-in-reward's. `max_log_w`: w capped at e^max_log_w (log C: the truncated
    min(w, C)); `log_normalizer`: log of the batch's mean weight (self-normalized), 0 for none:
    train.py's --is-weight, their biases in docs/training.md."""
    # Table 1: weighted (beside the table): w sg[K1], its gradient unbiased off-policy
    log_w = log_importance_weights(logp, behaviour_logp, mask)
    k1 = (mask * (logp - ref_logp).detach()).sum(-1)
    w = (log_w.detach().double() - log_normalizer).clamp(max=max_log_w).exp()
    # sg[w] exp(log w - sg[log w]) = w, with gradient w grad log w = w grad log pi(y)
    weighted = w * k1.double() * torch.exp(log_w - log_w.detach())
    return beta * weighted.sum().to(logp.dtype) / num_tokens


def log_importance_weights(logp, behaviour_logp, mask):
    """log w_i = sum_t log pi/mu over sequence i's tokens (mask > 0), (B,), differentiable in
    `logp`."""
    return ((logp - behaviour_logp.detach()) * (mask > 0)).sum(-1)


def kl_to_go(logp, ref_logp, mask, kind, clamp="none"):
    """Per-token KL to go, sum_{s>=t} mask_s KL_s, shape (B, T), detached: the KL part of token t's
    return when the KL is a per-token reward (R - beta * kl_to_go gives per-token advantages).
    No flag of train.py uses it (the paper's runs put the sequence's KL in the reward);
    toy.kl_gradient_moments measures its variance, test_kl.py its mean, classroom E5 grades it."""
    kl = mask * estimate(logp.detach(), ref_logp.detach(), kind, clamp)
    # sum over s >= t: a cumulative sum from the end
    return kl.flip(-1).cumsum(-1).flip(-1)
