"""
dar-gpt: one GPT, four residual paths, picked by GPTConfig.residual.

  standard  pre-norm GPT-2, the baseline (same module names and logits as nanoGPT)
  attnres   Attention Residuals: every sublayer reads a softmax over depth (Full or Block)
  mhc       manifold-constrained Hyper-Connections: n streams mixed by doubly stochastic matrices
  dar       Dual Attention Residuals: two streams, each read with keys of the other (Full or Block)

A GPT with n_layer layers has L = 2*n_layer sublayers f_1..f_L (attention, MLP,
attention, MLP, ...), each with its own pre-norm. The residual path only decides what
a sublayer reads (read) and what its output does to the state (write); the branches
never change. The equations are in ../shared/design/equations.md; the comment above a
line gives the equation that line computes. Tags [R] mark our reconstruction of a
DAR detail whose exact form is not public (see README).
"""

import math
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

RESIDUALS = ('standard', 'attnres', 'mhc', 'dar')
ROUTINGS = ('cross', 'self', 'crossv', 'fixed', 'sepv')

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304 # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster
    # the residual path
    residual: str = 'standard' # standard | attnres | mhc | dar
    depth_block: int = 1 # attnres, dar: sublayers per depth block K (1 = Full, 2*n_layer = one block)
    include_partial: bool = True # attnres, dar: the running partial block is a read candidate
    dar_routing: str = 'cross' # dar: cross | self | crossv | fixed | sepv
    mhc_streams: int = 2 # mhc: number of streams n
    # mixture of experts: n_expert > 0 turns the MLP of every moe_every-th layer into an MoE
    n_expert: int = 0 # routed experts per MoE layer; 0 = dense MLP everywhere
    n_expert_active: int = 2 # top-k: routed experts per token
    n_shared_expert: int = 0 # always-on experts per MoE layer
    expert_hidden: int = 0 # hidden width of one expert; 0 = 4 * n_embd
    moe_aux_loss_coef: float = 0.01 # load-balancing loss weight
    moe_z_loss_coef: float = 0.001 # router z-loss weight
    moe_every: int = 1 # MoE in layers moe_every-1, 2*moe_every-1, ...; the others stay dense

    def __post_init__(self):
        depth = self.residual in ('attnres', 'dar')
        checks = [
            (self.residual in RESIDUALS, f"residual={self.residual} is not one of {', '.join(RESIDUALS)}"),
            (self.dar_routing in ROUTINGS, f"dar_routing={self.dar_routing} is not one of {', '.join(ROUTINGS)}"),
            (self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}"),
            (self.depth_block >= 1, f"depth_block={self.depth_block} must be >= 1"),
            (self.depth_block <= 2 * self.n_layer, f"depth_block={self.depth_block} exceeds the 2*n_layer={2 * self.n_layer} sublayers"),
            (depth or self.depth_block == 1, f"depth_block={self.depth_block} needs residual=attnres or dar"),
            (depth or self.include_partial, "include_partial=False needs residual=attnres or dar"),
            (self.residual == 'dar' or self.dar_routing == 'cross', f"dar_routing={self.dar_routing} needs residual=dar"),
            (self.mhc_streams >= 1, f"mhc_streams={self.mhc_streams} must be >= 1"),
            (self.residual == 'mhc' or self.mhc_streams == 2, f"mhc_streams={self.mhc_streams} needs residual=mhc"),
            (self.n_expert >= 0 and self.n_shared_expert >= 0 and self.expert_hidden >= 0, "n_expert, n_shared_expert and expert_hidden must be >= 0"),
            (self.n_expert == 0 or 1 <= self.n_expert_active <= self.n_expert, f"n_expert_active={self.n_expert_active} must be in 1..n_expert={self.n_expert}"),
            (self.moe_every >= 1, f"moe_every={self.moe_every} must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

# -----------------------------------------------------------------------------
# the branches: unchanged by every residual path

class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.layer = layer # index into the KV cache

    def forward(self, x, cache=None):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            k, v = cache.update(self.layer, k, v) # (B, nh, block_size, hs)
            # the new token at position p sees the cached positions <= p
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):

    def __init__(self, config, hidden=None):
        super().__init__()
        hidden = hidden or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class MoE(nn.Module):
    """Sparse top-k mixture of expert MLPs, plus optional always-on shared experts.
    The router's softmax runs in fp32; each token goes to its top k experts, with gates
    renormalised over the chosen k. There is no capacity limit, so no token is dropped and a
    token's output never depends on the other tokens of the batch."""

    def __init__(self, config):
        super().__init__()
        E, C = config.n_expert, config.n_embd
        H = config.expert_hidden or 4 * C
        self.k = config.n_expert_active
        self.router = nn.Linear(C, E, bias=False)
        # the experts' weights, stacked: expert e computes gelu(x @ c_fc[e] + b_fc[e]) @ c_proj[e] + b_proj[e]
        self.c_fc = nn.Parameter(torch.randn(E, C, H) * 0.02)
        self.c_proj = nn.Parameter(torch.randn(E, H, C) * 0.02 / math.sqrt(2 * config.n_layer))
        self.b_fc = nn.Parameter(torch.zeros(E, H)) if config.bias else None
        self.b_proj = nn.Parameter(torch.zeros(E, C)) if config.bias else None
        # n always-on experts of width H are one MLP of width n*H
        self.shared = MLP(config, config.n_shared_expert * H) if config.n_shared_expert else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        """The output (B, T, C) and the router statistics: load-balancing loss, z-loss, expert load."""
        B, T, C = x.size()
        x = x.reshape(-1, C) # (N, C) tokens
        E, k = self.c_fc.size(0), self.k
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float()) # (N, E)
        probs = logits.softmax(-1)
        gate, expert = probs.topk(k, dim=-1) # (N, k)
        # g_i = p_i / sum_{top-k} p
        gate = gate / gate.sum(-1, keepdim=True)
        # group the N*k (token, expert) slots by expert
        slot_expert = expert.view(-1) # (N*k,)
        order = slot_expert.argsort(stable=True) # slots sorted by expert
        token = order // k
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, slot_expert, torch.ones_like(slot_expert))
        ys = self.experts(x[token], counts, slot_expert[order]) # (N*k, C)
        # y = sum_{i in top-k} g_i expert_i(x)
        weighted = ys * gate.view(-1)[order].unsqueeze(-1).to(ys.dtype)
        y = torch.zeros(x.shape, dtype=ys.dtype, device=x.device).index_add_(0, token, weighted)
        if self.shared is not None:
            y = y + self.shared(x)
        # load balance = E * sum_e f_e P_e: f_e fraction of the slots routed to e, P_e mean router prob
        f = counts.float() / counts.sum()
        balance = E * (f * probs.mean(0)).sum()
        # z-loss = mean over tokens of logsumexp(router logits)^2
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return self.dropout(y.view(B, T, C)), dict(balance=balance, z=z, load=f.detach())

    def experts(self, xs, counts, e):
        """expert_e(x) of the rows xs (M, C), grouped by expert: counts[e] rows each; e (M,) the
        expert of each row. In bf16 all experts run as one grouped matmul whose group offsets are
        a tensor, so there is no host sync and torch.compile keeps one graph. grouped_mm has no
        fp32 kernel under the compiler, so fp32 runs one exact matmul per expert, a loop whose
        row counts come to the host (.tolist(): a graph break under torch.compile)."""
        device = xs.device.type
        bf16 = self.c_fc.dtype == torch.bfloat16 or (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16)
        b_fc = self.b_fc[e] if self.b_fc is not None else 0
        b_proj = self.b_proj[e] if self.b_proj is not None else 0
        if bf16:
            offs = counts.cumsum(0).to(torch.int32) # end row of each expert's group
            h = F.grouped_mm(xs.bfloat16(), self.c_fc.bfloat16(), offs=offs) + b_fc
            return F.grouped_mm(F.gelu(h).bfloat16(), self.c_proj.bfloat16(), offs=offs) + b_proj
        sizes = counts.tolist()
        h = torch.cat([xe @ self.c_fc[i] for i, xe in enumerate(xs.split(sizes))]) + b_fc
        h = F.gelu(h)
        return torch.cat([he @ self.c_proj[i] for i, he in enumerate(h.split(sizes))]) + b_proj

