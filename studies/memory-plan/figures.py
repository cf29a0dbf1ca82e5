"""Every figure docs/gpu.md's memory section and README quote, recomputed from the committed files
(cpu-*.json, h200_trace.md) and from lab/memory_plan.py's plan of the recipes docs/gpu.md names;
the earlier plan (commit 61fea9b) on the untied model's run where its directory exists
(`python studies/memory-plan/fsdp_trace.py build /tmp/wide-root`). Run from the repository's
root: python studies/memory-plan/figures.py (~1 min: it traces 7B passes)."""
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import rollout  # noqa: E402
import train  # noqa: E402
from lab import memory_plan  # noqa: E402

HERE, GB = Path(__file__).parent, 1e9

gaps = []  # measured - planned, GB, each phase of each CPU run
for path in sorted(HERE.glob("cpu-*.json")):
    run = json.loads(path.read_text())
    gaps += [(run["measured"][phase] - sum(parts.values())) / GB
             for phase, parts in run["table"].items()]
    print(f"{path.name}: measured - planned, GB: " + ", ".join(
        f"{phase} {(run['measured'][phase] - sum(parts.values())) / GB:+.3f}"
        for phase, parts in run["table"].items()))
print(f"CPU runs, measured - planned: {min(gaps):.3f} to {max(gaps):.3f} GB, "
      f"median {sorted(gaps)[len(gaps) // 2]:.3f}")

# the plan before FSDP2's moments (commit 61fea9b) on the untied model's run
with tempfile.NamedTemporaryFile("w", suffix=".py") as file:
    file.write(subprocess.run(["git", "show", "61fea9b:lab/memory_plan.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout)
    file.flush()
    spec = importlib.util.spec_from_file_location("memory_plan_61fea9b", file.name)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
run = json.loads((HERE / "cpu-fsdp2-wide-root.json").read_text())
if Path(run["facts"]["model"]).is_dir():  # fsdp_trace.py build /tmp/wide-root
    argv = ("--kl k1 --place reward --max-new-tokens 32 --prompts-per-step 2 --micro-batch 2 "
            f"--fsdp --model {run['facts']['model']}").split()
    table, _ = earlier.plan(train.parser.parse_args(argv), 2, 80 * GB,
                            run["facts"]["prompt_tokens"], "cpu")
    print("the earlier plan on the untied model's run, measured - planned, GB: " + ", ".join(
        f"{phase} {(run['measured'][phase] - sum(parts.values())) / GB:+.3f}"
        for phase, parts in table.items()))

rows = [line.split("|")[1:-1] for line in (HERE / "h200_trace.md").read_text().splitlines()[2:]]
for name, traced, measured, ratio in rows:
    peak = float(measured.split("(")[0])
    print(f"H200, {name.strip()}: traced {traced.strip()}, measured {peak}, ratio {ratio.strip()}, "
          f"gap {peak - float(traced):.2f} GB")
gap = float(rows[2][2].split("(")[0]) - float(rows[2][1])
ratio = float(rows[2][1]) / float(rows[2][2].split("(")[0])

recipes = memory_plan.recipes((ROOT / "docs" / "gpu.md").read_text())
for index in (0, 3):  # the 8-GPU command, Fig. 7
    label, ranks, argv = recipes[index]
    flags = train.parser.parse_args(argv)
    prompt_tokens, _ = memory_plan.longest_prompt(flags, own_tokenizer=False)
    table, facts = memory_plan.plan(flags, ranks, 80 * GB, prompt_tokens, "cuda")
    print(f"\n{label}: {facts['generate_rows']} of {facts['rows_per_rank']} rows a call, "
          f"prompts of {prompt_tokens}")
    for phase, parts in table.items():
        print(f"  {phase}: {sum(parts.values()) / GB:.2f} = "
              + " + ".join(f"{b / GB:.2f} {n}" for n, b in parts.items()))
    for phase, moments in facts["moments"].items():
        print(f"  {phase}, each moment above the parts held all step: "
              + ", ".join(f"{moment} {nbytes / GB:.2f}" for moment, nbytes in moments.items()))
    passes = next(nbytes for name, nbytes in table["gradient pass"].items() if "(traced)" in name)
    total = sum(table["gradient pass"].values())
    print(f"  gradient pass with the H200's gap: {(total + gap * GB) / GB:.1f} GB, at its ratio: "
          f"{(total - passes + passes / ratio) / GB:.1f} GB")
    print(f"  host: {4 * facts['params'] / GB:.1f} GB a rank, {8 * 4 * facts['params'] / GB:.0f} "
          f"a node of 8; a checkpoint (fp32 weights and AdamW) {12 * facts['params'] / GB:.1f} GB")

for name, rows_per_rank in (("meta-llama/Llama-3.1-8B-Instruct", 160), ("Qwen/Qwen2.5-7B", 640)):
    with torch.device("meta"):
        model = memory_plan.fake_model(memory_plan.config_of(name), torch.bfloat16)
    per_token = 2 * math.prod(rollout.cache_shape(model, 1, 1)) * 2
    print(f"{name}: {per_token:,} B a token; {rows_per_rank} rows x 3,112 slots: "
          f"{rows_per_rank * 3112 * per_token / GB:.1f} GB")
