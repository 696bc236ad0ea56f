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
from types import SimpleNamespace

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
    two_phase: bool = False # attnres, dar: read a block's completed entries for all its sublayers at once
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
            (depth or not self.two_phase, "two_phase=True needs residual=attnres or dar"),
            (not (self.two_phase and self.dar_routing == 'sepv'), "two_phase=True does not support dar_routing=sepv (its values differ per sublayer)"),
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
        if cache is not None:
            k, v = cache.update(self.layer, k, v) # (B, nh, past + T, hs)
        past = k.size(2) - T
        dropout = self.dropout if self.training else 0
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            # new token t sits at position past + t and sees positions <= past + t
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
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
        # group the N*k (token, expert) slots by expert: one matmul per expert over its tokens
        # (a loop over experts, not over tokens; the per-expert counts are data-dependent, so
        # torch.compile breaks its graph here)
        order = expert.view(-1).argsort(stable=True) # (N*k,) slots sorted by expert
        token = order // k
        counts = torch.bincount(expert.view(-1), minlength=E)
        xs = x[token].split(counts.tolist())
        ys = []
        for e, xe in enumerate(xs):
            h = xe @ self.c_fc[e] + (self.b_fc[e] if self.b_fc is not None else 0)
            ys.append(F.gelu(h) @ self.c_proj[e] + (self.b_proj[e] if self.b_proj is not None else 0))
        # y = sum_{i in top-k} g_i expert_i(x)
        weighted = torch.cat(ys) * gate.view(-1)[order].unsqueeze(-1).to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)
        # load balance = E * sum_e f_e P_e: f_e fraction of the slots routed to e, P_e mean router prob
        f = counts.float() / counts.sum()
        balance = E * (f * probs.mean(0)).sum()
        # z-loss = mean over tokens of logsumexp(router logits)^2
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return self.dropout(y.view(B, T, C)), dict(balance=balance, z=z, load=f.detach())

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
    """Keys and values of every layer for generation. Depth reads act per token, so no
    residual path needs a cache of its own."""

    def __init__(self, config):
        self.k = self.v = None # (n_layer, B, nh, block_size, hs), allocated on first use
        self.n_layer, self.block_size = config.n_layer, config.block_size
        self.pos = 0 # number of tokens already cached

    def update(self, layer, k, v):
        if self.k is None:
            shape = (self.n_layer, *k.shape[:2], self.block_size, k.size(3))
            self.k = k.new_zeros(shape)
            self.v = v.new_zeros(shape)
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

# -----------------------------------------------------------------------------
# depth attention, shared by AttnRes and DAR. A depth entry holds S streams (S, B, T, C):
# S = 1 for AttnRes, 2 for DAR. Target j of a read takes its keys from stream keys_of[j]
# and its values from stream values_of[j]; mix_j weighs its read in the branch input.

RMS_EPS = 1e-6

def key_scores(v, Q, keys_of):
    """w_j . RMSNorm_l(v[keys_of[j]]) for every target j and every query row of Q (..., J, C),
    where each row is a pseudo-query times its key norm weight: RMSNorm_l(k) . w =
    rsqrt(mean(k^2) + eps) * (k . (g_l * w)). fp32. v: (S, B, T, C) -> (..., J, B, T).
    The queries do not depend on the input, so a committed entry is scored once, for every
    sublayer that will read it, and its keys are never normed or read again."""
    with torch.autocast(v.device.type, enabled=False): # tiny zero-init query grads underflow in bf16
        v = v.float()
        r = torch.rsqrt(v.pow(2).mean(-1) + RMS_EPS) # (S, B, T)
        G = torch.einsum('sbtc,...jc->...jsbt', v, Q) # every stream under every query
    j = torch.arange(len(keys_of), device=v.device)
    return G[..., j, keys_of, :, :] * r[keys_of]

