"""Known-bug variants of each exercise, the mistakes students make: each must lose points
(test_classroom.py grades them). (exercise, name, file, function, the buggy function's source)."""

BUGS = [
    ("E1", "naive K3: exp(log r) - 1 - log r, cancelling near r = 1", "kl.py", "estimate", '''
def estimate(logp, ref_logp, kind, clamp="none"):
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    log_r = ref_logp - logp
    if clamp == "verl":
        log_r = log_r.clamp(-20, 20)
    out = torch.exp(log_r) - 1 - log_r
    return out.clamp(-10, 10) if clamp == "verl" else out
'''),
    ("E1", "K3 with the ratio upside down, r = pi / pi_ref", "kl.py", "estimate", '''
def estimate(logp, ref_logp, kind, clamp="none"):
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    log_r = (logp - ref_logp).clamp(-20, 20) if clamp == "verl" else logp - ref_logp
    out = torch.expm1(log_r) - log_r
    return out.clamp(-10, 10) if clamp == "verl" else out
'''),
    ("E2", "a shaped return that is not detached", "kl.py", "shape_rewards", '''
def shape_rewards(scores, logp, ref_logp, mask, kind, place, beta, clamp="none"):
    if place not in ("reward", "both"):
        return scores
    return scores - beta * (mask * estimate(logp, ref_logp, kind, clamp)).sum(-1)
'''),
    ("E2", "a KL loss averaged per row instead of over num_tokens", "kl.py", "kl_loss", '''
def kl_loss(logp, ref_logp, mask, kind, place, beta, num_tokens, clamp="none"):
    if place not in ("loss", "both"):
        return logp.new_zeros(())
    kl = estimate(logp, ref_logp.detach(), kind, clamp)
    return beta * ((mask * kl).sum(-1) / mask.sum(-1)).mean()
'''),
    ("E3", "the probability weight left in the graph", "toy.py", "expected_gradient", '''
def expected_gradient(kind, place, T, theta=THETA, ref=REF):
    y, _ = all_sequences(T)
    a, b = (torch.tensor(v, dtype=f64, requires_grad=True) for v in theta)
    logp = bernoulli_logp(toy_logits(a, b, y), y)
    ref_logp = bernoulli_logp(toy_logits(*ref, y), y)
    weight = logp.sum(-1, keepdim=True).exp()
    no_reward = torch.zeros(len(y), dtype=f64)
    loss = training_loss(logp, ref_logp, no_reward, kind, place, 1.0, weight, num_tokens=1)
    return torch.stack(torch.autograd.grad(loss, (a, b)))
'''),
    ("E4", "a baseline that includes the sample itself", "advantage.py", "rloo", '''
def rloo(returns, group_size):
    R = _groups(returns, group_size)
    return (R - R.mean(1, keepdim=True)).reshape(-1)
'''),
    ("E4", "the clip on the wrong side (min of the losses)", "advantage.py", "policy_loss", '''
def policy_loss(logp, old_logp, advantages, mask, num_tokens, clip_eps=0.2):
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.detach()
    adv = adv if adv.dim() == 2 else adv.unsqueeze(-1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = (mask * torch.minimum(unclipped, clipped)).sum() / num_tokens
    clip_frac = (mask * (clipped < unclipped)).sum().detach() / num_tokens
    return loss, clip_frac
'''),
    ("E5", "the KL so far instead of the KL to go", "kl.py", "kl_to_go", '''
def kl_to_go(logp, ref_logp, mask, kind, clamp="none"):
    kl = mask * estimate(logp.detach(), ref_logp.detach(), kind, clamp)
    return kl.cumsum(-1)
'''),
    ("E6", "top-p that drops the token crossing p", "rollout.py", "sample", '''
def sample(logits, temperature, top_p, uniform):
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(len(logits), device=logits.device)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cut = sorted_probs.cumsum(-1) > top_p
        cut[:, 0] = False
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(cut, 0))
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    tokens = (torch.searchsorted(cdf, uniform[:, None] * total, right=True)
              .clamp(max=cdf.shape[-1] - 1))
    return tokens[:, 0], (probs.gather(-1, tokens) / total).log().float()[:, 0]
'''),
    ("E6", "the log-prob of the untempered, untruncated distribution", "rollout.py", "sample", '''
def sample(logits, temperature, top_p, uniform):
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(len(logits), device=logits.device)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        probs = torch.zeros_like(probs).scatter(-1, order,
                                                sorted_probs.masked_fill(mass_before >= top_p, 0))
    cdf = probs.cumsum(-1, dtype=torch.float64)
    tokens = (torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
              .clamp(max=cdf.shape[-1] - 1))
    return tokens[:, 0], logits.log_softmax(-1).gather(-1, tokens)[:, 0]
'''),
    ("E7", "a cache that never advances (K/V always written at slot 0)", "rollout.py",
     "sdpa_attention", '''
def sdpa_attention(q, k, v, k_cache, v_cache, positions, bias, scale):
    n, L, _, head_dim = q.shape
    kv_heads, span = k.shape[2], bias.shape[-1]
    k_cache[:, :L] = k
    v_cache[:, :L] = v
    keys = k_cache[:, :span].transpose(1, 2)
    values = v_cache[:, :span].transpose(1, 2)
    q = (q.view(n, L, kv_heads, -1, head_dim).permute(0, 2, 3, 1, 4)
         .reshape(n, kv_heads, -1, head_dim))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    return out.view(n, kv_heads, -1, L, head_dim).permute(0, 3, 1, 2, 4)
'''),
]
