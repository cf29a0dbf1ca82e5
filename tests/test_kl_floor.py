"""kl_floor.py on a tiny random Llama: fp32 log-probs reach the true log-ratios, bf16 ones do not,
and the bf16 grid counter is right. (The embedded model's table is in docs/precision.md.)"""
import copy
import json

import pytest
import torch

from lab.kl_floor import bf16_grid, floor_row, fp32_head, tf32_linear
from systems.split_matmul import bf16_pieces, linears


def tiny_pair(tiny_llama, eps=1e-6):
    """A tiny Llama with logits of real models' size (~20-30) and a copy moved by +-eps per
    weight."""
    reference = tiny_llama(128, num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        reference.lm_head.weight.mul_(60.0)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(eps * (torch.randint(0, 2, param.shape).float() * 2 - 1))
    return policy.requires_grad_(False), reference.requires_grad_(False)


def test_fp32_reaches_the_truth_and_bf16_does_not(tiny_llama):
    policy, reference = tiny_pair(tiny_llama)
    prompts = [[5, 9, 2, 7], [5, 9, 2, 7], [3, 4]]
    responses = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 40)
    truth = floor_row(copy.deepcopy(policy).double(), copy.deepcopy(reference).double(),
                      prompts, responses, mask, torch.float32)
    fp32 = floor_row(policy, reference, prompts, responses, mask, torch.float32)
    bf16 = floor_row(policy, reference, prompts, responses, mask, torch.bfloat16)
    assert abs(fp32[0] - truth[0]) < 0.1 * truth[0] and abs(fp32[1] - truth[1]) < 1e-4
    assert bf16[0] > 20 * truth[0] and abs(bf16[2]) > 100 * abs(truth[2])  # 70x and 5000x here
    with fp32_head(policy), fp32_head(reference):
        head32 = floor_row(policy, reference, prompts, responses, mask, torch.bfloat16)
    assert head32[0] > 10 * truth[0]  # an fp32 head alone does not remove the floor
    with linears(tf32_linear):  # TF32, emulated: a floor as bf16's, smaller
        tf32 = floor_row(policy, reference, prompts, responses, mask, torch.float32)
    assert bf16[0] > tf32[0] > 3 * truth[0]
    # head restored
    assert floor_row(policy, reference, prompts, responses, mask, torch.bfloat16) == bf16


def test_six_bf16_products_reach_fp32s_floor_and_three_do_not(tiny_llama):
    """A step of 1e-7 (2^-17.6 of a weight of 0.02, the tiny model's scale) sits in a weight's third
    bf16 piece: six products keep it (the rule's 10% of the truth, for K1 and K3; 3% and 0.3% here),
    three lose most of it (K1 +166%)."""
    policy, reference = tiny_pair(tiny_llama, eps=1e-7)
    prompts = [[5, 9, 2, 7], [5, 9, 2, 7], [3, 4]]
    responses = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 40)
    truth = floor_row(copy.deepcopy(policy).double(), copy.deepcopy(reference).double(),
                      prompts, responses, mask, torch.float32)
    rows = {}
    for terms in (6, 3):
        with bf16_pieces(terms):
            rows[terms] = floor_row(policy, reference, prompts, responses, mask, torch.float32)
    assert all(abs(rows[6][i] - truth[i]) < 0.1 * abs(truth[i]) for i in (1, 2))
    assert abs(rows[3][1] - truth[1]) > 0.5 * abs(truth[1])


def test_bf16_grid_counts_exact_weights_and_ties():
    model = torch.nn.Linear(2, 2, bias=False)
    bits = torch.tensor([[0x3F800000, 0x3F808000], [0x3F800001, 0x3F818000]], dtype=torch.int32)
    with torch.no_grad():
        model.weight.copy_(bits.view(torch.float32))  # 1.0 exact, a tie, neither, a tie
    assert bf16_grid(model) == (0.25, 0.5)


def test_main_writes_each_row_as_it_is_done(letter_model, tmp_path, monkeypatch):
    """python -m lab.kl_floor --json F on a saved model: every row in F, fp32's K1 at the float64
    truth; a run cut after two rows (a GPU slot's timeout) keeps those two in F."""
    from lab import kl_floor

    model = str(letter_model(tmp_path)["model"])
    out = tmp_path / "floor.json"
    flags = ["--model", model, "--responses", "2", "--max-new-tokens", "8", "--eps", "1e-4",
             "--json", str(out)]
    kl_floor.main(flags)
    rows = json.loads(out.read_text())["rows"]
    assert list(rows)[:3] == ["float64 (the truth)", "fp32 (train.py's default)", "bf16 autocast"]
    assert len(rows) == 8  # on a CPU: 4 + bf16 pieces (6, 3) + TF32 emulated (2)
    truth, fp32 = rows["float64 (the truth)"], rows["fp32 (train.py's default)"]
    assert abs(fp32["k1"] - truth["k1"]) < 1e-3 * max(abs(truth["k1"]), 1e-3)

    out.unlink()
    calls, floor_row = [], kl_floor.floor_row

    def cut(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise TimeoutError("the slot's timeout")
        return floor_row(*args, **kwargs)
    monkeypatch.setattr(kl_floor, "floor_row", cut)
    with pytest.raises(TimeoutError):
        kl_floor.main(flags)
    assert list(json.loads(out.read_text())["rows"]) == list(rows)[:2]