def depth_read(scores, values, mix, values_of):
    """x_s = sum_r W_rs v_rs, the reads of all targets summed into the value streams they read.
    scores: R tensors (J, B, T); values: R tensors (S, B, T, C); mix: (J,)."""
    # a_rj = softmax_r( w_j . RMSNorm(k_rj) )
    a = torch.stack(scores).softmax(0) # (R, J, B, T)
    # W_rs = sum over the targets j that read values from stream s of mix_j a_rj
    W = a.new_zeros(a.size(0), values[0].size(0), *a.shape[2:]).index_add(1, values_of, a * mix[:, None, None])
    # x = sum_r W_r v_r   (values are raw, only keys are normed)
    x = sum(W_r.unsqueeze(-1) * v for W_r, v in zip(W, values))
    return x, a

def depth_phase1(scores, values, values_of):
    """Two-phase read, phase 1: the queries of a whole block over its completed entries at once.
    scores: R tensors (Sq, J, B, T). Returns the softmax max m and sum l (Sq, J, B, T) and the
    unnormalised output o (Sq, J, B, T, C) of every query and target."""
    logits = torch.stack(scores, 1) # (Sq, R, J, B, T)
    m = logits.amax(1)
    p = (logits - m.unsqueeze(1)).exp()
    o = sum(p[:, r].unsqueeze(-1) * v[values_of] for r, v in enumerate(values))
    return m, p.sum(1), o

def depth_phase2(m1, l1, o1, score, value, mix):
    """Two-phase read, phase 2: merge the partial block's score (J, B, T) and value (J, B, T, C)
    by online softmax, m = max(m1, m2), h = (e^{m1-m} o1 + e^{m2-m} v) / (e^{m1-m} l1 + e^{m2-m}),
    then x = sum_j mix_j h_j."""
    if score is None: # no partial candidate
        h = o1 / l1.unsqueeze(-1)
    else:
        m = torch.maximum(m1, score)
        c1, c2 = (m1 - m).exp(), (score - m).exp()
        h = (c1.unsqueeze(-1) * o1 + c2.unsqueeze(-1) * value) / (c1 * l1 + c2).unsqueeze(-1)
    return (mix[:, None, None, None] * h).sum(0)

def depth_commit(res, s, v):
    """Append a completed entry v (S, B, T, C) to the history, with its key scores for every query."""
    s.H.append((v, key_scores(v, s.Q, res.keys_of)))

