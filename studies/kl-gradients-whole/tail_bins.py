"""K3's value by ratio bin, drawn against expected, from the run's per-sequence records (issue 36).
A diagnostic made after the results (post hoc), for the tail rule's "bug" verdict at step 20.

Each chunk records, per sequence, K3 summed over its sampled tokens of ratio r = pi_ref / pi at most R
(`k3_below_R`), its exact expectation over the same prefixes (`k3_below_R_exact`, sums over the
vocabulary), and the expected number of sampled tokens of ratio over R (`tail_prob_R`), for R = 10,
100 and 1,000; `k3` and `kl` are the same with every token. Differences give each bin of ratios,
at most 10, (10, 100], (100, 1000] and over 1,000: K3 drawn there against expected, the number of
sequences that drew a token there against the expected number of such tokens, and the K3 a draw
carries (drawn: the mean over the sequences that drew one; expected: the exact mass over the expected
count). For each bin also the sequences expected to draw at least one: each sequence's probability
taken as 1 - exp(-lambda), lambda its expected number of draws there (a Poisson count; for a sum of
Bernoullis it is a lower bound), with the central 95% of their number and the probability of at most
the number drawn, from 100,000 simulated sets of sequences.

    python studies/kl-gradients-whole/tail_bins.py /work/runs/kl-gradients-whole/chunks 24 \\
        > studies/kl-gradients-whole/tail_bins.txt     # the first 24 chunks: results.json's groups
    python studies/kl-gradients-whole/tail_bins.py /work/runs/kl-gradients-whole/chunks/step_5 48
"""
import sys
from pathlib import Path

import numpy as np
import torch

BINS = (("at most 10", None, "10"), ("(10, 100]", "10", "100"), ("(100, 1000]", "100", "1000"),
        ("over 1000", "1000", None))


def per_sequence(directory, chunks):
    """{record: all sequences' values} over the first `chunks` chunks of one distance, in order."""
    seqs = [torch.load(directory / f"chunk_{c:05d}.pt", mmap=True, weights_only=False)["seqs"]
            for c in range(chunks)]
    return {k: np.concatenate([s[k] for s in seqs]) for k in seqs[0]}, len(seqs)


def sequences_drawing(count, drawn, simulations=100_000, seed=0):
    """The central 95% of the number of sequences that draw at least one token of the bin, each
    with probability 1 - exp(-its expected count), and P(that number <= drawn), simulated."""
    p = 1 - np.exp(-count)
    p = p[p > 0]
    rng = np.random.default_rng(seed)
    n = np.concatenate([(rng.random((10_000, len(p))) < p).sum(1)
                        for _ in range(simulations // 10_000)])
    low, high = np.quantile(n, [0.025, 0.975])
    return int(low), int(high), float((n <= drawn).mean())


def mass(s, R, exact):
    """K3 over tokens of ratio <= R (None: every token), drawn or exact, per sequence."""
    if R is None:
        return s["kl"] if exact else s["k3"]
    return s[f"k3_below_{R}_exact" if exact else f"k3_below_{R}"]


def main(root, chunks=24):
    """`root`: the chunks of one distance, or a folder of distances (each read to `chunks`)."""
    root = Path(root)
    for directory in [root] if any(root.glob("chunk_*.pt")) else sorted(root.iterdir()):
        s, chunks = per_sequence(directory, int(chunks))  # the first `chunks`: results.json's groups
        n = len(s["k3"])
        print(f"\n## {directory.name}: {chunks} chunks, {n} sequences")
        print("| ratio bin | K3 drawn, nats a sequence | expected | sequences that drew one "
              "| expected draws | expected sequences [95%], P(at most drawn) | K3 a draw: drawn "
              "| expected | largest drawn |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, low, high in BINS:
            drawn = mass(s, high, False) - (mass(s, low, False) if low else 0)
            expected = mass(s, high, True) - (mass(s, low, True) if low else 0)
            if low is None:
                print(f"| {label} | {drawn.mean():.3f} | {expected.mean():.3f} | - | - | - | - "
                      f"| - | - |")
                continue
            count = s[f"tail_prob_{low}"] - (s[f"tail_prob_{high}"] if high else 0)
            hit = np.abs(drawn) > 1e-9
            per_draw = drawn[hit].mean() if hit.any() else float("nan")
            seq_low, seq_high, p_at_most = sequences_drawing(count, hit.sum())
            print(f"| {label} | {drawn.mean():.4f} | {expected.mean():.4f} | {hit.sum()} "
                  f"| {count.sum():.1f} | {(1 - np.exp(-count)).sum():.1f} [{seq_low}, {seq_high}], "
                  f"{p_at_most:.4f} | {per_draw:.1f} | {expected.sum() / count.sum():.1f} "
                  f"| {drawn.max():.1f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
