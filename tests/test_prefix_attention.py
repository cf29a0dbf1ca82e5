"""systems/prefix_attention.py: attention by blocks in shared_prefix_pack's one sequence equals SDPA
under the sequence's dense mask (outputs and gradients), and logprobs.response_rows takes the output
layer's rows without a copy only where they are already the response tokens' in order. (The whole
pass against Hugging Face's forward of each sequence alone: tests/test_train.py's
test_packed_logprobs_equal_one_forward_per_sequence.)"""
import pytest
import torch
import torch.nn.functional as F

import logprobs
from systems import prefix_attention


def a_batch(prefix):
    """Groups of 3, 1, 2 and 1 rows; one group's prompt is the prefix itself (no rest), one response
    is empty, one has a hole in its mask."""
    prompts = [prefix + [5, 9, 2]] * 3 + [prefix + [3]] + [prefix + [8, 8, 1, 1]] * 2
    prompts += [prefix or [4]]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    return prompts, torch.randint(0, 16, (7, 5)), mask


@pytest.mark.parametrize("prefix", [[], [6, 2, 9, 9, 4]], ids=["no-prefix", "a-shared-prefix"])
def test_blocks_equal_the_dense_mask(prefix):
    """Random queries, keys and values over the pack's L columns, 6 query heads on 2 kv heads:
    prefix_attention's outputs and its gradients with respect to each equal SDPA's under `allowed`
    (fp32, to 1e-5: the same sums in another order)."""
    torch.manual_seed(0)
    prompts, responses, mask = a_batch(prefix)
    _, _, allowed, _, _, blocks = logprobs.shared_prefix_pack(prompts, responses, mask)
    L = allowed.shape[0]
    q, k, v = (torch.randn(1, heads, L, 8, requires_grad=True) for heads in (6, 2, 2))
    got, _ = prefix_attention.prefix_attention(None, q, k, v, None, scaling=0.3,
                                               blocks=prefix_attention.layout(allowed, blocks))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None], scale=0.3,
                                              enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    weights = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_response_rows_copy_only_where_they_must():
    """shared_prefix_pack's kept rows, when every response's mask runs from its first token, are
    all of the logits' rows in order: response_rows returns logits[0] itself (no copy); an empty
    response or a hole in a mask keeps rows no token reads, and there it gathers, the same rows as
    logits[pack, kept]; pack_layout's packs always gather."""
    torch.manual_seed(0)
    prompts, responses, mask = a_batch([6, 2, 9])
    for mask in (mask[[0, 1, 2, 4, 6]], mask):  # whole masks; then an empty one and a hole
        rows = [0, 1, 2, 4, 6] if len(mask) == 5 else list(range(7))
        _, _, _, keep, kept_column, _ = logprobs.shared_prefix_pack(
            [prompts[r] for r in rows], responses[rows], mask)
        logits = torch.randn(1, len(keep), 16)
        row, column = logprobs.response_tokens(mask)
        pack, kept = torch.zeros_like(row), kept_column[row, column]
        got = logprobs.response_rows(logits, pack, kept)
        assert torch.equal(got, logits[pack, kept])
        assert (got.data_ptr() == logits.data_ptr()) is (len(mask) == 5)
    # pack_layout's one pack (one group, full responses): every response's first token from the
    # prompt's last column, so a gather
    _, _, L, pack_of_row, kept_column = logprobs.pack_layout(prompts[:3], torch.ones(3, 5))
    logits = torch.randn(1, L - len(prompts[0]) + 1, 16)
    row, column = logprobs.response_tokens(torch.ones(3, 5))
    pack, kept = pack_of_row[row], kept_column[row, column]
    got = logprobs.response_rows(logits, pack, kept)
    assert torch.equal(got, logits[pack, kept]) and got.data_ptr() != logits.data_ptr()