class Block(nn.Module):
    """One layer: two sublayers with their pre-norms. How they connect is the residual path's job."""

    def __init__(self, config, layer):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.moe = config.n_expert > 0 and layer % config.moe_every == config.moe_every - 1
        self.mlp = MoE(config) if self.moe else MLP(config)

class KVCache:
    """Keys and values of every layer for generation, static: block_size positions per layer,
    allocated once, written at the current positions and read through a mask, so that every
    decode step has the same shapes and a compiled step is never recompiled. The position is a
    tensor for the same reason. Depth reads act per token, so no residual path needs a cache of
    its own."""

    def __init__(self, config, batch_size, device=None, dtype=None):
        shape = (batch_size, config.n_head, config.block_size, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.pos = torch.zeros((), dtype=torch.long, device=device) # number of tokens already cached
        self.mask = None # (T, block_size): which cached positions each new token sees; set by GPT.forward
        # fixed addresses, so that CUDA graphs may write them in place (no guard: a new cache is no recompile)
        for t in self.k + self.v + [self.pos]:
            torch._dynamo.mark_static_address(t, guard=False)

    def update(self, layer, k, v):
        # write the T new positions pos..pos+T-1, return every position (the mask hides the unwritten)
        positions = self.pos + torch.arange(k.size(2), device=k.device)
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)
        return self.k[layer], self.v[layer]

