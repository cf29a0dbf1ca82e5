"""Which coordinates of the parameter gradient kl_gradients.py keeps, and their entries through the
whole model (issue 36): the projections, not the estimators.

Blocks. `--layers` names the blocks (pools of parameters) coordinates are drawn from:
- "INDEX" or "INDEX.SUBMODULE" entries of the decoder layers (the default: the last layer's
  attention and MLP, --coords each);
- "all": two disjoint random subsets of the whole parameter vector;
- "whole": every parameter once (a tied weight is one parameter: named_parameters lists it once),
  in six blocks: the last layer's attention and MLP (--coords each, drawn first and exactly as the
  default draws them, so the last layer's coordinates are the default run's), the embedding (tied
  to the output layer in SmolLM2), the other layers' attention, their MLPs, and the norms. The
  last five share 2 x --coords coordinates in proportion to their sizes, at least MIN_COORDS
  each (all of a smaller block).
Within a block the kept coordinates are uniform without replacement, and weights[b] = N_b / m_b,
the block's parameters per kept coordinate, so sum_b w_b sum_{i kept in b} a_i b_i is an unbiased
estimate of the inner product over the blocks' parameters (stratified sampling); the intervals of
kl_stats.py are conditional on the coordinates kept.

Views. A view is a set of blocks, reweighted (kl_stats.view_grams): by default each block alone and
"layer", all of them; with "whole" also "layer" (the last layer), "self_attn" and "mlp" (every
layer's) and "model" (every parameter).

Entries through the whole model (`capture`, `entry_gradients`). Autograd's gradient with respect to
every parameter costs a weight-gradient product per matrix and a dense 49,152 x 576 embedding
gradient per row; instead the gradients with respect to each owning module's output d are taken,
and each kept entry is formed from d and the module's input x, per pack p of
logprobs.token_logprobs (one pack per group; many with --batch-groups):
  Linear y = x W^T                dW_ij = sum_l d_li x_lj
  Embedding y_l = E[id_l]         dE_vj = sum_{l: id_l = v} d_lj  (0 at padding_idx, as autograd)
  RMSNorm y = w * xhat            dw_j = sum_l d_lj xhat_lj,  xhat = x / sqrt(mean(x^2) + eps)
A weight owned by two modules (the tied embedding and output layer) gets both terms: one parameter,
its gradient counted once (tests/test_kl_gradients.py: against autograd's gradient of every parameter).
"""
from contextlib import contextmanager

import torch

MIN_COORDS = 1024  # "whole": the fewest coordinates a block of the rest of the model gets


def pools(model, layers):
    """[(block name, [(parameter name, parameter)])]: the blocks `--layers` names (docstring)."""
    if layers == "all":  # one list, twice: choose_subsets keeps the two subsets disjoint
        pool = list(model.named_parameters())
        return [("all-a", pool), ("all-b", pool)]
    if layers == "whole":
        return whole_pools(model)
    result = []
    for entry in layers.split(","):  # "INDEX" or "INDEX.SUBMODULE" of model.model.layers
        index, _, sub = entry.partition(".")
        path = f"model.layers.{int(index) % len(model.model.layers)}" + (f".{sub}" if sub else "")
        result.append((entry, [(f"{path}.{name}", p)
                               for name, p in model.get_submodule(path).named_parameters()]))
    return result


def whole_pools(model):
    """Every parameter once, in the six blocks of "whole" (docstring; a seventh, "head", for an
    output layer not tied to the embedding); any other kind of parameter is refused (no block
    would count it)."""
    n = len(model.model.layers)
    names = ["-1.self_attn", "-1.mlp", "embed", "head", f"0-{n - 2}.self_attn", f"0-{n - 2}.mlp",
             "norm"]
    blocks = {name: [] for name in names}
    for name, p in model.named_parameters():  # a tied parameter once (remove_duplicate)
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and parts[3] in ("self_attn", "mlp"):
            last = int(parts[2]) == n - 1
            blocks[("-1." if last else f"0-{n - 2}.") + parts[3]].append((name, p))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            blocks["embed" if "embed" in name else "head"].append((name, p))
        elif "norm" in parts[-2]:
            blocks["norm"].append((name, p))
        else:
            raise SystemExit(f"--layers whole: no block for parameter {name}")
    return [(name, pool) for name, pool in blocks.items() if pool]


def counts(blocks, layers, coords):
    """Coordinates to keep per block (0: all of them): --coords each, or under "whole" --coords for
    each of the last layer's two blocks and 2 x --coords over the rest, in proportion to size."""
    if layers != "whole" or not coords:
        return [coords] * len(blocks)
    sizes = [sum(p.numel() for _, p in pool) for _, pool in blocks]
    rest = sum(sizes[2:])
    return [coords, coords] + [min(size, max(MIN_COORDS, round(2 * coords * size / rest)))
                               for size in sizes[2:]]


def views(layers, blocks):
    """{view: [blocks]} reweighted together besides each block alone: None (kl_stats' default,
    "layer" = every block) unless "whole"."""
    if layers != "whole":
        return None
    kind = lambda suffix: [b for b in blocks if b.endswith(suffix)]  # noqa: E731
    return {"layer": list(blocks[:2]), "self_attn": kind(".self_attn"), "mlp": kind(".mlp"),
            "model": list(blocks)}


