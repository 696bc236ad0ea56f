"""dar-gpt: one GPT, four residual paths (standard pre-norm GPT-2, attnres, mhc, dar). A path gives
each L = 2*n_layer sublayer its input, takes its output y_l: begin(e) -> s; read(s, l) -> x_l;
write(s, l, y_l) -> s. A comment above a line is its equation (equations.md; [R]: reconstructed)."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

import depth_op
from depth_op import fp32 # fp32, or fp64 where the tests compare in it

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304 # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster
    residual: str = 'standard' # standard | attnres | mhc | dar
    depth_block: int = 1 # attnres, dar: sublayers per depth block (1 = Full, 2*n_layer = one block)
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
        r, depth = self.residual, self.residual in ('attnres', 'dar')
        L, db, routing, n = 2 * self.n_layer, self.depth_block, self.dar_routing, self.mhc_streams
        checks = [
            (r in RESIDUALS, f"residual={r} is not one of {', '.join(RESIDUALS)}"),
            (routing in ROUTES, f"dar_routing={routing} is not one of {', '.join(ROUTES)}"),
            (self.n_head >= 1 and self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}"),
            (db >= 1, f"depth_block={db} must be >= 1"),
            (db <= L, f"depth_block={db} exceeds the 2*n_layer={L} sublayers"),
            (depth or db == 1, f"depth_block={db} needs residual=attnres or dar"),
            (depth or self.include_partial, "include_partial=False needs residual=attnres or dar"),
            (r == 'dar' or routing == 'cross', f"dar_routing={routing} needs residual=dar"),
            (n >= 1, f"mhc_streams={n} must be >= 1"),
            (r == 'mhc' or n == 2, f"mhc_streams={n} needs residual=mhc"),
            (min(self.n_expert, self.n_shared_expert, self.expert_hidden) >= 0,
             "n_expert, n_shared_expert and expert_hidden must be >= 0"),
            (self.n_expert == 0 or 1 <= self.n_expert_active <= self.n_expert,
             f"n_expert_active={self.n_expert_active} must be in 1..n_expert={self.n_expert}"),
            (self.moe_every >= 1, f"moe_every={self.moe_every} must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

# the branches: unchanged by every residual path
class CausalSelfAttention(nn.Module):

    def __init__(self, config, i):
        super().__init__()
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.i = i # layer i: its keys and values in the KV cache

    def forward(self, x, cache=None):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            k, v = cache.update(self.i, k, v) # (B, nh, block_size, hs)
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
    """Sparse top-k mixture of expert MLPs, plus optional always-on shared experts. Router in
    fp32; no capacity limit, so a token's output never depends on the rest of the batch."""

    def __init__(self, config):
        super().__init__()
        E, C, D = config.n_expert, config.n_embd, config.expert_hidden or 4 * config.n_embd
        self.k = config.n_expert_active
        self.router = nn.Linear(C, E, bias=False)
        # stacked experts, width D: expert i is gelu(x @ c_fc[i] + b_fc[i]) @ c_proj[i] + b_proj[i]
        self.c_fc = nn.Parameter(torch.randn(E, C, D) * 0.02)
        self.c_proj = nn.Parameter(torch.randn(E, D, C) * 0.02 / math.sqrt(2 * config.n_layer))
        self.b_fc = nn.Parameter(torch.zeros(E, D)) if config.bias else None
        self.b_proj = nn.Parameter(torch.zeros(E, C)) if config.bias else None
        # n always-on experts of width D are one MLP of width n*D
        self.shared = MLP(config, config.n_shared_expert * D) if config.n_shared_expert else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        """The output (B, T, C); the router's losses and expert load in self.stats."""
        B, T, C = x.size()
        x = x.reshape(-1, C) # (B*T, C) tokens
        E, k = self.c_fc.size(0), self.k
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float()) # (B*T, E)
        probs = logits.softmax(-1)
        gate, expert = probs.topk(k, dim=-1) # (B*T, k)
        # gate_i = p_i / sum_{top-k} p; top-1: p_i, as Switch (renormalised: 1, an untrained router)
        gate = gate / gate.sum(-1, keepdim=True) if k > 1 else gate
        # slot s = token * k + choice, one per (token, chosen expert): its expert slot_expert[s]
        slot_expert = expert.view(-1) # (B*T*k,)
        order = slot_expert.argsort(stable=True) # the slots, sorted: each expert's rows contiguous
        token = order // k # the token of each sorted slot
        counts = slot_expert.new_zeros(E).scatter_add_(0, slot_expert, torch.ones_like(slot_expert))
        ys = self.experts(x[token], counts, slot_expert[order]) # expert(x_token) per sorted slot
        # y_token = sum_{i in top-k} gate_i expert_i(x_token): each slot added into its token's row
        weighted = ys * gate.view(-1)[order].unsqueeze(-1).to(ys.dtype)
        y = self.dropout(x.new_zeros(x.shape, dtype=ys.dtype).index_add_(0, token, weighted))
        if self.shared is not None: # its MLP drops out on its own: every expert's output once
            y = y + self.shared(x)
        # load balance = E * sum_e f_e p_e: f_e share of the slots routed to e, p_e mean router prob
        f = counts.float() / counts.sum()
        balance = E * (f * probs.mean(0)).sum()
        # z-loss = mean over tokens of logsumexp(router logits)^2
        z = torch.logsumexp(logits, -1).pow(2).mean()
        self.stats = dict(balance=balance, z=z, load=f.detach())
        return y.view(B, T, C)

    def experts(self, xs, counts, which):
        """expert_i(x) of the rows xs (M, C), grouped by expert, which (M,) gives each row's. bf16:
        one grouped matmul (one graph); fp32, no grouped_mm under compile: a loop (graph break)."""
        device = xs.device.type
        autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
        b_fc = self.b_fc[which] if self.b_fc is not None else 0
        b_proj = self.b_proj[which] if self.b_proj is not None else 0
        if torch.bfloat16 in (self.c_fc.dtype, autocast):
            offs = counts.cumsum(0).to(torch.int32) # end row of each expert's group
            u = F.grouped_mm(xs.bfloat16(), self.c_fc.bfloat16(), offs=offs) + b_fc
            return F.grouped_mm(F.gelu(u).bfloat16(), self.c_proj.bfloat16(), offs=offs) + b_proj
        sizes = counts.tolist()
        u = F.gelu(torch.cat([x_i @ self.c_fc[i] for i, x_i in enumerate(xs.split(sizes))]) + b_fc)
        return torch.cat([u_i @ self.c_proj[i] for i, u_i in enumerate(u.split(sizes))]) + b_proj

