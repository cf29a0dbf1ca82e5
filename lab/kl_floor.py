"""The KL noise floor of bf16 log-probs (docs/precision.md): how much KL rounding alone makes.

The policy is the reference moved by one tiny step (every weight by +-EPS: a random sign, or the
sign of the gradient of the responses' log-likelihood, which is what a first AdamW step does).
Responses are sampled from the reference (no EOS, exactly --max-new-tokens tokens). Each precision
then computes the log-prob of every sampled token under both models through the trainer's own
`logprobs.token_logprobs`, and we print the per-token log-ratio std and the sequence K1 and K3
(eqs. 11, 14; mean over responses) beside float64, the truth. Also the share of weights that sit
exactly on a bf16 number and exactly halfway between two (ties: any update, however small, decides
which way such a weight rounds).

    python -m lab.kl_floor  # the embedded SmolLM2-135M-Instruct, a few seconds
    python -m lab.kl_floor --perturb sign-grad --eps 1e-7
    python -m lab.kl_floor --perturb sign-grad --eps 1e-7 --device cuda --bf16-grid --json F

On CUDA it also prints fp32 with TF32 matmuls and fp16 autocast, the options of the trainer's
no-grad passes that issue 35 times; on a CPU, TF32 emulated (every linear layer's operands rounded
to TF32, to nearest or truncated, the products summed in fp32), to compare a CPU's emulated
matmuls with the GPU's floor. On both, fp32 matmuls rebuilt from bf16 pieces (systems/split_matmul.py:
6 or 3 piece products; bf16 tensor cores on CUDA). --bf16-grid first rounds every weight to bf16,
as Qwen and Llama are released (the embedded model's weights come from a 4-bit GGUF file: 8% bf16
ties).
"""
import argparse
import contextlib
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import data
import kl
import rollout
from systems.split_matmul import bf16_pieces, linears
from systems.model import load_model, load_tokenizer
from logprobs import token_logprobs

parser = argparse.ArgumentParser(description="the KL noise floor of bf16 log-probs")
parser.add_argument("--model", default="smollm2-135m",
                    help="a local directory, a hub id, or smollm2-135m")
parser.add_argument("--perturb", default="random", choices=("random", "sign-grad"),
                    help="random: +-EPS with a random sign; "
                         "sign-grad: EPS in the sign of the gradient (AdamW)")
parser.add_argument("--eps", type=float, default=1e-6, help="how far every weight moves")
parser.add_argument("--responses", type=int, default=2, help="responses sampled from the reference")
parser.add_argument("--max-new-tokens", type=int, default=120, help="tokens per response (no EOS)")
parser.add_argument("--seed", type=int, default=0,
                    help="seeds the prompts' sampling and the random signs")
parser.add_argument("--device", default="cpu", help="cpu or cuda")
parser.add_argument("--bf16-grid", action="store_true",
                    help="round every weight to bf16 first, as models released in bf16 are")
parser.add_argument("--json", default=None, help="also write the rows here (JSON)")


def bf16_grid(model):
    """(share of weights exactly representable in bf16, share exactly halfway between two bf16
    numbers)."""
    total = exact = ties = 0
    for param in model.parameters():
        low_bits = param.detach().float().view(torch.int32) & 0xFFFF  # the 16 bits bf16 drops
        total += low_bits.numel()
        exact += (low_bits == 0).sum().item()
        ties += (low_bits == 0x8000).sum().item()
    return exact / total, ties / total


