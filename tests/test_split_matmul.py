"""systems/split_matmul.py: fp32 matmuls from bf16 pieces, against float64 and the model's fp32 pass."""
import pytest
import torch
import torch.nn.functional as F

import logprobs
from systems.split_matmul import bf16_pieces, bf16_split, linears, split_linear


def operands(seed=0, k=96):
    """x with values over 2^-20 .. 2^20 (every piece's exponent differs), a weight, a bias; k the
    inner dimension."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, k, generator=g) * 2.0 ** torch.randint(-20, 21, (48, k), generator=g)
    weight = torch.randn(40, k, generator=g) * 0.05
    return x, weight, torch.randn(40, generator=g)


def relative_error(y, x, weight, bias):
    truth = F.linear(x.double(), weight.double(), bias.double())
    return ((y.double() - truth).abs() / (x.double().abs() @ weight.double().abs().t())).max()


def test_three_bf16_pieces_hold_an_fp32_number_exactly():
    """Exact for |x| from 2^-110 to 2^127 (below, bf16's subnormals lose bits; above ~3.39e38 the
    first piece is inf: the docstring says so)."""
    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-110, 127, (4096,), generator=g).double()
    signs = torch.randint(0, 2, (4096,), generator=g) * 2 - 1
    x = (signs * (1 + torch.rand(4096, generator=g, dtype=torch.float64)) * 2 ** exponents).float()
    pieces = bf16_split(x)
    assert all(piece.dtype == torch.bfloat16 for piece in pieces)
    assert torch.equal(sum(piece.double() for piece in pieces), x.double())
    assert not torch.equal(sum(piece.double() for piece in pieces[:2]), x.double())


def test_six_products_are_as_accurate_as_fp32_and_three_are_not():
    """Error relative to |x| |W|^T (the sum's own scale), against float64: fp32 accumulation's
    ~1e-7 for six products and for fp32 itself, ~2^-16 for three (the pairs of weight 2^-16 they
    drop are what the KL of a small step lives in: docs/precision.md)."""
    x, weight, bias = operands()
    fp32 = relative_error(F.linear(x, weight, bias), x, weight, bias)
    six = relative_error(split_linear(x, weight, bias, terms=6), x, weight, bias)
    three = relative_error(split_linear(x, weight, bias, terms=3), x, weight, bias)
    assert fp32 < 1e-6 and six < 2 * fp32 + 1e-7
    assert three > 1e-6 and three > 20 * six


def test_a_model_under_bf16_pieces_gives_its_fp32_log_probs(tiny_llama):
    """logprobs.token_logprobs on a tiny Llama: under bf16_pieces(6) every linear layer (its output
    layer too) goes through split_linear, and the log-probs are fp32's; bf16 autocast's are far."""
    model = tiny_llama(128, num_attention_heads=4, num_key_value_heads=2).requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # logits of a real model's size (~20-30)
    prompts = [[5, 9, 2, 7], [5, 9, 2, 7], [3, 4]]
    responses = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 24)

    def logp(dtype=torch.float32):
        return logprobs.token_logprobs(model, prompts, responses, mask, 1.0, dtype)[0].double()

    truth = logprobs.token_logprobs(model.double(), prompts, responses, mask, 1.0,
                                    torch.float32)[0]
    model.float()
    fp32, bf16 = logp(), logp(torch.bfloat16)
    with bf16_pieces(6):
        six = logp()
    with bf16_pieces(3):
        three = logp()
    fp32_error = (fp32 - truth).abs().max()
    assert (six - truth).abs().max() < 3 * fp32_error + 1e-6
    assert (three - truth).abs().max() > 10 * fp32_error  # the mode did run: 3 products show
    assert (bf16 - truth).abs().max() > 1000 * fp32_error


def test_every_linear_layer_is_replaced_however_it_is_called(tiny_llama):
    """Every nn.Linear of the model (its output layer too) goes through the replacement under
    no_grad, F.linear called with keywords works, autocast is refused, terms are 6 or 3."""
    model = tiny_llama(128, num_attention_heads=4, num_key_value_heads=2).requires_grad_(False)
    calls = []

    def counted(x, weight, bias):
        calls.append(weight.shape)
        return F.linear(x.double(), weight.double(), bias).float()  # the mode is off inside

    with torch.no_grad(), linears(counted):
        model(input_ids=torch.tensor([[5, 9, 2, 7]]))
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(calls) == len(layers) and model.lm_head.weight.shape in calls
    x, weight, bias = operands()
    with bf16_pieces(6):
        by_keywords = F.linear(input=x, weight=weight, bias=bias)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(RuntimeError, match="autocast"):
                F.linear(x, weight, bias)
    assert torch.equal(by_keywords, split_linear(x, weight, bias, terms=6))
    with pytest.raises(ValueError, match="terms"):
        bf16_pieces(4)


def test_the_trainers_bf16x6_passes_run_every_linear_layer_through_six_products(tiny_llama,
                                                                                monkeypatch):
    """--logprob-dtype bf16x6 (CUDA's default): logprobs.no_grad_logprobs runs each micro-batch's
    linear layers through split_linear with six products, not autocast, and gives what the same
    pass under bf16_pieces(6) gives."""
    from systems import split_matmul

    model = tiny_llama(128, num_attention_heads=4, num_key_value_heads=2).requires_grad_(False)
    prompts = [[5, 9, 2, 7], [5, 9, 2, 7], [3, 4]]
    responses = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 24)
    calls = []

    def counted(x, weight, bias=None, terms=6):
        calls.append(terms)
        return split_linear(x, weight, bias, terms)
    monkeypatch.setattr(split_matmul, "split_linear", counted)
    logp, entropy = logprobs.no_grad_logprobs(model, prompts, responses, mask, 1.0, "bf16x6",
                                              micro_batch=2, entropy=True)
    layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert calls == [6] * layers * 2  # two micro-batches: the group of two, then the third row
    # the same micro-batches: a CPU's bf16 GEMM (AMX) need not round alike at other row counts
    with torch.no_grad(), bf16_pieces(6):
        expected = torch.cat([logprobs.token_logprobs(model, prompts[rows], responses[rows],
                                                      mask[rows], 1.0, torch.float32)[0]
                              for rows in (slice(0, 2), slice(2, 3))])
    assert torch.equal(logp, expected) and entropy.shape == (3, 24)