class Layer(nn.Module):
    """nanoGPT's Block, its residual additions replaced by the path's read and write. Sublayers
    count from 0: l = 0..L-1 is f_{l+1} of equations.md; l = L is the final read, into ln_f."""

    def __init__(self, config, i):
        super().__init__()
        self.l = 2 * i # its sublayers: attention l, MLP l + 1
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, i)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.moe = config.n_expert > 0 and i % config.moe_every == config.moe_every - 1
        self.mlp = MoE(config) if self.moe else MLP(config)

    def forward(self, res, s, cache=None):
        # y_l = f_l(Norm_l(res.read(s, l))) ; s <- res.write(s, l, y_l)
        # res: the path; s: its state. [R] AttnRes, DAR read N x_l: Norm_l drops N, but for its eps
        s = res.write(s, self.l, self.attn(self.ln_1(res.read(s, self.l)), cache))
        s = res.write(s, self.l + 1, self.mlp(self.ln_2(res.read(s, self.l + 1))))
        return s

class KVCache:
    """Keys and values of every layer, written at a position tensor, read through a mask: static
    shapes, so a compiled step never recompiles. (Depth reads are per token: no cache.)"""

    def __init__(self, model, batch_size, device):
        config, dtype = model.config, model.lm_head.weight.dtype
        if torch.is_autocast_enabled(device.type): # attention computes in autocast's dtype
            dtype = torch.get_autocast_dtype(device.type)
        shape = (batch_size, config.n_head, config.block_size, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.pos = torch.zeros((), dtype=torch.long, device=device) # tokens already cached
        self.mask = None # (T, block_size): the positions each new token sees; set by GPT.forward
        # fixed addresses, written in place by CUDA graphs (no guard: a new cache is no recompile)
        for t in self.k + self.v + [self.pos]:
            torch._dynamo.mark_static_address(t, guard=False)

    def update(self, i, k, v):
        # write layer i's T new positions pos..pos+T-1; return all (the mask hides the unwritten)
        positions = self.pos + torch.arange(k.size(2), device=k.device)
        self.k[i].index_copy_(2, positions, k)
        self.v[i].index_copy_(2, positions, v)
        return self.k[i], self.v[i]

class Standard(nn.Module):
    """x_0 = e ; x_l = x_{l-1} + f_l(Norm(x_{l-1})): the state is the residual stream x."""

    def __init__(self, config):
        super().__init__()

    def begin(self, e):
        return e

    def read(self, x, l):
        return x

    def write(self, x, l, y):
        # x_l = x_{l-1} + y_l
        return x + y

def sinkhorn(logits, iters=20):
    """Doubly stochastic matrix from logits Z (..., n, n), fp32, by Sinkhorn-Knopp, 20 iterations;
    n = 2 (our choice): the limit [[p, 1-p], [1-p, p]]; near the init 20 leave row sums 1e-4 off."""
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
    """Manifold-constrained Hyper-Connections: n streams X (B, T, n, C) mixed per token from the
    normed flat streams xf: pre (streams -> input), post (output -> streams), M (stream mix)."""

    def __init__(self, config):
        super().__init__()
        n, n_embd, L = config.mhc_streams, config.n_embd, 2 * config.n_layer
        self.n = n
        # W_pre | W_post | W_res of every sublayer, fused: (L, nC, n + n + n*n)
        self.proj = nn.Parameter(torch.randn(L, n * n_embd, 2 * n + n * n) / math.sqrt(n * n_embd))
        self.scale = nn.Parameter(torch.full((L, 3), 0.01)) # s_pre, s_post, s_res
        home = torch.arange(n) == torch.arange(L)[:, None] % n # stream l mod n is sublayer l's home
        self.b_pre = nn.Parameter(torch.where(home, 3.0, -3.0)) # +3 on it, -3 elsewhere
        self.b_post = nn.Parameter(torch.zeros(L, n))
        self.B_res = nn.Parameter((6 * torch.eye(n) - 3).repeat(L, 1, 1))
        self.out_proj = nn.Parameter(torch.randn(n * n_embd, n) / math.sqrt(n * n_embd))
        self.out_scale = nn.Parameter(torch.full((1,), 0.01))
        self.out_bias = nn.Parameter(torch.zeros(n))

    def begin(self, e):
        # X_i = e: the state is the streams X
        return e.unsqueeze(2).expand(-1, -1, self.n, -1)

    def read(self, X, l):
        return self.fuse(X, l, *self.reads(X, l))

    def reads(self, X, l):
        """The streams X_i, each read whole, and their weights pre; z = xf @ W for the write."""
        with torch.autocast(X.device.type, enabled=False):
            # xf = RMSNorm(flatten of the n streams), fp32
            xf = F.rms_norm(X.flatten(2).float(), (X.size(2) * X.size(3),), eps=RMS_EPS)
            if l == len(self.proj): # the final read, a sigmoid-weighted sum of the streams
                # pre = sigmoid(s_out * xf @ W_out + b_out)
                pre = torch.sigmoid(self.out_scale * (xf @ self.out_proj) + self.out_bias)
            else:
                self.z = xf @ self.proj[l] # xf @ [W_pre | W_post | W_res] (B, T, 2n+n*n), for write
                # pre = sigmoid(s_pre * xf @ W_pre + b_pre)
                pre = torch.sigmoid(self.scale[l, 0] * self.z[..., :self.n] + self.b_pre[l])
        return list(X.unbind(2)), pre

    def fuse(self, X, l, h, pre):
        # x_l = sum_i pre_i X_i
        return sum(pre[..., i, None] * X_i for i, X_i in enumerate(h))

    def write(self, X, l, y):
        n, z = self.n, self.z # z = xf @ W of this sublayer, from its read
        with torch.autocast(X.device.type, enabled=False):
            # post = 2 * sigmoid(s_post * xf @ W_post + b_post)
            post = 2 * torch.sigmoid(self.scale[l, 1] * z[..., n:2 * n] + self.b_post[l])
            # M = Sinkhorn(s_res * xf @ W_res + B_res)
            M = sinkhorn(self.scale[l, 2] * z[..., 2 * n:].unflatten(-1, (n, n)) + self.B_res[l])
            # X_i <- sum_k M_ik X_k + post_i * y, in fp32 (autocast's bf16 would round the streams)
            return M @ X + post.unsqueeze(-1) * y.unsqueeze(2)

# depth attention, shared by AttnRes and DAR
RMS_EPS = 1e-6 # the depth reads' key RMSNorm (and mHC's, of its streams)

class DepthState:
    """AttnRes's and DAR's state: H[j] = H^j, stream j's history, a list of (B, T, n_embd) entries;
    P = [P^0, P^1] (AttnRes: [b_n^i]), or None: 0, before a block's first write; op: depth_op's."""
    use_op = True # read and write by depth_op's operations (self.op); False: by the lines below

    def __init__(self, e, streams, include_partial, K):
        self.include_partial = include_partial
        self.H, self.P = [[e] for _ in range(streams)], None # H^j_0 = e ; P^j = 0, held as P = None
        self.op = depth_op.Tape(e, streams, K) # the operations' own, for backward

    def candidates(self):
        # C^j = H^j, plus P^j once the block has a write (if include_partial)
        return [H + [P] for H, P in zip(self.H, self.P)] if self.include_partial and self.P is not None else self.H

    def commit(self):
        self.op.commit(self.P)
        for H, P in zip(self.H, self.P):
            H.append(P) # H^j.append(P^j)
        self.P = None # P^j = 0

    def depth_read(self, queries, g, key_streams, value_streams, alphas=None):
        """N x, x = sum_t alphas_t h_t, and the weights (targets, R, B, T): target t reads keys of
        C^k, values of C^v (k, v = key_streams[t], value_streams[t]) with query queries[t]; g:
        RMSNorm's weight."""
        cand = self.candidates() # cand[j] = C^j, R candidates (B, T, n_embd) each
        N = len(cand[0])
        if self.use_op: # the lines below, one op (test_depth_op_equals_the_readable_reads_in_fp64)
            return self.op.read(queries, g, cand, key_streams, value_streams, alphas, RMS_EPS, N)
        h, weights = [], []
        for w, k, v in zip(queries, key_streams, value_streams):
            # keys_r = RMSNorm_g(C^k_r) = g * C^k_r / sqrt(mean((C^k_r)^2) + 1e-6), in fp32
            keys = [F.rms_norm(fp32(c), c.shape[-1:], g, RMS_EPS) for c in cand[k]]
            # a_r = softmax over depth r of w . keys_r (no 1/sqrt(n_embd)): the weights
            weights.append(torch.stack([(w * k_r).sum(-1) for k_r in keys]).softmax(0))
            # h_t = sum_r a_r C^v_r: the values are raw, only the keys are normed
            h.append(sum(a_r.unsqueeze(-1) * v_r for a_r, v_r in zip(weights[-1], cand[v])))
        # x = sum_t alphas_t h_t (DAR: alphas = (alpha_l, 1 - alpha_l); None: one target, x = h_0)
        x = h[0] if alphas is None else sum(alpha * h_t for alpha, h_t in zip(alphas, h))
        # [R] N x: Norm_l(N x) = Norm_l(x) but for its eps, so at init N x is the standard residual
        return N * x, torch.stack(weights)

class AttnRes(nn.Module):
    """Attention Residuals. One stream: its history is b_0 = e and the completed block sums b_1,
    b_2, ...; its partial is b_n^i, the running sum of the current block. depth_block=1: Full."""

    def __init__(self, config):
        super().__init__()
        L, n_embd = 2 * config.n_layer, config.n_embd
        self.L, self.K, self.include_partial = L, config.depth_block, config.include_partial
        self.query = nn.Parameter(torch.zeros(L + 1, n_embd)) # w_l (L: final read), zero-init
        self.key_norm = nn.Parameter(torch.ones(L + 1, n_embd)) # g_l, weight of RMSNorm_l

    def begin(self, e):
        s = DepthState(e, 1, self.include_partial, self.K) # b_0 = e
        s.w, s.g = depth_op.rows(self.query), depth_op.rows(self.key_norm)
        return s

    def read(self, s, l):
        # V = [b_0, .., b_{n-1}, b_n^{i-1}] ; N x_l = N sum_r softmax_r(w_l . RMSNorm_l(V_r)) V_r [R]
        return s.depth_read([s.w[l]], s.g[l], key_streams=[0], value_streams=[0])[0]

    def write(self, s, l, y):
        # b_n^i = b_n^{i-1} + y_l
        s.P = [y if s.P is None else s.P[0] + y]
        # after a block's K-th sublayer ((l + 1) % K == 0), and after sublayer L - 1: commit b_n
        if (l + 1) % self.K == 0 or l + 1 == self.L:
            s.commit()
        return s

ROUTES = { # dar_routing -> (key_streams, value_streams), each indexed by the target j
    'cross': ((1, 0), (0, 1)), # DAR: keys RMSNorm(C^{1-j}), values C^j
    'self': ((0, 1), (0, 1)), # SelfKV: keys RMSNorm(C^j), values C^j
    'crossv': ((0, 1), (1, 0)), # CrossV: keys RMSNorm(C^j), values C^{1-j}
    'fixed': ((0, 0), (1, 1)), # FixedKV: keys RMSNorm(C^0), values C^1, for both targets
    'sepv': ((0, 1), (0, 1)), # SepV: keys RMSNorm(C^j), values W^j_V C^j (DAR.reads)
}

class DAR(nn.Module):
    """Dual Attention Residuals: streams j (history H^j, partial P^j); target j reads keys of the
    other stream, values of its own. Its logits are naive_dar's (test_model.py; K = 2 included)."""

    def __init__(self, config):
        super().__init__()
        L, n_embd = 2 * config.n_layer, config.n_embd
        self.L, self.K, self.include_partial = L, config.depth_block, config.include_partial
        self.key_streams, self.value_streams = ROUTES[config.dar_routing] # cross: (1, 0), (0, 1)
        self.sepv = config.dar_routing == 'sepv'
        # row l < L is sublayer l's, row L the final read's; g_l is shared by both targets
        self.query = nn.Parameter(torch.zeros(L + 1, 2, n_embd)) # w^j_l, zero-init [R: per stream]
        self.key_norm = nn.Parameter(torch.ones(L + 1, n_embd)) # g_l, the weight of RMSNorm_l
        self.alpha_logit = nn.Parameter(torch.zeros(L + 1)) # a_l, init 0: alpha_l = 0.5 [R]
        # b^j_l, init: beta^0 = 1, beta^1 = 2 sigmoid(normal(0, 0.5^2)) per channel, to break the symmetry [R]
        beta_logit = torch.zeros(L, 2, n_embd)
        beta_logit[:, 1].normal_(0, 0.5)
        self.beta_logit = nn.Parameter(beta_logit)
        if self.K > 1: # a block's first write meets no partial: its r_l unused (K = 1: no rho)
            self.rho_logit = nn.Parameter(torch.full((L,), 2.0)) # r_l, init 2: rho_l ~ 0.88 [R]
        if self.sepv: # W^j_V, init I [R]
            self.value_proj = nn.Parameter(torch.eye(n_embd).repeat(L + 1, 2, 1, 1))

    def begin(self, e):
        s = DepthState(e, 2, self.include_partial, self.K) # H^j = [e] [R], P^j = 0
        # rows(p)[l] = p[l], rows(p, 2)[l][j] = p[l, j]: compiled, tensors of their own (test_rows)
        s.w, s.g = depth_op.rows(self.query, 2), depth_op.rows(self.key_norm) # w^j_l, g_l
        s.alpha = depth_op.rows(torch.sigmoid(self.alpha_logit)) # alpha_l = sigmoid(a_l)
        s.beta = depth_op.rows(2 * torch.sigmoid(self.beta_logit)) # beta^j_l = 2 sigmoid(b^j_l)
        s.rho = depth_op.rows(torch.sigmoid(self.rho_logit)) if self.K > 1 else [None] * self.L # rho_l = sigmoid(r_l)
        return s

    def read(self, s, l):
        if self.sepv: # SepV projects each target's read before the fusion
            return self.fuse(s, l, *self.reads(s, l))
        w, g, alpha = s.w[l], s.g[l], s.alpha[l] # w[j] = w^j_l ; g_l: RMSNorm_l's weight ; alpha_l
        # C^j: history H^j plus partial P^j of stream j ; k, v = key_streams[j], value_streams[j]
        # h^j = sum_r softmax_r(w^j_l . RMSNorm_l(C^k_r)) C^v_r ; cross (DAR): k = 1 - j, v = j
        # N x_l = N (alpha_l h^0 + (1 - alpha_l) h^1), N = |C^j| [R]
        Nx, weights = s.depth_read(w, g, self.key_streams, self.value_streams, [alpha, 1 - alpha])
        return Nx # (the weights a^j_r: analyze.py's, through DAR.reads)

    def reads(self, s, l):
        """N h^0, N h^1 apart, their weights (2, R, B, T): SepV's reads, and analyze.py's."""
        h, weights = zip(*[s.depth_read([w], s.g[l], [k], [v]) for w, k, v in zip(s.w[l], self.key_streams, self.value_streams)])
        if self.sepv:
            # SepV: sum_r a_r W^j_V C^j_r = W^j_V h^j, the projection taken out of the sum
            h = [h_j @ self.value_proj[l, j].t() for j, h_j in enumerate(h)]
        return list(h), torch.cat(weights)

    def fuse(self, s, l, h, weights):
        # N x_l = alpha_l N h^0 + (1 - alpha_l) N h^1: SepV's and analyze.Probe's fusion
        return s.alpha[l] * h[0] + (1 - s.alpha[l]) * h[1]

    def write(self, s, l, y):
        beta, rho = s.beta[l], s.rho[l] # beta_l = (beta^0_l, beta^1_l), each (n_embd,); rho_l
        if s.use_op: # the lines below as one op (test_dar_write_operation_equals_its_definition)
            s.P = s.op.write(s.P, y, beta, rho)
        elif s.P is None: # a block starts at P^j = 0: P^j <- beta^j y_l
            s.P = [beta[0] * y, beta[1] * y]
        else: # both read the old P
            P0, P1 = s.P
            # P^0 <- rho P^0 + (1-rho) P^1 + beta^0 y_l ; P^1 <- (1-rho) P^0 + rho P^1 + beta^1 y_l
            s.P = [rho * P0 + (1 - rho) * P1 + beta[0] * y, (1 - rho) * P0 + rho * P1 + beta[1] * y]
        # after a block's K-th sublayer (K = 2: a Layer's MLP), and sublayer L - 1 [R]: commit P^j
        if (l + 1) % self.K == 0 or l + 1 == self.L:
            s.commit() # H^j.append(P^j) ; P^j = 0
        return s

RESIDUALS = dict(standard=Standard, attnres=AttnRes, mhc=MHC, dar=DAR) # residual= picks one

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte = nn.Embedding(config.vocab_size, config.n_embd),
            wpe = nn.Embedding(config.block_size, config.n_embd),
            drop = nn.Dropout(config.dropout),
            h = nn.ModuleList([Layer(config, i) for i in range(config.n_layer)]),
            ln_f = nn.LayerNorm(config.n_embd, bias=config.bias),
            res = RESIDUALS[config.residual](config), # standard has no parameters: nanoGPT's names
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.moe_stats = None # MoE: the last forward's LM loss, router losses, expert load (logs)
        # weight tying (https://paperswithcode.com/method/weight-tying)
        self.transformer.wte.weight = self.lm_head.weight
        # init Linear and Embedding weights (the paths' keep their own), then GPT-2's c_proj init
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02/math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True, active=False):
        """Parameters, without position embeddings by default; active: a token's experts only."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        for m in [layer.mlp for layer in self.transformer.h if layer.moe and active]:
            per_expert = sum(p[0].numel() for p in (m.c_fc, m.c_proj, m.b_fc, m.b_proj) if p is not None)
            n_params -= (self.config.n_expert - self.config.n_expert_active) * per_expert
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, cache=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device) # shape (t)
        if cache is not None: # the new tokens follow the cached ones
            pos = cache.pos + pos
            cache.mask = torch.arange(self.config.block_size, device=idx.device) <= pos[:, None]
        e = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos)) # (b, t, C)
        res = self.transformer.res # the residual path: RESIDUALS[config.residual], one of four
        s = res.begin(e)
        for layer in self.transformer.h:
            s = layer(res, s, cache)
        x = self.transformer.ln_f(res.read(s, 2 * self.config.n_layer))
        if cache is not None:
            cache.pos += t
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(fp32(logits.view(-1, logits.size(-1))), targets.reshape(-1), ignore_index=-1)
            moe = [layer.mlp.stats for layer in self.transformer.h if layer.moe]
            if moe:
                balance, z = (torch.stack([r[k] for r in moe]).mean() for k in ('balance', 'z'))
                load = torch.stack([r['load'] for r in moe]) # (MoE layers, E)
                self.moe_stats = dict(lm=loss.detach(), balance=balance.detach(), z=z.detach(), load=load)
                # loss = LM loss + c_aux * load balance + c_z * z-loss
                loss = loss + self.config.moe_aux_loss_coef * balance + self.config.moe_z_loss_coef * z
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :]) # note: using list [-1] to preserve the time dim
            loss = None
        return logits, loss

    @classmethod
    def from_checkpoint(cls, checkpoint, **change):
        """A model from a checkpoint dict, ours or nanoGPT's (of a compiled model too), its args
        changed by change: a standard one upcycled to attnres or dar keeps its first forward."""
        # dropped: two_phase (speed), nanoGPT's causal mask (torch < 2); a compiled model's prefix
        args = {k: v for k, v in checkpoint['model_args'].items() if k != 'two_phase'}
        model = cls(GPTConfig(**{**args, **change}))
        weights = {k.removeprefix('_orig_mod.'): v for k, v in checkpoint['model'].items() if not k.endswith('.attn.bias')}
        upcycled = 'residual' in change and change['residual'] != args.get('residual', 'standard')
        model.load_state_dict(weights, strict=not upcycled) # upcycled: the path's keep their init
        if upcycled and change['residual'] == 'dar':
            # [R] b^0_l = -b^1_l: beta^0 + beta^1 = 2, so the streams' mean is the standard residual
            model.transformer.res.beta_logit.data[:, 0] = -model.transformer.res.beta_logit.data[:, 1]
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # weights of the branches (MoE's c_fc, c_proj) and embeddings decay; biases (MoE's are 2D),
        # norms and the residual path's don't: decay would pull gates to 0.5, queries to uniform
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decays = lambda n, p: p.dim() >= 2 and n.endswith(('weight', 'c_fc', 'c_proj'))
        decay_params = [p for n, p in params.items() if decays(n, p)]
        nodecay_params = [p for n, p in params.items() if not decays(n, p)]
        optim_groups = [{'params': decay_params, 'weight_decay': weight_decay}, {'params': nodecay_params, 'weight_decay': 0.0}]
        for name, group in (('decayed', decay_params), ('non-decayed', nodecay_params)):
            print(f"num {name} parameter tensors: {len(group)}, with {sum(p.numel() for p in group):,} parameters")
        use_fused = device_type in ('cuda', 'cpu') # one kernel: 0.6 ms vs 2.3 foreach, 2 CPU cores
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, fused=use_fused)
        print(f"using fused AdamW: {use_fused}")
        return optimizer

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model flops utilization against this GPU's bf16 dense peak (PaLM's flops, no depth read),
        found by a word of its name ('A100-SXM4' has A100, 'L40S' has no L4); else None."""
        peaks = {'H200': 989e12, 'H100': 989e12, 'A100': 312e12, 'L4': 121e12} # bf16 dense
        name = torch.cuda.get_device_name().replace('-', ' ').split() if torch.cuda.is_available() else []
        peak = next((v for k, v in peaks.items() if k in name), None)
        if peak is None:
            return None
        n_params, cfg = self.get_num_params(active=True), self.config
        n_layer, n_head, hs, T = cfg.n_layer, cfg.n_head, cfg.n_embd//cfg.n_head, cfg.block_size
        flops_per_token = 6*n_params + 12*n_layer*n_head*hs*T
        return flops_per_token * T * fwdbwd_per_iter / dt / peak

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, forward=None):
        """Complete idx (b, t) max_new_tokens times with a KV cache; once the window slides it runs
        again in full (positions are absolute). forward: self, or a compiled model (sample.py)."""
        forward = self if forward is None else forward
        cache, T = KVCache(self, idx.size(0), idx.device), self.config.block_size
        # the last T tokens, copied (a view's strides grow with idx: a recompile each time)
        crop = lambda idx: idx[:, -T:].clone(memory_format=torch.contiguous_format)
        tokens = crop(idx) # to prefill
        for _ in range(max_new_tokens):
            if idx.size(1) > T: # the window slides: run it again from position 0
                cache.pos.zero_()
                tokens = crop(idx)
            logits, _ = forward(tokens, cache=cache)
            logits = logits[:, -1, :] / temperature # the final step's, scaled by the temperature
            if top_k is not None: # only the top k options
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
            tokens = idx_next
        return idx
