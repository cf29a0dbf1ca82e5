"""The lab: instruments that measure the paper's components at the root, never imported by them.

Run each from the repository's root as a module, e.g. `python -m lab.study fig3`:
- kl_gradients (with kl_stats, kl_chunks, kl_coords: its statistics, chunks and coordinates): Table 1
  measured on SmolLM2's gradients;
- check_kl: any KL term's exact expected gradient on the toy model, on- and off-policy (its verdict);
- study, study_report: the paper's findings over seeds, with pre-registered verdicts;
- kl_floor: the KL noise floor of bf16 log-probs (docs/precision.md), with the root's split_matmul
  (fp32 from bf16 pieces);
- bench_rollout, bench_memory, bench_train: sampler speed; a training run's peak memory and step
  time; a training step's phases, MFU and peak memory on a GPU;
- memory_plan: a run's memory per rank and phase, computed from the code (docs/gpu.md);
- gpu_check: one acceptance command for a CUDA machine.
"""
