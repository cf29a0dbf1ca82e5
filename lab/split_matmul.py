"""An experiment for the no-grad log-prob passes (issue 35): fp32 matmuls from bf16 tensor cores.

The fp32 no-grad passes keep the KL the policy's (docs/precision.md), but an H200 runs them at
3.1% MFU: fp32 matmuls do not use the tensor cores, and TF32, bf16 and fp16 round so coarsely that
the KL of a tiny step reads as noise (TF32's K1 +8,384% on the embedded model). Here each fp32
matmul is rebuilt from bf16 pieces, the way cuBLAS's fp32 emulation on newer cards does:
- x = x0 + x1 + x2 and W = W0 + W1 + W2, each piece a bf16 number (x0 = bf16(x), x1 = bf16(x - x0),
  ...): three pieces hold all 24 bits of an fp32 significand, so the split is exact (subnormals
  and values near the fp32 range's edges aside);
- x W^T = sum over (i, j) of xi Wj^T; a product of two bf16 numbers is exact in fp32, and a piece
  pair (i, j) weighs about 2^(-8 (i + j)), so `terms=6` keeps the pairs with i + j <= 2 (the
  dropped ones weigh ~2^-24, fp32's own rounding) and `terms=3` those with i + j <= 1 (~2^-16);
- on CUDA each product is a bf16 tensor-core GEMM with fp32 output and accumulation (torch.mm's
  out_dtype, CUDA only); elsewhere the same products as fp32 GEMMs of the pieces (equal up to the
  order of the fp32 sums), so a CPU measures the numbers that a GPU will give.
Six bf16 GEMMs cost less than one fp32 GEMM where bf16 runs ~15x faster (A100, H100, H200).
`bf16_pieces(terms)` turns it on for every F.linear inside a `with` (all of a transformers model's
projections and its output layer; attention's own matmuls stay fp32). lab.kl_floor measures its KL
floor, `lab.bench_train --parts precision` its time; train.py keeps plain fp32 until a GPU run says
(the rule of docs/precision.md).
"""
import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TERMS = (3, 6)


def bf16_split(x, pieces=3):
    """`pieces` bf16 tensors whose sum is x (fp32): each one the bf16 rounding of what is left."""
    parts, rest = [], x.float()
    for _ in range(pieces):
        part = rest.bfloat16()
        parts.append(part)
        rest = rest - part.float()
    return parts


def product(a, b):
    """a @ b.T in fp32 from bf16 a and b: a tensor-core GEMM on CUDA, the exact products' fp32
    GEMM elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b.t(), out_dtype=torch.float32)  # torch 2.8 or later
    return a.float() @ b.float().t()


def split_linear(x, weight, bias=None, terms=6):
    """F.linear(x, weight, bias) in fp32 from the bf16 piece pairs (i, j) with i + j <= 2 (terms=6)
    or <= 1 (terms=3), the smallest added first."""
    depth = {3: 1, 6: 2}[terms]
    xs = bf16_split(x.reshape(-1, x.shape[-1]), depth + 1)
    ws = bf16_split(weight, depth + 1)
    out = None
    for total in range(depth, -1, -1):  # pieces of weight 2^(-8 total), smallest first
        for i in range(total + 1):
            term = product(xs[i], ws[total - i])
            out = term if out is None else out.add_(term)
    if bias is not None:
        out = out + bias.float()
    return out.view(*x.shape[:-1], weight.shape[0])


class _Linears(TorchFunctionMode):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].dtype == torch.float32:
            return self.linear(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def linears(linear):
    """Inside the `with`, every fp32 F.linear(x, weight, bias) runs as linear(x, weight, bias)."""
    with _Linears(linear):
        yield


@contextlib.contextmanager
def bf16_pieces(terms=6):
    """Inside the `with`, every fp32 F.linear runs as split_linear(terms)."""
    if terms not in TERMS:
        raise ValueError(f"terms is one of {TERMS}, not {terms}")
    previous = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    # cuBLAS may otherwise reduce a split-K GEMM's partial sums in bf16
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        with linears(functools.partial(split_linear, terms=terms)):
            yield
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = previous