# -----------------------------------------------------------------------------
# depth attention, shared by AttnRes and DAR

RMS_EPS = 1e-6

def rms(v):
    """rms(v) = sqrt(mean(v^2) + eps) over channels, in fp32: (..., C) -> (...)."""
    return torch.sqrt(v.float().pow(2).mean(-1) + RMS_EPS)

def depth_read(w, g, keys, rms_keys, values):
    """One reader's attention over depth: h = sum_r softmax_r(w . RMSNorm_g(k_r)) v_r.
    w, g (C,): the reader's pseudo-query and key-norm weight; keys, values: R entries (B, T, C);
    rms_keys: R rms(k_r) (B, T). Returns h (B, T, C) and the depth weights a (R, B, T)."""
    # w . RMSNorm_g(k) = (k . (g * w)) / rms(k): rms(k) is taken once per entry, g and w are the reader's.
    # fp32 (elementwise, so autocast leaves it): tiny zero-init query grads underflow in bf16
    scores = torch.stack([(k.float() * (g * w)).sum(-1) / r for k, r in zip(keys, rms_keys)]) # (R, B, T)
    # a_r = softmax over depth r of the scores (no 1/sqrt(C))
    a = scores.softmax(0)
    # h = sum_r a_r v_r: the values are raw, only the keys are normed
    h = sum(a_r.unsqueeze(-1) * v for a_r, v in zip(a, values))
    return h, a

class DepthState:
    """What AttnRes and DAR carry through one forward, per stream j: the committed history H^j
    (entries (B, T, C), each with its rms, taken once, for use as a key) and the partial block
    state P^j. A plain class, so torch.compile traces it into the same graph as the model."""

    def __init__(self, e, streams, record=False, ablate=None):
        self.H = [[e] for _ in range(streams)] # H^j_0 = e
        self.rms = [[rms(e)] for _ in range(streams)] # rms(H^j_r), taken once per entry, for its use as a key
        self.P = None # [P^j], or None for P^j = 0 (an empty partial, no candidate)
        self.weights = [] if record else None # read weights of every sublayer, for return_depth
        self.ablate = ablate or {} # analysis: {stream j: None (its read replaced by its batch mean) or donor stream k (by k's read)}

    def commit(self):
        # H^j.append(P^j) ; P^j = 0
        for j, p in enumerate(self.P):
            self.H[j].append(p)
            self.rms[j].append(rms(p))
        self.P = None

    def candidates(self, include_partial):
        """C^j of every stream j, and their rms: the committed entries, plus P^j when it is a candidate."""
        if include_partial and self.P is not None:
            return [H + [p] for H, p in zip(self.H, self.P)], [r + [rms(p)] for r, p in zip(self.rms, self.P)]
        return self.H, self.rms

# -----------------------------------------------------------------------------
# the residual paths. Each one: begin(e) -> state, read(state, l) -> x_l,
# write(state, l, y_l) -> state, end(state) -> h for ln_f, depth(state) -> introspection.

class Standard(nn.Module):
    """h_0 = e ; h_l = h_{l-1} + f_l(Norm(h_{l-1}))"""

    def __init__(self, config):
        super().__init__()

    def begin(self, e, record=False, ablate=None):
        return e

    def read(self, h, l):
        return h

    def write(self, h, l, y):
        # h_l = h_{l-1} + y_l
        return h + y

    def end(self, h):
        return h

    def depth(self, h):
        return {}