def choose_subsets(model, layers, coords, seed, reference=None):
    """(params that need grad, subsets, weights): each subset a list of (index into params, flat
    coordinate indices) of one block of `pools`; weights[i] = the block's parameters per kept
    coordinate (halved for 'all', whose two subsets share one pool), so sum_i weights_i <a, b>_i
    estimates the inner product over all of the blocks' parameters. With a `reference` (--basis
    displacement) the entries are (index, theta - theta_ref) instead: the gradient's components
    along the displacement of each row, weights 1."""
    gen = torch.Generator().manual_seed(seed)
    blocks = pools(model, layers)
    params = list(dict.fromkeys(p for _, pool in blocks for _, p in pool))
    position = {id(p): j for j, p in enumerate(params)}
    taken = {}  # 'all': the two subsets are disjoint
    subsets, weights = [], []
    for (_, pool), count in zip(blocks, counts(blocks, layers, coords)):
        if reference is not None:
            ref_params = dict(reference.named_parameters())
            subsets.append([(position[id(p)], (p.detach() - ref_params[name].detach()))
                            for name, p in pool])
            weights.append(1.0)
            continue
        sizes = torch.tensor([p.numel() for _, p in pool])
        total = int(sizes.sum())
        if count and count < total:
            flat = torch.randint(total, (4 * count,), generator=gen).unique()
            flat = flat[torch.randperm(len(flat), generator=gen)]
            flat = flat[~torch.isin(flat, taken.get(id(pool[0]), torch.zeros(0, dtype=torch.long)))]
            flat = flat[:count].sort().values
        else:
            flat = torch.arange(total)
        taken[id(pool[0])] = torch.cat([taken.get(id(pool[0]), flat[:0]), flat])
        starts = torch.cumsum(sizes, 0) - sizes
        subset = []
        for (_, p), start, size in zip(pool, starts.tolist(), sizes.tolist()):
            inside = flat[(flat >= start) & (flat < start + size)] - start
            if len(inside):
                subset.append((position[id(p)], inside.to(p.device)))
        subsets.append(subset)
        weights.append(total / len(flat) / (2 if layers == "all" else 1))
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params, subsets, weights


def coordinates(grad, index):
    """A subset's coordinates of one parameter's gradient: the kept entries (index: flat long
    indices), or (index: the displacement theta - theta_ref) the component along each row's
    displacement, sum_i g_ri delta_ri (each entry of a vector parameter on its own)."""
    if index.dtype == torch.long:
        return grad.reshape(-1)[index]
    product = grad * index
    return (product.sum(-1) if product.dim() > 1 else product).reshape(-1)


# ---------------------------------------------------------------- entries through the whole model

def owners(model, params):
    """{id(param): [modules that own it]}: two for a tied weight; only bias-free Linear, Embedding
    and RMSNorm-like modules (a 1-D weight and variance_epsilon) have per-entry formulas."""
    wanted, result = {id(p) for p in params}, {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in wanted:
                continue
            linear = isinstance(module, torch.nn.Linear) and module.bias is None
            norm = p.dim() == 1 and hasattr(module, "variance_epsilon")
            if name != "weight" or not (linear or norm or isinstance(module, torch.nn.Embedding)):
                raise SystemExit(f"no per-entry gradient for {type(module).__name__}.{name}")
            result.setdefault(id(p), []).append(module)
    return result


@contextmanager
def capture(model, params):
    """Hooks on every module that owns one of `params`; yields ({module: (input, output)} of its
    one call in the forward pass run inside the block, the owners)."""
    owned = owners(model, params)
    saved = {}

    def hook(module, inputs, output):
        if module in saved:
            raise RuntimeError(f"{type(module).__name__} called twice in one forward pass")
        saved[module] = (inputs[0], output)

    modules = list(dict.fromkeys(m for ms in owned.values() for m in ms))
    hooks = [m.register_forward_hook(hook) for m in modules]
    try:
        yield saved, owned
    finally:
        for h in hooks:
            h.remove()


def module_entries(module, x, d, p, index):
    """(packs, k): each pack's gradient of `module`'s use of p at the flat indices (docstring)."""
    if isinstance(module, torch.nn.Linear):  # dW_ij = sum_l d_li x_lj
        i, j = index // p.shape[1], index % p.shape[1]
        return (d[..., i] * x[..., j]).sum(-2)
    if isinstance(module, torch.nn.Embedding):  # dE_vj = sum_{l: id_l = v} d_lj
        v, j = index // p.shape[1], index % p.shape[1]
        hit = x[..., None] == v  # (packs, L, k)
        if module.padding_idx is not None:  # F.embedding: no gradient to the padding row
            hit &= v != module.padding_idx
        return (hit * d[..., j]).sum(-2)
    # RMSNorm (LlamaRMSNorm's forward): y = w * xhat, xhat = x / sqrt(mean(x^2) + eps)
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    xhat = (xf * torch.rsqrt(variance + module.variance_epsilon)).to(x.dtype)
    return (d[..., index] * xhat[..., index]).sum(-2)


def entry_gradients(outputs, saved, owned, params, subsets):
    """{row: (packs, m)}: each row's gradient at the subsets' coordinates, per pack, from one
    vector-Jacobian product per row of `outputs` ({row: [(output, coefficient), ...]}) to the
    owning modules' outputs (no weight-gradient products: module_entries forms the kept ones)."""
    modules = list(saved)
    rows = {}
    for i, (name, pairs) in enumerate(outputs.items()):
        tensors, coefs = zip(*pairs)
        deltas = torch.autograd.grad(tensors, [saved[m][1] for m in modules], grad_outputs=coefs,
                                     retain_graph=i < len(outputs) - 1, allow_unused=True)
        delta = {m: torch.zeros_like(saved[m][1]) if d is None else d
                 for m, d in zip(modules, deltas)}
        parts = []
        for subset in subsets:
            for j, index in subset:
                p = params[j]
                parts.append(sum(module_entries(m, saved[m][0].detach(), delta[m], p, index)
                                 for m in owned[id(p)]))
        rows[name] = torch.cat(parts, dim=1)
        del deltas, delta
    return rows