def tf32(x, truncate=False):
    """x (fp32) with TF32's 10 significand bits: to nearest (ties away from zero), or truncated
    (which of the two a GPU's tensor cores do with fp32 input is not documented)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits if truncate else bits + 0x1000) & ~0x1FFF).view(torch.float32)


def tf32_linear(x, weight, bias=None, truncate=False):
    """F.linear with TF32 operands and fp32 sums, as CUDA computes it with TF32 matmuls on."""
    out = F.linear(tf32(x, truncate), tf32(weight, truncate))
    return out if bias is None else out + bias


@contextlib.contextmanager
def fp32_head(model):
    """Run lm_head in fp32 (outside autocast, on fp32 hidden states) while the rest stays bf16."""
    forward = model.lm_head.forward

    def head(hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            return forward(hidden.float())

    model.lm_head.forward = head
    try:
        yield
    finally:
        model.lm_head.forward = forward


def floor_row(policy, reference, prompts, responses, mask, dtype, tf32=False):
    """(per-token log-ratio std, mean sequence K1, mean sequence K3) with log-probs computed in
    `dtype` (with tf32: fp32 with TF32 matmuls, CUDA)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with torch.no_grad():
            logp = token_logprobs(policy, prompts, responses, mask, 1.0, dtype)[0].double()
            ref_logp = token_logprobs(reference, prompts, responses, mask, 1.0, dtype)[0].double()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    log_ratio = (logp - ref_logp)[mask.bool()]
    # eq. 11, summed over the response (eq. 5)
    k1 = (mask * kl.estimate(logp, ref_logp, "k1")).sum(1).mean()
    k3 = (mask * kl.estimate(logp, ref_logp, "k3")).sum(1).mean()  # eq. 14
    return log_ratio.std().item(), k1.item(), k3.item()


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model)
    reference = load_model(args.model).requires_grad_(False).to(device)
    if args.bf16_grid:
        with torch.no_grad():
            for param in reference.parameters():
                param.copy_(param.bfloat16().float())
    examples = data.load_task("arith", split="test", limit=args.responses, seed=args.seed)
    prompts = [data.prompt_ids(tokenizer, example) for example in examples]
    out = rollout.generate(reference, prompts, args.max_new_tokens, 1.0, 1.0, None,
                           torch.Generator(device=device).manual_seed(args.seed))
    responses, mask = out.tokens, out.response_mask

    policy = copy.deepcopy(reference)
    if args.perturb == "sign-grad":  # the direction of a first AdamW step: lr * sign(gradient)
        policy.requires_grad_(True)
        token_logprobs(policy, prompts, responses, mask, 1.0, torch.float32)[0].sum().backward()
        directions = [param.grad.sign() for param in policy.parameters()]
    else:
        directions = [torch.randint(0, 2, param.shape).to(device).float() * 2 - 1
                      for param in policy.parameters()]
    with torch.no_grad():
        for param, direction in zip(policy.parameters(), directions):
            param.add_(args.eps * direction)
            param.grad = None
    policy.requires_grad_(False)

    exact, ties = bf16_grid(reference)
    moved = (sum((p.bfloat16() != r.bfloat16()).sum().item()
                 for p, r in zip(policy.parameters(), reference.parameters()))
             / sum(p.numel() for p in policy.parameters()))
    print(f"{args.model}: {exact:.1%} of the weights are bf16 numbers, {ties:.1%} bf16 ties; "
          f"the step ({args.perturb}, eps {args.eps:g}) changed {moved:.1%} of them as bf16")
    print(f"{args.responses} responses x {responses.shape[1]} tokens sampled from the reference\n")
    print("| log-probs | per-token log-ratio std | sequence K1 | sequence K3 |\n|---|---|---|---|")
    rows = {}

    def add(name, row):  # printed and written as each row is done: a timeout keeps the rows so far
        rows[name] = dict(zip(("std", "k1", "k3"), row))
        print(f"| {name} | {row[0]:.2g} | {row[1]:.2g} | {row[2]:.2g} |", flush=True)
        if args.json:  # written beside, then renamed: a kill never leaves half a file
            partial = Path(f"{args.json}.partial")
            partial.write_text(json.dumps({
                "flags": vars(args), "bf16_exact": exact, "bf16_ties": ties, "moved": moved,
                "rows": rows}, indent=1) + "\n")
            partial.replace(args.json)
    add("float64 (the truth)", floor_row(copy.deepcopy(policy).double(),
                                         copy.deepcopy(reference).double(), prompts, responses,
                                         mask, torch.float32))
    add("fp32 (train.py's default)",
        floor_row(policy, reference, prompts, responses, mask, torch.float32))
    add("bf16 autocast", floor_row(policy, reference, prompts, responses, mask, torch.bfloat16))
    with fp32_head(policy), fp32_head(reference):
        add("bf16 autocast, fp32 lm_head",
            floor_row(policy, reference, prompts, responses, mask, torch.bfloat16))
    for terms in (6, 3):  # fp32 matmuls from bf16 pieces (systems/split_matmul.py)
        with bf16_pieces(terms):
            add(f"fp32 from bf16 pieces, {terms} products",
                floor_row(policy, reference, prompts, responses, mask, torch.float32))
    if device.type == "cpu":  # TF32 as the GPU computes it, to compare the two devices
        for truncate, name in ((False, "to nearest"), (True, "truncated")):
            with linears(lambda x, w, b: tf32_linear(x, w, b, truncate)):
                add(f"fp32, TF32 matmuls (emulated, {name})",
                    floor_row(policy, reference, prompts, responses, mask, torch.float32))
    if device.type == "cuda":  # the other options of the no-grad passes (issue 35)
        add("fp32, TF32 matmuls",
            floor_row(policy, reference, prompts, responses, mask, torch.float32, tf32=True))
        add("fp16 autocast", floor_row(policy, reference, prompts, responses, mask, torch.float16))


if __name__ == "__main__":
    main()