class AttnRes(nn.Module):
    """Attention Residuals. History H = [b_0 = e, b_1, ...]: completed block sums of sublayer
    outputs; P = b_n^i, the partial sum of the current block. depth_block=1 is Full AttnRes."""

    def __init__(self, config):
        super().__init__()
        L, C = 2 * config.n_layer, config.n_embd
        self.K, self.include_partial = config.depth_block, config.include_partial
        # row l < L is sublayer l's, row L the final read's
        self.query = nn.Parameter(torch.zeros(L + 1, C)) # w_l, zero-init: step 0 reads a uniform mean
        self.key_norm = nn.Parameter(torch.ones(L + 1, C)) # g_l, weight of RMSNorm_l

    def begin(self, e, record=False, ablate=None):
        return DepthState(e, 1, record) # b_0 = e

    def read(self, s, l):
        b, rms_b = s.candidates(self.include_partial) # [b_0, ..., b_{n-1}, b_n^i] and their rms
        # x_l = sum_r softmax_r(w_l . RMSNorm_l(b_r)) b_r
        x, a = depth_read(self.query[l], self.key_norm[l], b[0], rms_b[0], b[0])
        if s.weights is not None:
            s.weights.append(a.detach()) # (R, B, T)
        return x

    def write(self, s, l, y):
        # b_n^i = b_n^{i-1} + y_l
        s.P = [y if s.P is None else s.P[0] + y]
        if (l + 1) % self.K == 0: # block complete: commit b_n
            s.commit()
        return s

    def end(self, s):
        if s.P is not None:
            s.commit()
        return self.read(s, len(self.query) - 1) # the final read, over all blocks

    def depth(self, s):
        return dict(weights=s.weights, H=s.H)

def sinkhorn(logits, iters=20):
    """Doubly stochastic matrix from logits Z (..., n, n), in fp32. Sinkhorn-Knopp: row softmax,
    column normalise, then alternate row / column normalisation. Near the identity init it
    converges slowly (about 1% per iteration for n = 2: 20 iterations leave row sums off by
    ~1e-4), so for n = 2 we take its limit in closed form: every 2x2 doubly stochastic matrix is
    [[p, 1-p], [1-p, p]], and the limit of Sinkhorn on exp(Z) has p/(1-p) = sqrt(e^{Z00+Z11-Z01-Z10})."""
    Z = logits.float()
    if Z.size(-1) == 2:
        # p = sigmoid((Z00 + Z11 - Z01 - Z10) / 2)
        p = torch.sigmoid((Z[..., 0, 0] + Z[..., 1, 1] - Z[..., 0, 1] - Z[..., 1, 0]) / 2)
        return torch.stack([torch.stack([p, 1 - p], -1), torch.stack([1 - p, p], -1)], -2)
    M = Z.softmax(-1)
    M = M / M.sum(-2, keepdim=True)
    for _ in range(iters - 1):
        M = M / M.sum(-1, keepdim=True)
        M = M / M.sum(-2, keepdim=True)
    return M

class MHCState:
    """What mHC carries through one forward: the streams X, this sublayer's post and M, and
    with record the pre weights and every X. A plain class, so torch.compile traces it."""

    def __init__(self, X, record=False, ablate=None):
        self.X = X # (B, T, n, C)
        self.post = self.M = None
        self.ablate = ablate or {} # analysis: {stream j: None (read as its batch mean) or donor stream k (read as X_k)}
        self.weights = [] if record else None
        self.H = [X] if record else None

