"""The exercises: which functions each one blanks, its points, its statement. The one list that
`handout` (what to blank), `grade` (what to score) and the sync test (test_classroom.py) read.

An exercise is the functions it names, blanked whole: the body becomes the docstring and
`raise NotImplementedError("E1: ...")`. The solution files stay as they are, with no markers.
`withheld` functions are blanked too, not graded: they would give the answer away (E3's answer is
in toy.converge). `shared` lines of the answer that the kept code may also hold (a helper call)
are the only ones the leak check lets through. Its checks are classroom/checks/<id>_*.py.
"""
from dataclasses import dataclass


@dataclass
class Exercise:
    id: str  # "E1"
    title: str
    functions: tuple  # ("kl.py", "estimate"), ...: module file and top-level function, blanked
    minutes: int  # expected time for a student
    statement: str  # what to do, with the paper's equations by number (the student README)
    hint: str  # for the student README; each check has its own hint
    withheld: tuple = ()  # (file, function) blanked because it holds the answer, not graded
    shared: tuple = ()  # stripped lines of the answer the handout may keep (shared helper calls)


EXERCISES = [
    Exercise(
        "E1", "The three KL estimators", (("kl.py", "estimate"),), 30,
        "Implement `kl.estimate`: K1 (eq. 11), K2 = 1/2 (log-ratio)^2 and K3 (eq. 14) per "
        "token. K3 must be non-negative and accurate near r = 1 in float32 and bfloat16 (where "
        "r - 1 - log r cancels), and clamp='verl' bounds it as verl's low_var_kl does (see the "
        "docstring). Graded: values against float64 oracles at random log-probs, K3's relative "
        "error near r = 1, its sign over [-30, 30], gradients in logp, the clamp.",
        "Write K3 in terms of log r; which torch function computes e^x - 1 without cancelling?"),
    Exercise(
        "E2", "Where the KL goes: reward or loss",
        (("kl.py", "shape_rewards"), ("kl.py", "kl_loss")), 30,
        "Implement `kl.shape_rewards` (eq. 7: R - beta sum_t sg[KL_t], for places reward/both) "
        "and `kl.kl_loss` (eq. 9: beta sum mask KL / num_tokens, for places loss/both). Graded: "
        "values, that no gradient flows through the shaped return or into ref_logp, that the "
        "loss's gradient is the path-wise one, masks as weights, the num_tokens normalization.",
        "The return is a constant to the optimizer (stop-gradient); the loss divides by the "
        "batch's num_tokens, not by the row's length."),
    Exercise(
        "E3", "Table 1 by exact enumeration", (("toy.py", "expected_gradient"),), 50,
        "Implement `toy.expected_gradient`: enumerate all 2^T sequences of the sec. 3.3 toy model "
        "(eqs. 17-18) and return the exact expected gradient of one configuration's KL term "
        "through `toy.training_loss`. `toy.training_loss` calls E2's `kl.shape_rewards` and "
        "`kl.kl_loss` and E4's `advantage.policy_loss`: the grader puts its own versions in "
        "their place, so E3 can be done before E2 and E4 (your own runs of it need them). "
        "Graded against independent references: K1-in-reward is grad KL (eqs. 21-23), "
        "K1-in-loss is 0 (eq. 13), K3-in-reward is grad KL plus eq. 19's bias term, K3-in-loss "
        "is eq. 41. `toy.converge`, `toy.off_policy_variance` and `toy.kl_gradient_moments` are "
        "withheld from this handout (they use the answer), so `python toy.py` does not run.",
        "An expectation over all sequences is a sum weighted by pi(y); that weight is a "
        "probability, not part of the model the gradient flows through.",
        # enumerating and the toy's log-probs, as figure1 and toy.py's other studies do
        shared=("y, _ = all_sequences(T)", "logp = bernoulli_logp(toy_logits(a, b, y), y)"),
        withheld=(("toy.py", "converge"), ("toy.py", "off_policy_variance"),
                  ("toy.py", "kl_gradient_moments"))),
    Exercise(
        "E4", "RLOO and the PPO-clip loss",
        (("advantage.py", "rloo"), ("advantage.py", "policy_loss")), 40,
        "Implement `advantage.rloo` (the leave-one-out baseline of sec. 4.1) and "
        "`advantage.policy_loss` (eq. 4's clipped surrogate summed over tokens / num_tokens, with "
        "clip_frac). Graded: values; the baseline adds no expected gradient (every group of G "
        "samples enumerated); clipping by hand, with positive and negative advantages.",
        "The baseline of sample i must not depend on sample i. The clipped branch is active where "
        "it is the larger of the two losses.",
        shared=("R = _groups(returns, group_size)",)),
    Exercise(
        "E5", "The KL to go (OpenRLHF's per-token KL reward)", (("kl.py", "kl_to_go"),), 35,
        "Implement `kl.kl_to_go`: per token, the sum of the KL estimates from that token to the "
        "end, sum_{s>=t} mask_s KL_s, detached: eq. 32's score-function term with the past "
        "tokens removed from the inner sum (app. F.3, last paragraph). Graded: values with "
        "masks; with K1 it leaves the expected gradient at grad KL (exact enumeration of the toy "
        "model, per-token advantages); the exact variance of the gradient it gives equals the "
        "definition's (usually lower than the whole sequence's, 4x at T = 8, but not always).",
        "A sum over s >= t is a cumulative sum read from the end."),
    Exercise(
        "E6", "Sampling with temperature and top-p", (("rollout.py", "sample"),), 45,
        "Implement `rollout.sample`: temperature scales the logits (temperature 0 is greedy: the "
        "argmax, log-prob 0), top-p keeps the smallest set of most likely tokens whose mass "
        "reaches p (the token that crosses p included) and renormalizes; each row's token is "
        "the first in vocabulary order whose cumulative probability exceeds its uniform times "
        "the total mass (`rollout.inverse_cdf` does this; `draw`, where given, is called in its "
        "place with the same arguments: the GPU's step passes one by blocks, the grader never "
        "does); return the log-prob under exactly the distribution sampled (eq. 4's pi_old). "
        "Graded against a float64 oracle at random logits, temperatures and top-p: greedy at "
        "temperature 0, the tokens drawn, their log-probs, the token that crosses p.",
        "The log-prob the trainer needs is of the tempered, truncated, renormalized distribution."),
    Exercise(
        "E7", "The KV cache", (("rollout.py", "sdpa_attention"), ("rollout.py", "decode")), 75,
        "Implement `rollout.sdpa_attention` (write this step's keys and values into the cache at "
        "their positions, attend over the cached slots with the causal bias, grouped-query "
        "heads; return shape (n, L, kv_heads, groups, head_dim), query head h = kv_head * "
        "groups + group) and `rollout.decode` (one new token per row: next-token logits (rows, "
        "V) in float32), the decode step `train.py` samples with. Graded: greedy output equals "
        "Hugging Face's generate, log-probs equal its full forward pass, and decoding feeds "
        "exactly one token per row per step (a forward hook counts).",
        "Each row's new K/V go to slot `positions`; decode must not feed the prefix again.",
        # the GPU's FlexAttention branch (systems/cuda_decode.py) writes the cache and folds the
        # heads as sdpa_attention does
        withheld=(("systems/cuda_decode.py", "flex_attention"),)),
    Exercise(
        "E8", "An experiment on the CPU", (), 120,
        "Train the embedded model twice on `arith` with K1 in the reward and K1 in the loss at "
        "beta = 1 (`python train.py --kl k1 --place reward --beta 1 --steps 20 --out "
        "experiment/k1-reward` and the same with `--place loss`, 10-25 min each on 2 CPU "
        "cores), plot them (`python plot.py experiment/k1-reward experiment/k1-loss --out "
        "experiment/plot.png`), and answer in experiment/answer.md (at most 300 words): which run "
        "stays closer to the reference (compare `kl_k1` in metrics.jsonl over the last steps), "
        "and why, by Table 1? Graded here: the runs and the plot; the answer by your "
        "instructor's rubric. The runs use your own files, so unlike E1-E7 this exercise is not "
        "graded on its own code: the check that each run's numbers obey train.py's accounting "
        "(return = reward - beta kl_k1, kl_loss = beta kl_k1 / response_len) fails while E2 is "
        "wrong. Do it last.",
        "Both runs need config.json and metrics.jsonl from train.py with the flags above: the "
        "grader checks that their numbers are train.py's own (they obey its accounting) and "
        "that the plot is plot.py's figure of them."),
]
BY_ID = {exercise.id: exercise for exercise in EXERCISES}