def depth_reads(res, s, l, project=None):
    """The branch input (B, T, C) of sublayer l of AttnRes or DAR: the reads of all targets,
    weighted by mix and summed; project (SepV) maps each value stream's read first."""
    partial = s.P is not None and res.include_partial
    score = key_scores(s.P, s.Q[l], res.keys_of) if partial else None
    if res.two_phase and s.weights is None and l < len(s.Q) - 1:
        i = l % res.K
        if i == 0: # phase 1 at the start of a block, for all of its queries
            rows = slice(l, min(l + res.K, len(s.Q) - 1))
            s.phase1 = depth_phase1([sc[rows] for _, sc in s.H], [v for v, _ in s.H], res.values_of)
        m1, l1, o1 = (t[i] for t in s.phase1)
        return depth_phase2(m1, l1, o1, score, s.P[res.values_of] if partial else None, s.mix[l])
    scores = [sc[l] for _, sc in s.H] + ([score] if partial else [])
    values = [v for v, _ in s.H] + ([s.P] if partial else [])
    x, a = depth_read(scores, values, s.mix[l], res.values_of)
    if s.weights is not None:
        s.weights.append(a.detach().transpose(0, 1)) # (J, R, B, T)
    return (project(x) if project is not None else x).sum(0)

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
    outputs; P = partial sum of the current block. depth_block=1 is Full AttnRes."""

    def __init__(self, config):
        super().__init__()
        L, C = 2 * config.n_layer, config.n_embd
        self.K, self.include_partial, self.two_phase = config.depth_block, config.include_partial, config.two_phase
        # row l < L is sublayer l's, row L the final read's
        self.query = nn.Parameter(torch.zeros(L + 1, C)) # w_l, zero-init: step 0 reads a uniform mean
        self.key_norm = nn.Parameter(torch.ones(L + 1, C)) # g_l, weight of RMSNorm_l
        # one stream: keys and values from it
        self.register_buffer('keys_of', torch.zeros(1, dtype=torch.long), persistent=False)
        self.register_buffer('values_of', torch.zeros(1, dtype=torch.long), persistent=False)

    def begin(self, e, record=False, ablate=None):
        Q = (self.query * self.key_norm).unsqueeze(1) # (L+1, 1, C)
        s = SimpleNamespace(Q=Q, mix=Q.new_ones(len(Q), 1), H=[], P=None, phase1=None, weights=[] if record else None)
        depth_commit(self, s, e.unsqueeze(0)) # b_0 = e
        return s

    def read(self, s, l):
        return depth_reads(self, s, l)

    def write(self, s, l, y):
        # b_n^i = b_n^{i-1} + y_l
        s.P = y.unsqueeze(0) if s.P is None else s.P + y
        if (l + 1) % self.K == 0: # block complete: commit b_n
            depth_commit(self, s, s.P)
            s.P = None
        return s

    def end(self, s):
        if s.P is not None:
            depth_commit(self, s, s.P)
            s.P = None
        return self.read(s, len(s.Q) - 1) # the final read

    def depth(self, s):
        return dict(weights=[a[0] for a in s.weights] if s.weights is not None else None, H=[[v[0] for v, _ in s.H]])

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
        X = e.unsqueeze(2).expand(-1, -1, self.n, -1) # (B, T, n, C)
        return SimpleNamespace(X=X, post=None, M=None, ablate=ablate,
                               weights=[] if record else None, H=[X] if record else None)

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
        if s.ablate is not None: # analysis: these streams' contributions to the read removed
            pre = pre.index_fill(-1, torch.tensor(s.ablate, device=pre.device), 0.0)
        if s.weights is not None:
            s.weights.append(pre.detach().permute(2, 0, 1)) # (n, B, T)
        # x = sum_i pre_i X_i
        return (pre.unsqueeze(-1) * s.X).sum(2)

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

# target j: (stream of its keys, stream of its values), by dar_routing
ROUTES = {
    'cross': ((1, 0), (0, 1)), # DAR: keys RMSNorm(C^{1-j}), values C^j
    'self': ((0, 1), (0, 1)), # SelfKV: keys RMSNorm(C^j), values C^j
    'crossv': ((0, 1), (1, 0)), # CrossV: keys RMSNorm(C^j), values C^{1-j}
    'fixed': ((0, 0), (1, 1)), # FixedKV: keys RMSNorm(C^0), values C^1, for both targets
    'sepv': ((0, 1), (0, 1)), # SepV: keys RMSNorm(C^j), values W^j_V C^j
}

class DAR(nn.Module):
    """Dual Attention Residuals. Two streams j in {0, 1}, kept together as (2, B, T, C), each
    with its own committed history H^j (H^j_0 = e) and partial block state P^j. Stream j reads
    with keys from the opposite stream and values from its own (dar_routing='cross'); alpha
    fuses the two reads into the input of the unchanged branch; the branch output is written
    to both partials through per-channel gates beta^j, after a transport rho mixes them.
    depth_block=1 is Full DAR."""

    def __init__(self, config):
        super().__init__()
        L, C = 2 * config.n_layer, config.n_embd
        self.K, self.include_partial, self.two_phase = config.depth_block, config.include_partial, config.two_phase
        keys_of, values_of = ROUTES[config.dar_routing]
        self.register_buffer('keys_of', torch.tensor(keys_of), persistent=False)
        self.register_buffer('values_of', torch.tensor(values_of), persistent=False)
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
        if config.dar_routing == 'sepv':
            self.value_proj = nn.Parameter(torch.eye(C).repeat(L + 1, 2, 1, 1)) # W^j_V, init I [R]

    def begin(self, e, record=False, ablate=None):
        # the gates of all sublayers at once: they do not depend on the input
        alpha = torch.sigmoid(self.alpha_logit)
        # x_l = alpha_l h^0 + (1 - alpha_l) h^1: the mix of the two targets' reads
        mix = torch.stack([alpha, 1 - alpha], -1) # (L+1, 2)
        if ablate: # analysis: these streams' reads replaced by zeros
            mix = mix.index_fill(1, torch.tensor(ablate, device=mix.device), 0.0)
        # beta^j = 2 * sigmoid(b^j_l), per channel
        beta = 2 * torch.sigmoid(self.beta_logit)[:, :, None, None, :] # (L, 2, 1, 1, C)
        T = None
        if self.K > 1:
            rho = torch.sigmoid(self.rho_logit)
            # T(rho) = [[rho, 1 - rho], [1 - rho, rho]], doubly stochastic
            T = torch.stack([torch.stack([rho, 1 - rho], -1), torch.stack([1 - rho, rho], -1)], -2) # (L, 2, 2)
        s = SimpleNamespace(Q=self.query * self.key_norm[:, None], mix=mix, beta=beta, T=T,
                            H=[], P=None, phase1=None, weights=[] if record else None)
        depth_commit(self, s, e.unsqueeze(0).expand(2, -1, -1, -1)) # H^0_0 = H^1_0 = e [R]
        return s

    def read(self, s, l):
        # h^j = sum_r softmax_r(w^j_l . RMSNorm_l(C^{keys_of[j]}_r)) C^{values_of[j]}_r ; x_l = alpha_l h^0 + (1 - alpha_l) h^1
        if hasattr(self, 'value_proj'): # SepV: h^j <- W^j_V h^j, the same as projecting every value
            return depth_reads(self, s, l, lambda h: torch.einsum('sbtc,sdc->sbtd', h, self.value_proj[l]))
        return depth_reads(self, s, l)

    def write(self, s, l, y):
        if s.P is None: # P^j = 0 at the start of a block
            s.P = s.beta[l] * y
        else:
            # P^0 <- rho P^0 + (1 - rho) P^1 + beta^0 * y_l ; P^1 <- (1 - rho) P^0 + rho P^1 + beta^1 * y_l
            s.P = torch.einsum('jk,kbtc->jbtc', s.T[l], s.P) + s.beta[l] * y
        if (l + 1) % self.K == 0: # block commit: H^j.append(P^j); P^j = 0
            depth_commit(self, s, s.P)
            s.P = None
        return s

    def end(self, s):
        if s.P is not None:
            depth_commit(self, s, s.P)
            s.P = None
        return self.read(s, len(s.Q) - 1) # final reciprocal read and fusion [R]

    def depth(self, s):
        return dict(weights=s.weights, H=[[v[0] for v, _ in s.H], [v[1] for v, _ in s.H]])

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

    def forward(self, idx, targets=None, cache=None, return_depth=False, ablate_stream=None):
        """Logits for the last position (all positions when targets are given), the loss, and
        with return_depth a dict of the depth read weights and stream histories. ablate_stream=j
        or (j, ...) (dar, mhc) replaces those streams' reads by zeros at every sublayer, for the
        rescue analysis."""
        if ablate_stream is not None and self.config.residual not in ('dar', 'mhc'):
            raise ValueError(f"ablate_stream needs a multi-stream path (dar or mhc), not residual={self.config.residual}")
        if isinstance(ablate_stream, int):
            ablate_stream = (ablate_stream,)
        device = idx.device
        b, t = idx.size()
        past = cache.pos if cache is not None else 0
        assert past + t <= self.config.block_size, f"Cannot forward sequence of length {past + t}, block size is only {self.config.block_size}"
        pos = torch.arange(past, past + t, dtype=torch.long, device=device) # shape (t)
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
        model = cls(GPTConfig(**checkpoint['model_args']))
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

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Take a conditioning sequence of indices idx (LongTensor of shape (b,t)) and complete
        the sequence max_new_tokens times, feeding the predictions back into the model each time.
        A KV cache keeps the keys and values of the context. Positions are absolute, so once the
        context is longer than block_size the window slides, every cached key changes, and the
        cropped context is run again in full: the result always equals the uncached model on
        idx[:, -block_size:]."""
        cache = None
        for _ in range(max_new_tokens):
            if cache is None or idx.size(1) > self.config.block_size:
                cache = KVCache(self.config)
                logits, _ = self(idx[:, -self.config.block_size:], cache=cache)
            else:
                logits, _ = self(idx[:, -1:], cache=cache)
            # pluck the logits at the final step and scale by desired temperature
            logits = logits[:, -1, :] / temperature
            # optionally crop the logits to only the top k options
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

# bf16 dense peak flops per GPU, for MFU (vendor datasheets)
PEAK_FLOPS = {'H200': 989e12, 'H100': 989e12, 'A100': 312e12, 'L4': 121e12}

def peak_flops():
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