class MHC(nn.Module):
    """Manifold-constrained Hyper-Connections: n streams X (B, T, n, C), all starting at e.
    Per sublayer and per token: pre (stream -> branch input), post (branch output -> streams)
    and a doubly stochastic mix M of the streams, all from the RMS-normed flattened streams."""

    def __init__(self, config):
        super().__init__()
        n, C, L = config.mhc_streams, config.n_embd, 2 * config.n_layer
        self.n = n
        # W_pre | W_post | W_res of every sublayer, fused: (L, nC, n + n + n*n)
        self.proj = nn.Parameter(torch.randn(L, n * C, 2 * n + n * n) / math.sqrt(n * C))
        self.scale = nn.Parameter(torch.full((L, 3), 0.01)) # s_pre, s_post, s_res
        b_pre = torch.full((L, n), -3.0)
        b_pre[torch.arange(L), torch.arange(L) % n] = 3.0 # +3 on the home stream l mod n
        self.b_pre = nn.Parameter(b_pre)
        self.b_post = nn.Parameter(torch.zeros(L, n))
        self.B_res = nn.Parameter((6 * torch.eye(n) - 3).repeat(L, 1, 1))
        # readout: sigmoid-weighted sum of the streams
        self.out_proj = nn.Parameter(torch.randn(n * C, n) / math.sqrt(n * C))
        self.out_scale = nn.Parameter(torch.full((1,), 0.01))
        self.out_bias = nn.Parameter(torch.zeros(n))

    def begin(self, e, record=False, ablate=None):
        return MHCState(e.unsqueeze(2).expand(-1, -1, self.n, -1), record, ablate) # X_i = e

    def flat_norm(self, X):
        # xf = RMSNorm(flatten of the n streams), fp32
        return F.rms_norm(X.flatten(2).float(), (X.size(2) * X.size(3),), eps=RMS_EPS) # (B, T, nC)

    def read(self, s, l):
        n = self.n
        s_pre, s_post, s_res = self.scale[l]
        with torch.autocast(s.X.device.type, enabled=False):
            z = self.flat_norm(s.X) @ self.proj[l] # (B, T, 2n + n*n)
            # pre = sigmoid(s_pre * xf @ W_pre + b_pre)
            pre = torch.sigmoid(s_pre * z[..., :n] + self.b_pre[l]) # (B, T, n)
            # post = 2 * sigmoid(s_post * xf @ W_post + b_post)
            s.post = 2 * torch.sigmoid(s_post * z[..., n:2 * n] + self.b_post[l]) # (B, T, n)
            # M = Sinkhorn(s_res * xf @ W_res + B_res)
            s.M = sinkhorn(s_res * z[..., 2 * n:].unflatten(-1, (n, n)) + self.B_res[l]) # (B, T, n, n)
        if s.weights is not None:
            s.weights.append(pre.detach().permute(2, 0, 1)) # (n, B, T)
        X = s.X
        for j, k in s.ablate.items(): # analysis: X_j read as its mean over the batch (per position), or as the donor's X_k
            X_j = X[:, :, j].mean(0, keepdim=True).expand_as(X[:, :, j]) if k is None else X[:, :, k]
            X = X.index_copy(2, torch.tensor([j], device=X.device), X_j.unsqueeze(2))
        # x = sum_i pre_i X_i
        return (pre.unsqueeze(-1) * X).sum(2)

    def write(self, s, l, y):
        # X_i <- sum_k M_ik X_k + post_i * y
        s.X = s.M @ s.X + s.post.unsqueeze(-1) * y.unsqueeze(2)
        if s.H is not None:
            s.H.append(s.X.detach())
        return s

    def end(self, s):
        with torch.autocast(s.X.device.type, enabled=False):
            w = torch.sigmoid(self.out_scale * (self.flat_norm(s.X) @ self.out_proj) + self.out_bias) # (B, T, n)
        # h = sum_i sigmoid(.)_i X_i
        return (w.unsqueeze(-1) * s.X).sum(2)

    def depth(self, s):
        return dict(weights=s.weights, H=[[X[:, :, i] for X in s.H] for i in range(self.n)])

# for target stream j = 0, 1: (stream of its keys, stream of its values), by dar_routing
ROUTES = {
    'cross': ((1, 0), (0, 1)), # DAR: keys RMSNorm(C^{1-j}), values C^j
    'self': ((0, 0), (1, 1)), # SelfKV: keys RMSNorm(C^j), values C^j
    'crossv': ((0, 1), (1, 0)), # CrossV: keys RMSNorm(C^j), values C^{1-j}
    'fixed': ((0, 1), (0, 1)), # FixedKV: keys RMSNorm(C^0), values C^1, for both targets
    'sepv': ((0, 0), (1, 1)), # SepV: keys RMSNorm(C^j), values W^j_V C^j (the W^j_V line in DAR.read)
}

