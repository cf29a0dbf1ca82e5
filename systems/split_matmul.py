"""fp32 matmuls from bf16 tensor cores: --logprob-dtype bf16x6, the no-grad log-prob passes' default
on CUDA (issue 35).

Why: docs/precision.md (its fifth option, picked by its registered rule on an H200). How, for each
linear layer's x W^T:
- x = x0 + x1 + x2 and W = W0 + W1 + W2, each piece a bf16 tensor (x0 = bf16(x), x1 = bf16(x - x0),
  x2 = bf16(x - x0 - x1)): each residual is at most half a bf16 ulp, so three pieces of 8 bits
  hold an fp32 significand's 24 exactly, for |x| from ~2^-110 up to 3.39e38 (smaller values lose
  bits in bf16's subnormals; larger ones and infinities round to inf, and the output gets NaN);
- x W^T = sum over the piece pairs (i, j) of xi Wj^T, a pair weighing about 2^(-8 (i + j)) of the
  whole. `terms=6` keeps the six pairs with i + j <= 2 (the three it drops weigh ~2^-24, fp32's own
  rounding: the "bf16x6" of Henry, Tang and Heinecke, 2019; cuBLAS's fp32 emulation on newer cards
  keeps all nine), `terms=3` the three with i + j <= 1 (~2^-16);
- one GEMM computes the whole sum: the pairs laid side by side along the inner dimension,
  [x2 x1 x0 ...] [W0 W1 W2 ...]^T, smallest pairs first, one fp32 output. On CUDA it is a bf16
  tensor-core GEMM with fp32 output and accumulation (torch.mm's out_dtype, torch 2.8 or later);
  elsewhere the fp32 GEMM of the same pieces (a product of two bf16 numbers is exact in fp32).
  Tensor cores need not add in IEEE fp32 (they may align and truncate), so a CPU predicts the
  floor that a GPU measures.
Six bf16 products cost less than one fp32 product where bf16 runs ~15x faster (A100, H100, H200).
`bf16_pieces(terms)` turns it on for every fp32 F.linear inside a `with` (all of a transformers
model's projections and its output layer; attention's own matmuls stay fp32). lab.kl_floor
measures its KL floor, `lab.bench_train --parts precision` its time. On an H200 it kept float64's
K1 and K3 within 0.14% on both of docs/precision.md's models, in 0.83 of fp32's time at the 1.5B
shape, so train.py's no-grad passes use it on CUDA (runtime.logprob_dtype; a CPU keeps plain fp32).
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# the piece pairs (i, j) of xi Wj^T each option sums, the smallest first
PAIRS = {6: [(2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)], 3: [(1, 0), (0, 1), (0, 0)]}
OUT_DTYPE = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 8)


def bf16_split(x, pieces=3):
    """`pieces` bf16 tensors whose sum is x (fp32): each one the bf16 rounding of what is left."""
    parts, rest = [], x.float()
    for _ in range(pieces):
        part = rest.bfloat16()
        parts.append(part)
        rest = rest - part.float()
    return parts


def mm_fp32(a, b):
    """a @ b.T in fp32 from bf16 a and b: a tensor-core GEMM on CUDA, the exact products' fp32
    GEMM elsewhere."""
    if not a.is_cuda:
        return a.float() @ b.float().t()
    if not OUT_DTYPE:
        raise RuntimeError("fp32 from bf16 pieces needs torch.mm's out_dtype on CUDA: torch 2.8 or "
                           f"later, this is {torch.__version__}")
    return torch.mm(a, b.t(), out_dtype=torch.float32)


def split_linear(x, weight, bias=None, terms=6):
    """F.linear(x, weight, bias) in fp32 from the bf16 piece pairs PAIRS[terms], in one GEMM."""
    pairs = PAIRS[terms]
    xs = bf16_split(x.reshape(-1, x.shape[-1]), 1 + max(i for i, _ in pairs))
    ws = bf16_split(weight, 1 + max(j for _, j in pairs))
    out = mm_fp32(torch.cat([xs[i] for i, _ in pairs], dim=1),
                  torch.cat([ws[j] for _, j in pairs], dim=1))
    if bias is not None:
        out = out + bias.float()
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_arguments(input, weight, bias=None):
    """F.linear's arguments, however they were passed."""
    return input, weight, bias


class _Linears(TorchFunctionMode):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, bias = linear_arguments(*args, **kwargs)
        if x.dtype != torch.float32:
            return func(*args, **kwargs)
        if torch.is_autocast_enabled(x.device.type):  # it would cast the pieces' GEMM back down
            raise RuntimeError("an fp32 linear layer replaced under autocast: leave autocast off")
        return self.linear(x, weight, bias)


def linears(linear):
    """Inside the `with`, every fp32 F.linear(x, weight, bias) runs as linear(x, weight, bias)."""
    return _Linears(linear)


def bf16_pieces(terms=6):
    """Inside the `with`, every fp32 F.linear runs as split_linear(terms)."""
    if terms not in PAIRS:
        raise ValueError(f"terms is one of {tuple(PAIRS)}, not {terms}")
    return linears(lambda x, weight, bias: split_linear(x, weight, bias, terms))
