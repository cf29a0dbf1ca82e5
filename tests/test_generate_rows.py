"""What --generate-rows keeps reproducible (docs/gpu.md, "Sampling in chunks of rows"): in fp32 the
samples of any row count are one call's; in bf16, those of one row count, run after run and from a
generator state restored as --resume restores it. A tiny random Llama, on the CPU."""
import pytest
import torch

import rollout


@pytest.fixture(scope="module")
def prompts():
    return [torch.randint(3, 256, (4 + i % 7,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(24)]


def sample(model, prompts, generator, rows):
    return rollout.generate(model, prompts, 12, 1.0, 1.0, None, generator, max_rows=rows).tokens


def test_fp32_samples_do_not_depend_on_the_row_count(tiny_llama, prompts, one_thread):
    model = tiny_llama(256, hidden_size=64, intermediate_size=128).eval()
    one = sample(model, prompts, torch.Generator().manual_seed(0), None)
    for rows in (1, 5, 23):
        chunked = sample(model, prompts, torch.Generator().manual_seed(0), rows)
        assert torch.equal(chunked[:, :one.shape[1]], one) and not chunked[:, one.shape[1]:].any()


@pytest.mark.parametrize("rows", [None, 5])
def test_bf16_samples_repeat_with_the_same_row_count_and_through_a_resume(tiny_llama, prompts,
                                                                          one_thread, rows):
    """Two batches in a row, and again with the generator's state saved after the first and
    restored into a new generator (checkpoint.rng_state's "sampler"): the same tokens."""
    model = tiny_llama(256, hidden_size=64, intermediate_size=128).to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    first, second = sample(model, prompts, generator, rows), sample(model, prompts, generator, rows)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(sample(model, prompts, generator, rows), first)
    resumed = torch.Generator()
    resumed.set_state(generator.get_state())
    assert torch.equal(sample(model, prompts, resumed, rows), second)
    assert not torch.equal(first, second)  # the stream moved on