class DAR(nn.Module):
    """Dual Attention Residuals. Two streams j in {0, 1}, each with its own committed history H^j
    (H^j_0 = e) and partial block state P^j. Stream j reads with keys from the opposite stream
    and values from its own (dar_routing='cross'); alpha fuses the two reads into the input of
    the unchanged branch; the branch output is written to both partials through per-channel
    gates beta^j, after a transport rho mixes them. depth_block=1 is Full DAR."""

    def __init__(self, config):
        super().__init__()
        L, C = 2 * config.n_layer, config.n_embd
        self.K, self.include_partial = config.depth_block, config.include_partial
        self.routes, self.sepv = ROUTES[config.dar_routing], config.dar_routing == 'sepv'
        # row l < L is sublayer l's, row L the final read's
        self.query = nn.Parameter(torch.zeros(L + 1, 2, C)) # w^j_l, zero-init [R: one per stream]
        self.key_norm = nn.Parameter(torch.ones(L + 1, C)) # g_l, one key norm per sublayer, shared by both targets
        self.alpha_logit = nn.Parameter(torch.zeros(L + 1)) # a_l, alpha = sigmoid(a_l) = 0.5 at init [R]
        # b^j_l: beta^0 = 1, beta^1 = 2*sigmoid(N(0, 0.5^2)) per channel: breaks the swap symmetry of the streams [R]
        beta_logit = torch.zeros(L, 2, C)
        beta_logit[:, 1].normal_(0, 0.5)
        self.beta_logit = nn.Parameter(beta_logit)
        if self.K > 1: # with K = 1 every write starts an empty partial and rho never acts
            self.rho_logit = nn.Parameter(torch.full((L,), 2.0)) # r_l, rho = sigmoid(2) ~ 0.88 [R]
        if self.sepv:
            self.value_proj = nn.Parameter(torch.eye(C).repeat(L + 1, 2, 1, 1)) # W^j_V, init I [R]

    def begin(self, e, record=False, ablate=None):
        return DepthState(e, 2, record, ablate) # H^0_0 = H^1_0 = e [R]

    def read(self, s, l):
        C, rms_C = s.candidates(self.include_partial) # C^0, C^1 and their rms
        h, weights = [], []
        for j, (k, v) in enumerate(self.routes): # target j: keys from stream k, values from stream v
            # h^j = sum_r softmax_r(w^j_l . RMSNorm_l(C^k_r)) C^v_r
            h_j, a = depth_read(self.query[l, j], self.key_norm[l], C[k], rms_C[k], C[v])
            if self.sepv:
                # SepV: sum_r a_r W^j_V v_r = W^j_V h^j, the value projection taken out of the sum
                h_j = h_j @ self.value_proj[l, j].t()
            h.append(h_j)
            weights.append(a)
        for j, k in s.ablate.items(): # analysis: ablated h^j = its mean over the batch (per position), or rescued h^j = h^k
            h[j] = h[j].mean(0, keepdim=True).expand_as(h[j]) if k is None else h[k]
        if s.weights is not None:
            s.weights.append(torch.stack(weights).detach()) # (2, R, B, T)
        alpha = torch.sigmoid(self.alpha_logit[l])
        # x_l = alpha_l h^0 + (1 - alpha_l) h^1
        return alpha * h[0] + (1 - alpha) * h[1]

    def write(self, s, l, y):
        # beta^j = 2 * sigmoid(b^j_l), per channel
        beta = 2 * torch.sigmoid(self.beta_logit[l]) # (2, C)
        if s.P is None: # P^j = 0 at the start of a block
            s.P = [beta[0] * y, beta[1] * y]
        else:
            rho = torch.sigmoid(self.rho_logit[l])
            # P^0 <- rho P^0 + (1 - rho) P^1 + beta^0 * y_l ; P^1 <- (1 - rho) P^0 + rho P^1 + beta^1 * y_l
            s.P = [rho * s.P[0] + (1 - rho) * s.P[1] + beta[0] * y, (1 - rho) * s.P[0] + rho * s.P[1] + beta[1] * y]
        if (l + 1) % self.K == 0: # block commit: H^j.append(P^j); P^j = 0
            s.commit()
        return s

    def end(self, s):
        if s.P is not None:
            s.commit()
        return self.read(s, len(self.query) - 1) # final reciprocal read and fusion [R]

    def depth(self, s):
        return dict(weights=s.weights, H=s.H)

# -----------------------------------------------------------------------------

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config
        residual = dict(standard=Standard, attnres=AttnRes, mhc=MHC, dar=DAR)[config.residual]
        self.transformer = nn.ModuleDict(dict(
            wte = nn.Embedding(config.vocab_size, config.n_embd),
            wpe = nn.Embedding(config.block_size, config.n_embd),
            drop = nn.Dropout(config.dropout),
            h = nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f = nn.LayerNorm(config.n_embd, bias=config.bias),
            res = residual(config), # no parameters for the standard path: nanoGPT's state_dict
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.moe_stats = None # MoE: the last forward's LM loss, router losses and expert load (n_moe_layers, E)
        # weight tying (https://paperswithcode.com/method/weight-tying)
        self.transformer.wte.weight = self.lm_head.weight
        # init all weights, then the scaled init of the residual projections, per GPT-2 paper.
        # The residual paths' own parameters are plain Parameters and keep the init they were built with.
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02/math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True, active=False):
        """Number of parameters; the position embeddings are subtracted by default. The token
        embeddings are counted, since they are tied to the final layer's weights. active=True
        counts only the n_expert_active routed experts a token uses in each MoE layer."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        if active:
            for block in self.transformer.h:
                if block.moe:
                    experts = [block.mlp.c_fc, block.mlp.c_proj, block.mlp.b_fc, block.mlp.b_proj]
                    per_expert = sum(p[0].numel() for p in experts if p is not None)
                    n_params -= (self.config.n_expert - self.config.n_expert_active) * per_expert
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, cache=None, return_depth=False, ablate_stream=None, donor=None):
        """Logits for the last position (all positions when targets are given), the loss, and
        with return_depth a dict of the depth read weights and stream histories. For the
        ablate-and-rescue analysis (dar, mhc): ablate_stream=j or (j, ...) replaces those streams'
        reads at every sublayer by their mean over the batch at each position (a mean ablation: a
        zero read would only rescale the pre-normed branch input); with donor=k, by stream k's read
        instead (rescue)."""
        if ablate_stream is not None and self.config.residual not in ('dar', 'mhc'):
            raise ValueError(f"ablate_stream needs a multi-stream path (dar or mhc), not residual={self.config.residual}")
        if isinstance(ablate_stream, int):
            ablate_stream = (ablate_stream,)
        if donor is not None and (ablate_stream is None or donor in ablate_stream):
            raise ValueError(f"donor={donor} must be a stream that is not ablated (ablate_stream={ablate_stream})")
        ablate_stream = {j: donor for j in ablate_stream} if ablate_stream is not None else None
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device) # shape (t)
        if cache is not None: # the new tokens follow the cached ones (generate keeps pos + t <= block_size)
            pos = cache.pos + pos
            cache.mask = torch.arange(self.config.block_size, device=device) <= pos[:, None] # (t, block_size)
        e = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos)) # (b, t, n_embd)
        res = self.transformer.res
        s = res.begin(e, record=return_depth, ablate=ablate_stream)
        router_stats = [] # of the MoE layers
        for i, block in enumerate(self.transformer.h):
            s = res.write(s, 2 * i, block.attn(block.ln_1(res.read(s, 2 * i)), cache))
            y = block.mlp(block.ln_2(res.read(s, 2 * i + 1)))
            if block.moe:
                y, stats = y
                router_stats.append(stats)
            s = res.write(s, 2 * i + 1, y)
        x = self.transformer.ln_f(res.end(s))
        if cache is not None:
            cache.pos += t
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
            if router_stats:
                # loss = LM loss + c_aux * load balance + c_z * z-loss, each averaged over MoE layers
                balance = torch.stack([r['balance'] for r in router_stats]).mean()
                z = torch.stack([r['z'] for r in router_stats]).mean()
                self.moe_stats = dict(lm=loss.detach(), balance=balance.detach(), z=z.detach(),
                                      load=torch.stack([r['load'] for r in router_stats])) # for logging
                loss = loss + self.config.moe_aux_loss_coef * balance + self.config.moe_z_loss_coef * z
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :]) # note: using list [-1] to preserve the time dim
            loss = None
        if return_depth:
            return logits, loss, res.depth(s)
        return logits, loss

    @classmethod
    def from_checkpoint(cls, checkpoint):
        """A model from a checkpoint dict (ours or nanoGPT's): model_args and the state_dict,
        without the '_orig_mod.' prefix that a compiled model's state_dict carries."""
        # two_phase, a speed option of older checkpoints, gave the same result and is gone: slower under compile
        model_args = {k: v for k, v in checkpoint['model_args'].items() if k != 'two_phase'}
        model = cls(GPTConfig(**model_args))
        prefix = '_orig_mod.'
        state_dict = {k.removeprefix(prefix): v for k, v in checkpoint['model'].items()}
        model.load_state_dict(state_dict)
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # 2D weights of the branches and embeddings decay; biases, norms and every parameter of
        # the residual path (queries, gates, mixing logits) don't: decay would pull gates to 0.5
        # and queries to uniform reads
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in params.items() if p.dim() >= 2 and not n.startswith('transformer.res.')]
        nodecay_params = [p for n, p in params.items() if p.dim() < 2 or n.startswith('transformer.res.')]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        num_decay_params = sum(p.numel() for p in decay_params)
        num_nodecay_params = sum(p.numel() for p in nodecay_params)
        print(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {num_nodecay_params:,} parameters")
        # Create AdamW optimizer and use the fused version if it is available
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == 'cuda'
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")
        return optimizer

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model flops utilization against the bf16 dense peak of this GPU (PaLM Appendix B
        flops: 6N + 12LHQT per token; the depth reads are not counted). None if the peak is unknown."""
        peak = peak_flops()
        if peak is None:
            return None
        N = self.get_num_params(active=True)
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd//cfg.n_head, cfg.block_size
        flops_per_token = 6*N + 12*L*H*Q*T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter
        return flops_per_iter / dt / peak

    def kv_cache(self, batch_size, device):
        """An empty static KV cache, in the dtype attention computes in (autocast's, when it is on)."""
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else self.lm_head.weight.dtype
        return KVCache(self.config, batch_size, device, dtype)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, forward=None):
        """Take a conditioning sequence of indices idx (LongTensor of shape (b,t)) and complete
        the sequence max_new_tokens times, feeding the predictions back into the model each time.
        A static KV cache keeps the keys and values of the context. Positions are absolute, so
        once the context is longer than block_size the window slides, every cached key changes,
        and the cropped context is run again in full: the result always equals the uncached model
        on idx[:, -block_size:]. forward runs the model: self, or torch.compile(model), which then
        compiles the prefill, the one-token step and the full window once each."""
        forward = self if forward is None else forward
        cache = self.kv_cache(idx.size(0), idx.device)
        # the last block_size tokens, copied in contiguous strides: a compiled forward guards on strides,
        # a view's grow with idx, and .contiguous() keeps the view at batch 1 (a size-1 dim's stride is ignored)
        crop = lambda idx: idx[:, -self.config.block_size:].clone(memory_format=torch.contiguous_format)
        logits, _ = forward(crop(idx), cache=cache) # prefill
        for i in range(max_new_tokens):
            # pluck the logits at the final step and scale by desired temperature
            logits = logits[:, -1, :] / temperature
            # optionally crop the logits to only the top k options
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
            if i == max_new_tokens - 1:
                break
            if idx.size(1) > self.config.block_size: # the window slides: run it again from position 0
                cache.pos.zero_()
                logits, _ = forward(crop(idx), cache=cache)
            else:
                logits, _ = forward(idx_next, cache=cache)
        return idx

def compile_for_generation(model):
    """torch.compile of the model's forward for generate(forward=...): static shapes, so the prefill,
    the one-token step and the full window compile once each. A one-token step is a long chain of
    tiny kernels, so its cost is the calls between them, not the math: on CUDA, CUDA graphs replay
    the whole step (mode='reduce-overhead'); on CPU, inductor's C++ wrapper calls the kernels in
    place of its Python one (cpp_wrapper); elsewhere (mps) the plain compile."""
    device = model.lm_head.weight.device.type
    if device == 'cuda':
        return torch.compile(model, dynamic=False, mode='reduce-overhead')
    if device == 'cpu':
        return torch.compile(model, dynamic=False, options={'cpp_wrapper': True})
    return torch.compile(model, dynamic=False)

# bf16 dense peak flops per GPU, for MFU (vendor datasheets)
PEAK_FLOPS = {'H200': 989e12, 'H100': 989e12, 'A100': 312e12, 'L4': 121e12}

def peak_flops():
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
