"""
Tests of dar-gpt, all on CPU. The fast ones (every equation, causality, the KV cache, the error
messages), then the slow ones (compiles, torchrun, training subprocesses, sweeps):

$ python -m pytest -q -m "not slow" test_model.py
$ python -m pytest -q -m slow test_model.py

The residual paths are checked against naive references written here with explicit Python
loops over sublayers and candidates and softmax by explicit exp / sum.
"""
import os
import sys
import json
import math
import re
import pickle
import platform
import subprocess
import contextlib
import glob
import queue
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import model as model_module
import depth_op
from model import GPT, GPTConfig, KVCache, ROUTES, sinkhorn
from sample import compile_for_generation
import bench
import train
import sample
import analyze
from model import MoE, MLP
from configurator import configure

ROOT = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(ROOT, '..', 'shared')
EPS = 1e-6 # the model's RMS eps

def tiny(**kw):
    args = dict(block_size=16, vocab_size=50, n_layer=3, n_head=2, n_embd=32, bias=False, dropout=0.0)
    args.update(kw)
    return GPTConfig(**args)

# one entry per path and routing; Block variants use K=4 over L=6 sublayers (a short last block)
PATHS = {
    'standard': dict(),
    'attnres-full': dict(residual='attnres'),
    'attnres-block': dict(residual='attnres', depth_block=4),
    'mhc': dict(residual='mhc'),
    'mhc-3': dict(residual='mhc', mhc_streams=3),
    **{f'dar-{r}-full': dict(residual='dar', dar_routing=r) for r in ('cross', 'self', 'crossv', 'fixed', 'sepv')},
    **{f'dar-{r}-block': dict(residual='dar', dar_routing=r, depth_block=4) for r in ('cross', 'self', 'crossv', 'fixed', 'sepv')},
}
MOE = dict(n_expert=4, n_expert_active=2, n_shared_expert=1, expert_hidden=24)
PATHS.update({f'{name}+moe': dict(PATHS[name], **MOE) for name in
              ('standard', 'attnres-full', 'attnres-block', 'mhc', 'dar-cross-full', 'dar-cross-block')})

def randomize(model, seed=0):
    """Non-zero queries and random gates, so no read is uniform and no gate sits at its init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.transformer.res.named_parameters():
            if name == 'value_proj':
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif name in ('key_norm',):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name == 'scale':
                p.copy_(0.5 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model

def make(name, seed=0, **kw):
    torch.manual_seed(seed)
    model = GPT(tiny(**{**PATHS[name], **kw}))
    model.eval()
    return randomize(model, seed)

def full_logits(model, idx):
    logits, _ = model(idx, targets=idx) # targets make the model return every position
    return logits

# -----------------------------------------------------------------------------
# naive references

def rmsnorm(v, g):
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + EPS) * g

def sigmoid(x):
    return 1 / (1 + torch.exp(-x))

def naive_read(w, g, keys, values):
    """sum_r [exp(w . RMSNorm(k_r)) / sum_s exp(w . RMSNorm(k_s))] v_r, one candidate at a time."""
    scores = []
    for k in keys:
        scores.append((rmsnorm(k, g) * w).sum(-1))
    exps = [torch.exp(s) for s in scores]
    total = sum(exps)
    x = 0
    for ex, v in zip(exps, values):
        x = x + (ex / total).unsqueeze(-1) * v
    return x

def embed(model, idx):
    pos = torch.arange(idx.size(1))
    return model.transformer.wte(idx) + model.transformer.wpe(pos)

def sublayer(model, l, x):
    block = model.transformer.h[l // 2]
    if l % 2 == 0:
        return block.attn(block.ln_1(x))
    if block.moe:
        return naive_moe(block.mlp, block.ln_2(x))
    return block.mlp(block.ln_2(x))

def head(model, h):
    return model.lm_head(model.transformer.ln_f(h))

def naive_standard(model, idx):
    """nanoGPT's GPT written out from its state_dict names: attention by explicit masked softmax."""
    sd, cfg = model.state_dict(), model.config
    B, T = idx.shape
    C, nh = cfg.n_embd, cfg.n_head
    ln = lambda x, p: F.layer_norm(x, (C,), sd[p + '.weight'], sd.get(p + '.bias'), 1e-5)
    lin = lambda x, p: x @ sd[p + '.weight'].t() + (sd[p + '.bias'] if p + '.bias' in sd else 0)
    x = sd['transformer.wte.weight'][idx] + sd['transformer.wpe.weight'][:T]
    for i in range(cfg.n_layer):
        p = f'transformer.h.{i}.'
        q, k, v = lin(ln(x, p + 'ln_1'), p + 'attn.c_attn').split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(C // nh)
        att = att.masked_fill(torch.ones(T, T).tril() == 0, float('-inf'))
        att = torch.exp(att - att.amax(-1, keepdim=True))
        att = att / att.sum(-1, keepdim=True)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + lin(y, p + 'attn.c_proj')
        x = x + lin(F.gelu(lin(ln(x, p + 'ln_2'), p + 'mlp.c_fc')), p + 'mlp.c_proj')
    return ln(x, 'transformer.ln_f') @ sd['lm_head.weight'].t()

def naive_attnres(model, idx):
    res, cfg = model.transformer.res, model.config
    L, K = 2 * cfg.n_layer, cfg.depth_block
    blocks, partial = [embed(model, idx)], None
    for l in range(L):
        candidates = list(blocks)
        if partial is not None and cfg.include_partial:
            candidates.append(partial)
        # [R] the pre-norm sees N x_l, N the number of candidates
        x = len(candidates) * naive_read(res.query[l], res.key_norm[l], candidates, candidates)
        y = sublayer(model, l, x)
        partial = y if partial is None else partial + y
        if (l + 1) % K == 0:
            blocks.append(partial)
            partial = None
    if partial is not None:
        blocks.append(partial)
    return head(model, len(blocks) * naive_read(res.query[L], res.key_norm[L], blocks, blocks))

def naive_dar_reads(res, routing, C, l):
    """h^0, h^1 from the candidates C[0], C[1] (lists), by the routing table of equations.md."""
    h = []
    for j in (0, 1):
        if routing == 'cross':
            keys, values = C[1 - j], C[j]
        elif routing == 'self':
            keys, values = C[j], C[j]
        elif routing == 'crossv':
            keys, values = C[j], C[1 - j]
        elif routing == 'fixed':
            keys, values = C[0], C[1]
        elif routing == 'sepv':
            keys, values = C[j], [v @ res.value_proj[l, j].t() for v in C[j]]
        h.append(naive_read(res.query[l, j], res.key_norm[l], keys, values))
    return h

def naive_dar(model, idx):
    res, cfg = model.transformer.res, model.config
    L, K = 2 * cfg.n_layer, cfg.depth_block
    e = embed(model, idx)
    H, P = [[e], [e]], None
    for l in range(L):
        C = [list(H[0]), list(H[1])]
        if P is not None and cfg.include_partial:
            C[0].append(P[0])
            C[1].append(P[1])
        h0, h1 = naive_dar_reads(res, cfg.dar_routing, C, l)
        alpha = sigmoid(res.alpha_logit[l])
        y = sublayer(model, l, len(C[0]) * (alpha * h0 + (1 - alpha) * h1)) # [R] N x_l
        beta0, beta1 = 2 * sigmoid(res.beta_logit[l, 0]), 2 * sigmoid(res.beta_logit[l, 1])
        if P is None:
            P = [beta0 * y, beta1 * y]
        else:
            rho = sigmoid(res.rho_logit[l])
            P = [rho * P[0] + (1 - rho) * P[1] + beta0 * y, (1 - rho) * P[0] + rho * P[1] + beta1 * y]
        if (l + 1) % K == 0:
            H[0].append(P[0])
            H[1].append(P[1])
            P = None
    if P is not None:
        H[0].append(P[0])
        H[1].append(P[1])
    h0, h1 = naive_dar_reads(res, cfg.dar_routing, H, L)
    alpha = sigmoid(res.alpha_logit[L])
    return head(model, len(H[0]) * (alpha * h0 + (1 - alpha) * h1))

def naive_sinkhorn(logits, iters=20):
    if logits.size(-1) == 2 and iters == 20:
        # the limit, which the model uses for n = 2: D1 exp(Z) D2 = [[p, 1-p], [1-p, p]] gives
        # p^2 / (1-p)^2 = a d / (b c); test_sinkhorn_closed_form_is_the_iteration_limit checks it
        E = torch.exp(logits)
        a, b, c, d = E[..., 0, 0], E[..., 0, 1], E[..., 1, 0], E[..., 1, 1]
        p = torch.sqrt(a * d) / (torch.sqrt(a * d) + torch.sqrt(b * c))
        return torch.stack([torch.stack([p, 1 - p], -1), torch.stack([1 - p, p], -1)], -2)
    ex = torch.exp(logits - logits.amax(-1, keepdim=True))
    M = ex / ex.sum(-1, keepdim=True)
    M = M / M.sum(-2, keepdim=True)
    for _ in range(iters - 1):
        M = M / M.sum(-1, keepdim=True)
        M = M / M.sum(-2, keepdim=True)
    return M

def naive_mhc(model, idx):
    res, cfg = model.transformer.res, model.config
    n = cfg.mhc_streams
    e = embed(model, idx)
    X = [e for _ in range(n)]
    def normed_flat(X):
        xf = torch.cat(X, -1)
        return xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + EPS)
    for l in range(2 * cfg.n_layer):
        z = normed_flat(X) @ res.proj[l]
        s_pre, s_post, s_res = res.scale[l]
        pre = sigmoid(s_pre * z[..., :n] + res.b_pre[l])
        post = 2 * sigmoid(s_post * z[..., n:2 * n] + res.b_post[l])
        M = naive_sinkhorn(s_res * z[..., 2 * n:].reshape(*z.shape[:-1], n, n) + res.B_res[l])
        x = sum(pre[..., i:i + 1] * X[i] for i in range(n))
        y = sublayer(model, l, x)
        X = [sum(M[..., i, k:k + 1] * X[k] for k in range(n)) + post[..., i:i + 1] * y for i in range(n)]
    w = sigmoid(res.out_scale * (normed_flat(X) @ res.out_proj) + res.out_bias)
    return head(model, sum(w[..., i:i + 1] * X[i] for i in range(n)))

def naive_residual(model, idx):
    """h_l = h_{l-1} + f_l(Norm(h_{l-1})), for the standard path with MoE layers."""
    h = embed(model, idx)
    for l in range(2 * model.config.n_layer):
        h = h + sublayer(model, l, h)
    return head(model, h)

NAIVE = dict(standard=naive_standard, attnres=naive_attnres, dar=naive_dar, mhc=naive_mhc)

# -----------------------------------------------------------------------------
# every path against its naive reference

# include_partial=False exists only for the depth paths (attnres, dar)
@pytest.mark.parametrize('name, include_partial', [(n, True) for n in PATHS] +
                         [(n, False) for n in PATHS if PATHS[n].get('residual') in ('attnres', 'dar')])
def test_matches_naive_reference(name, include_partial):
    model = make(name, include_partial=include_partial)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = (naive_residual if name == 'standard+moe' else NAIVE[model.config.residual])(model, idx)
    assert_logits_both_ways(model, idx, want)

def assert_logits_both_ways(model, idx, want):
    """The model's logits equal want, computed without autograd (inference) and with it (the
    training path: depth_op's operations as autograd functions, the writes recorded)."""
    with torch.no_grad():
        inference = full_logits(model, idx)
    training = full_logits(model, idx)
    assert training.requires_grad
    for got in (inference, training.detach()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize('name', ['attnres-block', 'dar-cross-block'])
def test_matches_naive_reference_with_train_pys_blocks_of_two(name):
    """depth_block=2, train.py's: every block whole (PATHS' K = 4 leaves a short last block); the
    partial read (DAR: cross routing, PATHS'); make() randomises the queries and gates."""
    model = make(name, depth_block=2, include_partial=True)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = NAIVE[model.config.residual](model, idx)
    assert_logits_both_ways(model, idx, want)

def test_standard_state_dict_names_are_nanogpts():
    model = GPT(tiny(n_layer=1, bias=True))
    names = set(model.state_dict())
    want = {'transformer.wte.weight', 'transformer.wpe.weight', 'lm_head.weight',
            'transformer.ln_f.weight', 'transformer.ln_f.bias'}
    for p in ('ln_1', 'ln_2', 'attn.c_attn', 'attn.c_proj', 'mlp.c_fc', 'mlp.c_proj'):
        want |= {f'transformer.h.0.{p}.weight', f'transformer.h.0.{p}.bias'}
    assert names == want

@pytest.mark.parametrize('bias', [False, True])
def test_nanogpt_checkpoint_gives_the_same_logits(bias):
    """A nanoGPT-style checkpoint (compiled-model prefix included) loads and matches nanoGPT's math."""
    torch.manual_seed(3)
    src = GPT(tiny(bias=bias))
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.05 * torch.randn_like(p)) # biases and norms away from their init
    args = dict(n_layer=3, n_head=2, n_embd=32, block_size=16, bias=bias, vocab_size=50, dropout=0.0)
    ckpt = dict(model_args=args, model={'_orig_mod.' + k: v for k, v in src.state_dict().items()})
    model = GPT.from_checkpoint(ckpt)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, idx), naive_standard(src, idx), atol=1e-5, rtol=1e-5)

def test_from_checkpoint_changes_only_what_it_is_asked():
    """A DAR checkpoint loaded as DAR keeps its gates (the upcycling's b^0 = -b^1 is for a standard
    one); a change that is no upcycling loads strictly; nanoGPT's saved causal mask is dropped."""
    torch.manual_seed(0)
    src = randomize(GPT(tiny(residual='dar', depth_block=2)))
    ckpt = dict(model_args=vars(src.config), model=src.state_dict())
    same = GPT.from_checkpoint(ckpt, residual='dar', dropout=0.1)
    assert torch.equal(same.transformer.res.beta_logit, src.transformer.res.beta_logit)
    del ckpt['model']['transformer.res.query']
    with pytest.raises(RuntimeError, match='Missing key'):
        GPT.from_checkpoint(ckpt, dropout=0.1)
    std = GPT(tiny())
    weights = {**std.state_dict(), **{f'transformer.h.{i}.attn.bias': torch.ones(1, 1, 16, 16).tril() for i in range(3)}}
    loaded = GPT.from_checkpoint(dict(model_args=vars(std.config), model=weights))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), std.state_dict().values()))

def test_weight_decay_takes_the_weights_only():
    """2D weights decay (the MoE's stacked experts too); biases (the MoE's are 2D), norms and the
    residual path's parameters do not."""
    model = GPT(tiny(residual='dar', depth_block=2, bias=True, **MOE))
    decayed, kept = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), 'cpu').param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decayed['params']}
    assert {n for n in names.values() if n not in decayed} == {n for n, p in model.named_parameters()
        if p.dim() < 2 or n.startswith('transformer.res.') or n.endswith(('b_fc', 'b_proj'))}
    assert 'transformer.h.0.mlp.c_fc' in decayed and 'transformer.h.0.mlp.b_fc' not in decayed

@pytest.mark.parametrize('name, peak', [('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA A100-SXM4-80GB', 312e12),
                                        ('NVIDIA L4', 121e12), ('NVIDIA L40S', None)])
def test_mfu_peak_is_found_by_a_word_of_the_gpu_name(name, peak, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda *args: name)
    model = GPT(tiny())
    mfu = model.estimate_mfu(1, 1.0)
    assert (mfu is None) == (peak is None)
    if peak is not None: # mfu * peak: the flops of one forward-backward per second, whatever the GPU
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda *args: 'NVIDIA H200')
        assert mfu * peak == pytest.approx(model.estimate_mfu(1, 1.0) * 989e12)

def test_mhc_streams_stay_fp32_under_autocast():
    """X <- M X + post y: under bf16 autocast the stream mix stays in fp32, as the standard
    residual's add does (autocast's bf16 matmul would round the streams at every sublayer)."""
    torch.manual_seed(0)
    res = randomize(GPT(tiny(residual='mhc'))).transformer.res
    X, y = torch.randn(2, 8, 2, 32), torch.zeros(2, 8, 32)
    res.reads(X, 0)
    want = res.write(X, 0, y)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        res.reads(X, 0)
        got = res.write(X, 0, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

# -----------------------------------------------------------------------------
# invariants of every path

@pytest.mark.parametrize('name', PATHS)
def test_causal(name):
    model = make(name)
    idx = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = full_logits(model, idx)
        for t in (0, 7, 14):
            changed = idx.clone()
            changed[0, t + 1] = (changed[0, t + 1] + 1) % 50
            out = full_logits(model, changed)
            # MoE groups tokens by expert, so matmul rounding may move by an ulp; a leak moves far more
            torch.testing.assert_close(out[:, :t + 1], base[:, :t + 1], atol=1e-6, rtol=0,
                                       msg=f"position <= {t} saw token {t + 1}")
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])

@pytest.mark.parametrize('name', PATHS)
def test_kv_cache_equals_uncached_forward(name):
    model = make(name)
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # logits: prefill 5 tokens, then one at a time, then a chunk of 3
        cache = KVCache(model, 2, idx.device)
        pieces = [model(idx[:, :5], cache=cache, targets=idx[:, :5])[0]]
        for t in range(5, 9):
            pieces.append(model(idx[:, t:t + 1], cache=cache)[0])
        pieces.append(model(idx[:, 9:12], cache=cache, targets=idx[:, 9:12])[0])
        torch.testing.assert_close(torch.cat(pieces, 1), full_logits(model, idx), atol=1e-5, rtol=1e-5)
        # greedy tokens, past block_size (16) so the window slides
        prompt = idx[:, :10]
        want = prompt
        for _ in range(12):
            logits = full_logits(model, want[:, -16:])[:, -1]
            want = torch.cat([want, logits.argmax(-1, keepdim=True)], 1)
        got = model.generate(prompt, 12, top_k=1)
    assert torch.equal(got, want)

@pytest.mark.slow
@pytest.mark.parametrize('name', ['standard', 'attnres-block', 'mhc', 'dar-cross-full', 'dar-cross-block'])
def test_compiled_generation_traces_prefill_step_and_window_once(name):
    """generate with a compiled forward: a graph for the prefill, one for the one-token step and
    one for the full sliding window, each traced once; the tokens equal eager generation's for the
    same seed, before and after the window slides (block_size 16)."""
    model = make(name)
    graphs = []
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    forward = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    for batch in (2, 1): # batch 1, as sample.py runs: a size-1 dim's stride must not leak into the guards
        prompt = torch.randint(0, 50, (batch, 3), generator=torch.Generator().manual_seed(7))
        torch._dynamo.reset()
        graphs.clear()
        torch.manual_seed(0)
        got = model.generate(prompt, 11, forward=forward) # 14 tokens: within block_size
        assert len(graphs) == 2
        torch.manual_seed(0)
        assert torch.equal(got, model.generate(prompt, 11))
        torch.manual_seed(1)
        got = model.generate(prompt, 24, forward=forward) # the window slides for 11 tokens
        assert len(graphs) == 3
        torch.manual_seed(1)
        assert torch.equal(got, model.generate(prompt, 24))

@pytest.mark.slow
def test_compiled_decode_equals_eager_with_inductor():
    """sample.py's compile (inductor, with its C++ wrapper on CPU): 12 decoded tokens equal eager
    generation's, with two graphs compiled (the prefill and the one-token step), and none more for
    a second sample with a new cache."""
    model = make('dar-cross-block', n_layer=2)
    prompt = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(8))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    forward = compile_for_generation(model)
    for _ in range(2):
        got = model.generate(prompt, 12, top_k=1, forward=forward)
        assert torch.equal(got, model.generate(prompt, 12, top_k=1))
    assert counters['stats']['unique_graphs'] == 2

@pytest.mark.parametrize('name', PATHS)
def test_gradient_reaches_every_parameter(name):
    model = make(name) # non-zero queries: at zero queries the key norms' gradient is exactly 0
    idx = torch.randint(0, 50, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{n} gets no gradient"

# -----------------------------------------------------------------------------
# the depth read as one operation (depth_op.py) against its definition, DepthState.depth_read's lines

DEPTH = [n for n in PATHS if PATHS[n].get('residual') in ('attnres', 'dar') and '+moe' not in n]

def use_readable(monkeypatch):
    """The model runs the readable definitions, DepthState.depth_read's and DAR.write's lines."""
    monkeypatch.setattr(model_module.DepthState, 'use_op', False)

def use_torch_ops(monkeypatch):
    """depth_op's operations run their torch-ops bodies: no Triton kernel, no depth_op.cpp."""
    monkeypatch.setattr(depth_op, 'on_triton', lambda tensors: False)
    monkeypatch.setattr(depth_op, 'on_kernel', lambda tensors: False)

def loss_and_grads(name, include_partial, compile=None, seed=1, **kw):
    """The training loss and every parameter's gradient of the path's fp64 model."""
    model = make(name, include_partial=include_partial, **kw).double()
    model.train()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(seed))
    forward = model if compile is None else torch.compile(model, fullgraph=True, backend=compile)
    _, loss = forward(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

def assert_same(got, want, tol=1e-10):
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=tol, atol=tol, msg=n)

def needs_interpreter():
    if not depth_op.INTERPRET:
        pytest.skip("Triton's interpreter: test_triton_kernels_in_the_interpreter runs this with TRITON_INTERPRET=1")

@pytest.mark.parametrize('body', ['kernel', 'torch', 'triton'])
@pytest.mark.parametrize('name, include_partial, K', [(n, p, None) for n in DEPTH for p in (True, False)]
                         + [('attnres-block', True, 2), ('dar-cross-block', True, 2), ('dar-cross-block', False, 2)]) # K = 2: train.py's
def test_depth_op_equals_the_readable_reads_in_fp64(name, include_partial, K, body, monkeypatch):
    """Every path, routing, K (1, 4 over 6 sublayers, and train.py's 2) and partial on / off: the
    loss and every gradient of the model that runs depth_op (depth_op.cpp, its torch-ops body, or
    its Triton kernels in Triton's interpreter) equal those of the lines of DepthState.depth_read
    and DAR.write, in fp64. make() randomises the path's parameters: no query zero, no gate at its
    init (randomize)."""
    kw = {} if K is None else dict(depth_block=K)
    if body == 'triton':
        needs_interpreter()
    elif body == 'torch':
        use_torch_ops(monkeypatch)
    else:
        monkeypatch.setattr(depth_op, 'on_triton', lambda tensors: False)
        assert depth_op.library() is not None, "depth_op.cpp did not build"
    got = loss_and_grads(name, include_partial, **kw)
    use_readable(monkeypatch)
    assert_same(got, loss_and_grads(name, include_partial, **kw))

@pytest.mark.slow
@pytest.mark.parametrize('name, include_partial', [(n, p) for n in DEPTH for p in (True, False)])
def test_compiled_depth_op_equals_the_readable_reads_in_fp64(name, include_partial, monkeypatch):
    """Compiled (the custom operations, their fake tensors and their autograd, traced as inductor
    gets them, partitioned into forward and backward): the readable reads' loss and gradients."""
    torch._dynamo.reset()
    got = loss_and_grads(name, include_partial, compile='aot_eager_decomp_partition')
    use_readable(monkeypatch)
    assert_same(got, loss_and_grads(name, include_partial))

@pytest.mark.slow
@pytest.mark.parametrize('name', ['attnres-block', 'dar-cross-full', 'dar-cross-block', 'dar-fixed-block', 'dar-sepv-block'])
def test_inductor_depth_op_equals_the_readable_reads_in_fp64(name, monkeypatch):
    """Inductor's code around the operations: the readable reads' loss and gradients, in fp64."""
    torch._dynamo.reset()
    got = loss_and_grads(name, True, compile='inductor')
    use_readable(monkeypatch)
    assert_same(got, loss_and_grads(name, True), tol=1e-9)

@pytest.mark.parametrize('compiled', [False, True])
def test_rows(compiled):
    """depth_op.rows(p)[l] = p[l] and rows(p, 2)[l][j] = p[l, j], and the gradient through them is
    that of p's entries, eager and compiled (where the rows are a custom operation's outputs)."""
    torch._dynamo.reset()
    p = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 5, dtype=torch.float64)
    def by_rows(p):
        r, r2 = depth_op.rows(p), depth_op.rows(p, 2)
        return torch.stack([torch.stack(r2[l]) for l in range(3)]), torch.stack(r), (torch.stack(r) * w).sum()
    def by_index(p):
        return p, p, (p * w).sum()
    got = (torch.compile(by_rows, fullgraph=True, backend='aot_eager') if compiled else by_rows)(p)
    want = by_index(p)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    grad, = torch.autograd.grad(got[0].sum() + 2 * got[1].sum() + got[2], p)
    torch.testing.assert_close(grad, 3 + w, rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('routes', [[0, 0], [1, 0, 0, 1], [0, 0, 1, 1], [0, 1, 0, 1]])
def test_triton_read_equals_its_torch_ops(routes, dtype):
    """The Triton kernels (in Triton's interpreter) against the read's torch ops: x, the weights,
    scores and the key streams' rms, and every gradient, with and without gates and a partial,
    into new buffers and in place, over several programs (150 tokens; backward's three each take
    several blocks), rows not a power of two wide (40)."""
    needs_interpreter()
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)
    S, Tn, R, C, tol = max(routes) + 1, len(routes) // 2, 3, 40, 1e-4 if dtype == torch.float32 else 1e-10
    for gated, partial, in_place in [(False, False, False), (True, True, False), (True, False, True), (False, True, True)]:
        cand, ws, w_g = [rand(5, 30, C) for _ in range(S * R)], [rand(C) for _ in range(Tn)], rand(C).abs() + 0.5
        gates = [rand(()) for _ in range(Tn)] if gated else []
        args = (ws, w_g, cand, R, routes, gates)
        got, want = depth_op.read_forward(*args, EPS, float(R)), depth_op.read_torch(*args, EPS, float(R))
        keyed = sorted(set(routes[0::2])) # the kernel keeps the rms of the streams read as keys only
        for a, b in zip([*got[:3], got[3][keyed]], [*want[:3], want[3][keyed]]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        dx, dS = rand(5, 30, C), [rand(R - partial, 5, 30, C) for _ in range(S)]
        backward = lambda: depth_op.read_backward(dx, *args, *want[1:], [d.clone() for d in dS], float(R), in_place)
        got = backward()
        with pytest.MonkeyPatch.context() as m:
            use_torch_ops(m)
            want_grads = backward()
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want_grads)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)

@pytest.mark.parametrize('partial', [False, True])
@pytest.mark.parametrize('dtypes', [(torch.float64,) * 2, (torch.float32,) * 2, (torch.bfloat16, torch.float32)])
def test_triton_write_equals_its_definition(dtypes, partial):
    """DAR's write by its Triton kernels (in Triton's interpreter) against DAR.write's lines: the
    partials and the gradients of the partials, y, beta and rho; y in bf16 beside fp32 partials
    and gates (CUDA under autocast) too."""
    needs_interpreter()
    g = torch.Generator().manual_seed(0)
    leaf = lambda dtype, *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    y_dtype, dtype = dtypes
    P = [leaf(dtype, 5, 30, 40), leaf(dtype, 5, 30, 40)] if partial else None
    y, beta, rho = leaf(y_dtype, 5, 30, 40), leaf(dtype, 2, 40), leaf(dtype, ())
    d = [torch.randn(5, 30, 40, generator=g, dtype=dtype) for _ in range(2)]
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for got, want in write_and_definition(P, y, beta, rho, d):
        # y's gradient in bf16: autograd rounds each term to bf16 before the sum, the kernel once
        rtol, atol = (1.6e-2, 1.6e-2 * want.abs().max().item()) if got.dtype == torch.bfloat16 else (tol, tol)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)

@pytest.mark.slow
def test_triton_kernels_in_the_interpreter():
    """depth_op's Triton kernels (CUDA's) run on CPU in Triton's interpreter (TRITON_INTERPRET=1,
    set before Triton loads: a process of its own): the tests marked for it, and the compiled model
    against the readable reads (the custom operations' bodies then run the kernels); none skipped."""
    pytest.importorskip('triton', reason='pip install triton: its interpreter runs the CUDA kernels on CPU')
    env = dict(os.environ, TRITON_INTERPRET='1')
    p = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', os.path.join(ROOT, 'test_model.py'),
                        '-k', 'triton_read_equals or triton_write_equals or (readable_reads_in_fp64 and triton and not compiled) '
                        'or test_compiled_depth_op_equals'],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    summary = p.stdout.strip().splitlines()[-1]
    assert p.returncode == 0 and 'skipped' not in summary and re.search(r'\b(\d+) passed', summary), p.stdout[-3000:]
    # 8 read, 6 write; per depth path and partial on / off: eager and compiled; 3 at K = 2
    assert int(re.search(r'(\d+) passed', summary)[1]) == 8 + 6 + 4 * len(DEPTH) + 3, summary

@pytest.mark.slow
def test_triton_kernels_compile_for_a_gpu_without_one():
    """The Triton kernels compiled as a GPU would (sm_90, an H100: Triton's own compiler and
    ptxas, no driver needed) to a cubin: the read's at both widths' tiles, one target and two, fp32
    and fp64; the write's with and without partials, y in bf16 beside fp32."""
    triton = pytest.importorskip('triton', reason='pip install triton')
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    fwd = ['cand', 'u', 'ks', 'vs', 'gt', 'x', 'sc', 'rms', 'N', 'C', 'R', 'S', 'eps']
    bwd = ['dx', 'cand', 'ca', 'yb', 'cb', 'u', 'ks', 'vs', 'gt', 'a', 'sc', 'rms', 'gin', 'gout', 'q', 'sa', 'du', 'dgate', 'N', 'C', 'R', 'S']
    for dtype, DT in (('fp32', triton.language.float32), ('fp64', triton.language.float64)):
        kind = lambda name: 'i32' if name in ('N', 'C', 'R', 'S') else 'fp32' if name == 'eps' else \
            '*i64' if name in ('cand', 'ca', 'yb', 'cb', 'ks', 'vs', 'gin', 'gout') else f'*{dtype}'
        for kernel, names in ((depth_op._read_fwd, fwd), (depth_op._read_bwd, bwd)):
            for TN, C in ((1, 768), (2, 768), (2, 128)):
                tile = depth_op.READ_FWD_TILE if kernel is depth_op._read_fwd else depth_op.READ_BWD_TILE
                BN, BC = depth_op.blocks(C, tile)
                signature = {n: kind(n) for n in names} | dict.fromkeys(('TN', 'BN', 'BC', 'DT'), 'constexpr')
                src = ASTSource(fn=kernel, signature=signature, constexprs=dict(TN=TN, BN=BN, BC=BC, DT=DT))
                compiled = triton.compile(src, target=GPUTarget('cuda', 90, 32), options=dict(num_warps=depth_op.WARPS))
                assert len(compiled.asm['cubin']) > 0
    BN, BC = depth_op.blocks(768, depth_op.WRITE_TILE)
    for kernel, names in ((depth_op._write_fwd, ['P0', 'P1', 'y', 'beta', 'rho', 'o0', 'o1', 'N', 'C']),
                          (depth_op._write_bwd, ['P0', 'P1', 'y', 'beta', 'rho', 'd0', 'd1', 'dP0', 'dP1', 'dy', 'dbeta',
                                                 'drho', 'N', 'C'])):
        for has_p in (False, True):
            signature = {n: 'i32' if n in ('N', 'C') else '*bf16' if n in ('y', 'dy') else '*fp32' for n in names}
            signature |= dict.fromkeys(('HAS_P', 'BN', 'BC'), 'constexpr')
            src = ASTSource(fn=kernel, signature=signature, constexprs=dict(HAS_P=has_p, BN=BN, BC=BC))
            compiled = triton.compile(src, target=GPUTarget('cuda', 90, 32), options=dict(num_warps=depth_op.WARPS))
            assert len(compiled.asm['cubin']) > 0

def test_triton_kernels_that_fail_run_torch_ops_after_one_line(monkeypatch, capsys):
    """Where the Triton kernels cannot run (here: compiled for a GPU, given CPU tensors), one line,
    and the reads run as torch ops from then on, with the same result."""
    pytest.importorskip('triton', reason='pip install triton')
    if depth_op.INTERPRET:
        pytest.skip('under the interpreter the kernels run on CPU')
    monkeypatch.setattr(depth_op, '_triton_failed', [])
    monkeypatch.setattr(depth_op, 'on_kernel', lambda tensors: False)
    on_triton = depth_op.on_triton
    monkeypatch.setattr(depth_op, 'on_triton', lambda tensors: not depth_op._triton_failed)
    got = loss_and_grads('dar-cross-block', True)
    out = capsys.readouterr().out
    assert out.count('\n') == 1 and 'depth_op: the Triton kernels failed' in out and 'torch ops' in out, out
    monkeypatch.setattr(depth_op, 'on_triton', on_triton)
    use_readable(monkeypatch)
    assert_same(got, loss_and_grads('dar-cross-block', True))

def dar_write_as_written(P, y, beta, rho):
    """The partials after DAR.write's lines (DepthState.use_op = False) write y into P."""
    res = model_module.DAR(GPTConfig(n_layer=2, n_head=1, n_embd=y.size(-1), residual='dar', depth_block=4))
    s = model_module.DepthState(y, 2, True, 4)
    s.use_op, s.P, s.beta, s.rho = False, P, [beta], [rho]
    return res.write(s, 0, y).P # l = 0 of a block of 4: no commit

def write_and_definition(P, y, beta, rho, d):
    """depth_op.write's partials and gradients (of P, y, beta and rho, from d) beside
    DAR.write's lines', as pairs."""
    inputs = (P or []) + [y, beta] + ([rho] if P else [])
    outs = []
    for write in (depth_op.write, dar_write_as_written):
        new = write(P, y, beta, rho)
        outs.append(torch.utils._pytree.tree_leaves((new, torch.autograd.grad(new, inputs, d))))
    return zip(*outs)

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('partial', [False, True])
def test_dar_write_operation_equals_its_definition(dtype, partial):
    """depth_op.write (depth_op.cpp's fp32 and fp64 kernels) against DAR.write's lines: the partials,
    and the gradients of the partials, y, beta and rho, with a block's first write (no partials)."""
    assert depth_op.library() is not None, "depth_op.cpp did not build"
    g = torch.Generator().manual_seed(0)
    leaf = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    P, y, beta, rho = [leaf(2, 5, 8), leaf(2, 5, 8)] if partial else None, leaf(2, 5, 8), leaf(2, 8), leaf(())
    d = [torch.randn(2, 5, 8, generator=g, dtype=dtype) for _ in range(2)]
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for got, want in write_and_definition(P, y, beta, rho, d):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)

def test_recorded_terms_make_dar_writes_partials():
    """depth_op.recorded, write by write, keeps the terms of DAR.write's partials: P^j = sum_i
    c^j_i y_i, each coefficient mixed by every later write's rho; and depth_op.terms regroups the
    terms of blocks of 1 and 2 into the (y_a, c_a, y_b, c_b) the kernels make entries from."""
    g = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)
    P, made = None, None
    for n in range(1, 4):
        y, beta, rho = draw(2, 5, 8) - 0.5, 2 * draw(2, 8), draw(())
        P, made = dar_write_as_written(P, y, beta, rho), depth_op.recorded(made, y, beta, rho)
        ys, cs = made
        for j in range(2):
            torch.testing.assert_close(sum(cs[2 * i + j] * y_i for i, y_i in enumerate(ys)), P[j], rtol=1e-12, atol=1e-12)
        if n <= 2:
            made_again = [depth_op.make(*t) for t in depth_op.terms(*depth_op.recipe([made]))[0]]
            torch.testing.assert_close(made_again, P, rtol=1e-12, atol=1e-12)
    with torch.no_grad(): # no backward: nothing to make again
        assert depth_op.recorded(made, y, beta, rho) is None

def test_depth_op_keeps_only_weights_scores_and_rms_for_backward():
    """A read's backward keeps its candidates, or the outputs y they are made from again (the writes
    keep them anyway), and besides them only (J, R, B, T) and (S, R, B, T) tensors: no (B, T, C)
    temporary, none for the gates' gradients. K = 2 and 4: candidates made again, and kept."""
    for K in (2, 4):
        check_read_saves(make('dar-cross-block', depth_block=K))

def check_read_saves(model):
    model.train()
    e = torch.randn(2, 16, 32, requires_grad=True)
    s = model.transformer.res.begin(e)
    for l in range(3):
        x = model.transformer.res.read(s, l)
        s = model.transformer.res.write(s, l, x * 1.0)
    ys = [y for made in s.op.made if made is not None for y in made[0]]
    candidates = {t.untyped_storage().data_ptr() for t in [t for H in s.H for t in H] + s.P + ys}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model.transformer.res.read(s, 3)
    big = [t for t in saved if t.numel() >= 16 * 32 and t.untyped_storage().data_ptr() not in candidates]
    assert big == [] and len(saved) > 0

def test_eager_backward_adds_into_one_handle_gradient_per_stream(monkeypatch):
    """Eager, every read's backward adds into the handle gradient it receives: one buffer per
    stream for the whole backward (not a new one per read: 2-3% of the step, docs/bench.md), the
    gradients unchanged (the fp64 tests above)."""
    model = make('dar-cross-block')
    model.train()
    storages, read_backward = set(), depth_op.read_backward
    def recorded(*args, **kwargs):
        out = read_backward(*args, **kwargs)
        storages.update(t.untyped_storage().data_ptr() for t in out[3]) # gS, per stream
        return out
    monkeypatch.setattr(depth_op, 'read_backward', recorded)
    _, loss = model(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16)))
    loss.backward()
    assert len(storages) == 2

def test_a_failed_build_of_depth_op_runs_torch_ops_after_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(depth_op, '_lib', [])
    monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
    assert depth_op.library() is None
    out = capsys.readouterr().out
    assert out.count('\n') == 1 and 'depth_op: could not build' in out and 'torch ops' in out
    got = loss_and_grads('dar-cross-block', True) # on torch ops, since no library
    use_readable(monkeypatch)
    assert_same(got, loss_and_grads('dar-cross-block', True))

@pytest.mark.slow
def test_compiled_code_does_not_grow_with_depth(tmp_path):
    """Block DAR at 2 and 4 blocks of the same size compiles the same kernels: a fresh inductor
    cache per run, its generated C++ files counted (the standard path's do not grow either)."""
    code = ("import torch, sys; sys.path.insert(0, {root!r}); from model import GPT, GPTConfig; "
            "m = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer={n}, n_head=2, n_embd=32, bias=False, "
            "residual='dar', depth_block=4)); x = torch.randint(0, 50, (2, 16)); "
            "torch.compile(m, fullgraph=True)(x, x)[1].backward()")
    kernels = []
    for n in (4, 8):
        cache = tmp_path / f'cache{n}'
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), XDG_CACHE_HOME=str(tmp_path / 'xdg'))
        subprocess.run([sys.executable, '-c', code.format(root=ROOT, n=n)], check=True, env=env, capture_output=True)
        kernels.append(len(glob.glob(str(cache / '**' / '*.cpp'), recursive=True)))
    assert kernels[0] == kernels[1] > 0, kernels

@pytest.mark.slow
def test_block_dar_with_moe_compiles_and_trains_in_bf16():
    """Block DAR + MoE under bf16 autocast, compiled by inductor (the path of config/paper_7b_moe.py):
    it trains, and its first loss is the eager bf16 loss."""
    model = make('dar-cross-block+moe')
    model.train()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, want = model(idx, idx)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            _, loss = compiled(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses[0]), want.detach().float(), atol=2e-2, rtol=2e-2)
    assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]

@pytest.mark.parametrize('compiled', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_block_dar_saves_at_most_1_2x_the_standard_residuals_tensors(compiled):
    """What a training forward saves for backward, at the train.py default model (bench.py's; K =
    2): DAR's partials and entries are made again in backward from their writes, not kept.
    Compiled: partitioned into forward and backward as inductor does it, with no recompute."""
    idx = torch.randint(0, 65, (12, 64), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    mb = {}
    for name in ('standard', 'dar-block'):
        torch.manual_seed(0)
        model = GPT(bench.model_config(bench.DEFAULTS, name))
        forward = torch.compile(model, fullgraph=True, backend='aot_eager_decomp_partition') if compiled else model
        mb[name] = bench.saved_mb(model, lambda: forward(idx, idx))
    assert mb['dar-block'] <= 1.2 * mb['standard'], mb

@pytest.mark.parametrize('name', PATHS)
def test_loss_at_init_is_about_ln_vocab(name):
    torch.manual_seed(0)
    model = GPT(tiny(**PATHS[name]))
    idx, targets = torch.randint(0, 50, (2, 8, 16))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(50)) < 0.1

@pytest.mark.slow
@pytest.mark.parametrize('name', ['standard', 'attnres-block', 'mhc', 'dar-cross-block', 'dar-cross-block+moe'])
def test_compiled_forward_equals_eager(name):
    try:
        import torch._inductor # noqa: F401
    except ImportError as e:
        pytest.skip(f"torch.compile is unavailable here: {e}")
    model = make(name, n_layer=2)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(idx, idx)[0], full_logits(model, idx), atol=1e-5, rtol=1e-5)

# the fp32 MoE's per-expert loop breaks the graph (bf16 is one graph: test_moe_is_one_graph_under_bf16)
ONE_GRAPH = [(n, p, d) for n in PATHS for d in (('bfloat16',) if '+moe' in n else ('float32', 'bfloat16'))
             for p in ((True, False) if PATHS[n].get('residual') in ('attnres', 'dar') and '+moe' not in n else (True,))]

@pytest.mark.slow
@pytest.mark.parametrize('name, include_partial, dtype', ONE_GRAPH)
def test_training_step_is_one_graph_without_recompiles(name, include_partial, dtype):
    """fullgraph=True fails on any graph break; error_on_recompile on any recompilation. The
    aot_eager backend traces forward and backward as torch.compile does, without generating code."""
    model = make(name, include_partial=include_partial)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    ctx = torch.autocast('cpu', dtype=torch.bfloat16) if dtype == 'bfloat16' else contextlib.nullcontext()
    g = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            idx = torch.randint(0, 50, (2, 16), generator=g)
            with ctx:
                _, loss = compiled(idx, idx)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert torch.isfinite(loss)

@pytest.mark.slow
@pytest.mark.parametrize('name', ['dar-cross-block', 'attnres-full'])
def test_compiled_training_step_equals_eager(name):
    """Inductor's code for forward and backward gives the eager loss and gradients."""
    model = make(name, n_layer=2)
    model.train()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(6))
    _, loss = model(idx, idx)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, compiled_loss = torch.compile(model, fullgraph=True)(idx, idx)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4, msg=n)

def test_residual_parameter_names_and_shapes_are_the_checkpoints():
    """Checkpoints name the residual paths' parameters: these names and shapes must not change.
    tiny(): L = 6 sublayers, C = 32; rows L + 1 include the final read."""
    want = {
        'standard': {},
        'attnres-block': dict(query=(7, 32), key_norm=(7, 32)),
        'mhc': dict(proj=(6, 64, 8), scale=(6, 3), b_pre=(6, 2), b_post=(6, 2), B_res=(6, 2, 2),
                    out_proj=(64, 2), out_scale=(1,), out_bias=(2,)),
        'dar-cross-full': dict(query=(7, 2, 32), key_norm=(7, 32), alpha_logit=(7,), beta_logit=(6, 2, 32)),
        'dar-cross-block': dict(query=(7, 2, 32), key_norm=(7, 32), alpha_logit=(7,), beta_logit=(6, 2, 32), rho_logit=(6,)),
        'dar-sepv-block': dict(query=(7, 2, 32), key_norm=(7, 32), alpha_logit=(7,), beta_logit=(6, 2, 32), rho_logit=(6,),
                               value_proj=(7, 2, 32, 32)),
    }
    for name, params in want.items():
        got = {n: tuple(p.shape) for n, p in GPT(tiny(**PATHS[name])).transformer.res.named_parameters()}
        assert got == params, name

def test_old_two_phase_checkpoints_load():
    """two_phase was a speed option with the same result; checkpoints that record it still load."""
    model = make('dar-cross-block')
    checkpoint = dict(model_args=dict(vars(model.config), two_phase=True), model=model.state_dict())
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(full_logits(GPT.from_checkpoint(checkpoint).eval(), idx), full_logits(model, idx))

# -----------------------------------------------------------------------------
# facts of each path

def test_config_errors_are_one_line():
    for kw, msg in [(dict(depth_block=0, residual='dar'), 'depth_block=0 must be >= 1'),
                    (dict(dar_routing='self'), 'dar_routing=self needs residual=dar'),
                    (dict(depth_block=2), 'depth_block=2 needs residual=attnres or dar'),
                    (dict(residual='dar', depth_block=7), 'depth_block=7 exceeds'),
                    (dict(residual='resnet'), 'residual=resnet is not one of'),
                    (dict(n_head=0), 'n_embd=32 is not a multiple of n_head=0')]:
        with pytest.raises(ValueError, match=msg):
            tiny(**kw)

@pytest.mark.parametrize('routing', ['cross', 'self', 'crossv', 'fixed'])
def test_dar_read_is_its_reads_fused(routing):
    """DAR.read's one call equals DAR.fuse of DAR.reads (the two targets apart), at every sublayer
    and the final read, values and gradients, with trained-like (random) gates and queries."""
    torch.manual_seed(0)
    model = GPT(tiny(residual='dar', dar_routing=routing, depth_block=2)).double()
    res = model.transformer.res
    with torch.no_grad():
        for p in (res.query, res.key_norm, res.alpha_logit, res.beta_logit):
            p.normal_(0, 0.5)
    e = torch.randn(2, 8, 32, dtype=torch.float64)
    outs = []
    for read in (res.read, lambda s, l: res.fuse(s, l, *res.reads(s, l))):
        s, xs = res.begin(e), []
        for l in range(res.L + 1):
            xs.append(read(s, l))
            if l < res.L:
                s = res.write(s, l, torch.tanh(xs[-1]))
        loss = sum((x * torch.randn_like(x, generator=torch.Generator().manual_seed(l))).sum() for l, x in enumerate(xs))
        outs.append((xs, torch.autograd.grad(loss, [res.query, res.key_norm, res.alpha_logit, res.beta_logit])))
    (fused_x, fused_g), (apart_x, apart_g) = outs
    for a, b in zip(fused_x + list(fused_g), apart_x + list(apart_g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)

def test_attnres_at_init_reads_a_uniform_mean():
    torch.manual_seed(0)
    for kw in (dict(), dict(depth_block=4)):
        model = GPT(tiny(residual='attnres', **kw))
        probe = analyze.Probe(model)
        probed(model, probe, torch.randint(0, 50, (2, 16)))
        assert len(probe.weights) == 2 * model.config.n_layer + 1
        for a in probe.weights:
            torch.testing.assert_close(a, torch.full_like(a, 1 / a.size(0)))

@pytest.mark.parametrize('K', [1, 2, 4, 6])
def test_attnres_at_init_equals_standard_residual(K):
    """At zero queries a read is the mean of its candidates, and the pre-norms see N x_l, their sum
    (docs/depth.md): h_{l-1} itself, at nanoGPT's init too, where a mean would be damped by eps."""
    torch.manual_seed(0)
    std = GPT(tiny(bias=True))
    ar = GPT(tiny(bias=True, residual='attnres', depth_block=K))
    ar.load_state_dict(std.state_dict(), strict=False)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(full_logits(ar, idx), full_logits(std, idx), atol=1e-5, rtol=1e-5)

NANOGPT_ARGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size', 'dropout')

@pytest.mark.parametrize('change', [dict(residual='attnres', depth_block=K) for K in (1, 2, 4, 6)] +
                         [dict(residual='dar', depth_block=K, dar_routing=r) for K in (1, 4) for r in ROUTES if r != 'fixed'])
def test_an_upcycled_standard_checkpoint_keeps_its_logits(change):
    """A trained standard model, as nanoGPT saves it, upcycled to AttnRes or DAR: the same logits to
    1e-5 (zero queries read means; DAR's b^0 = -b^1 makes the streams' mean the standard residual,
    while the streams differ). Not FixedKV, whose values are one stream's (train.py refuses it)."""
    std = one_step(GPT(tiny(bias=True)))
    checkpoint = dict(model_args={k: getattr(std.config, k) for k in NANOGPT_ARGS}, model=std.state_dict())
    up = GPT.from_checkpoint(checkpoint, **change)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(full_logits(up, idx), full_logits(std, idx), atol=1e-5, rtol=1e-5)
    if change['residual'] == 'dar': # symmetry broken: the streams' writes differ per channel
        beta = 2 * torch.sigmoid(up.transformer.res.beta_logit)
        torch.testing.assert_close(beta.sum(1), torch.full_like(beta[:, 0], 2.0))
        assert not torch.allclose(beta[:, 0], beta[:, 1])

def one_step(model, seed=0):
    torch.manual_seed(seed)
    idx = torch.randint(0, 50, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(idx, idx)[1].backward()
    opt.step()
    return model

def mhc_matrices(model, idx, monkeypatch):
    """The mixing matrices M of every sublayer of a forward, as mHC's write uses them."""
    M = []
    def recorded(logits, iters=20):
        M.append(sinkhorn(logits, iters))
        return M[-1]
    monkeypatch.setattr(model_module, 'sinkhorn', recorded)
    with torch.no_grad():
        model(idx)
    monkeypatch.undo()
    assert len(M) == 2 * model.config.n_layer
    return torch.stack(M)

@pytest.mark.parametrize('n, tol', [(2, 1e-5), (3, 1e-3)])
def test_mhc_matrices_are_doubly_stochastic(n, tol, monkeypatch):
    """n = 2 (closed-form limit) to 1e-5; n = 3 runs the 20 iterations of the paper, which at
    the near-identity init stop about 1e-4 short of doubly stochastic (see sinkhorn)."""
    torch.manual_seed(0)
    model = GPT(tiny(residual='mhc', mhc_streams=n))
    idx = torch.randint(0, 50, (4, 16))
    for step in range(2):
        M = mhc_matrices(model, idx, monkeypatch)
        torch.testing.assert_close(M.sum(-1), torch.ones_like(M[..., 0]), atol=tol, rtol=0)
        torch.testing.assert_close(M.sum(-2), torch.ones_like(M[..., 0]), atol=1e-6, rtol=0)
        assert (M >= 0).all()
        one_step(model)

def test_sinkhorn_closed_form_is_the_iteration_limit():
    Z = torch.randn(100, 2, 2, dtype=torch.float64)
    Z[50:] = 0.5 * Z[50:] + 6 * torch.eye(2, dtype=torch.float64) - 3 # near the mHC init
    torch.testing.assert_close(sinkhorn(Z).double(), naive_sinkhorn(Z, iters=5000), atol=1e-6, rtol=0)


def test_dar_streams_differ_after_a_step_and_routing_matters():
    torch.manual_seed(0)
    model = one_step(GPT(tiny(residual='dar', depth_block=2)))
    self_kv = GPT(tiny(residual='dar', depth_block=2, dar_routing='self'))
    self_kv.load_state_dict(model.state_dict())
    idx = torch.randint(0, 50, (2, 16))
    cross, own = analyze.Probe(model), analyze.Probe(self_kv)
    with torch.no_grad():
        probed(model, cross, idx)
        probed(self_kv, own, idx)
    for h0, h1 in zip(*cross.histories()):
        if h0 is not cross.histories()[0][0]: # the embedding entry is shared
            assert not torch.allclose(h0, h1)
    # the first read has one candidate; every later one must differ between the routings
    assert all(not torch.allclose(a, b) for a, b in zip(cross.weights[2:], own.weights[2:]))

def test_dar_without_symmetry_breaking_keeps_the_streams_identical():
    """Why beta^1 gets a random init: with equal gates the two streams never separate."""
    torch.manual_seed(0)
    model = GPT(tiny(residual='dar', depth_block=2))
    with torch.no_grad():
        model.transformer.res.beta_logit.zero_()
    one_step(model)
    probe = analyze.Probe(model)
    probed(model, probe, torch.randint(0, 50, (2, 16)))
    for h0, h1 in zip(*probe.histories()):
        torch.testing.assert_close(h0, h1)

def test_dar_fixed_routing_uses_stream0_keys_and_stream1_values_for_both_targets():
    """With equal queries, FixedKV's two targets read the same thing (stream-0 keys, stream-1
    values), so the fusion alpha cannot matter; with cross routing it does."""
    idx = torch.randint(0, 50, (2, 16))
    for routing, same in (('fixed', True), ('cross', False)):
        model = make(f'dar-{routing}-block')
        with torch.no_grad():
            model.transformer.res.query[:, 1] = model.transformer.res.query[:, 0]
            model.transformer.res.alpha_logit.fill_(30.0) # only target 0's read
            only0 = full_logits(model, idx)
            model.transformer.res.alpha_logit.fill_(-30.0) # only target 1's read
            only1 = full_logits(model, idx)
        assert torch.allclose(only0, only1, atol=1e-6) == same

def probed(model, probe, *args):
    """model(*args) with analyze.py's probe attached to its residual path."""
    with probe:
        return model(*args)

def ablated(model, j, donor=None):
    """analyze.py's probe that replaces stream j's read by its batch mean, or by the donor's read."""
    return analyze.Probe(model, {j: donor})

def test_dar_ablating_a_stream_changes_the_loss():
    model = make('dar-cross-block')
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        clean = model(idx, idx)[1]
        assert probed(model, ablated(model, 0), idx, idx)[1] != clean
        assert probed(model, ablated(model, 1), idx, idx)[1] != clean
    with pytest.raises(ValueError, match='multi-stream'):
        ablated(make('standard'), 0)

@pytest.mark.parametrize('name', ['dar-cross-block', 'dar-self-full', 'dar-sepv-block'])
def test_dar_rescue_reads_the_donor_stream(name):
    """Rescuing stream j from k replaces h^j by h^k at every read, so x = h^k: the same as alpha
    saturated towards target k."""
    model = make(name)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        rescued = [probed(model, ablated(model, j, donor=1 - j), idx, idx)[0] for j in (0, 1)]
        for j, sign in ((0, -1.0), (1, 1.0)): # donor 1: alpha -> 0; donor 0: alpha -> 1
            model.transformer.res.alpha_logit.fill_(sign * 30.0)
            assert torch.allclose(rescued[j], full_logits(model, idx), atol=1e-5)
    with pytest.raises(ValueError, match='donor=0 must be a stream that is not ablated'):
        ablated(model, 0, donor=0)

@pytest.mark.parametrize('name', ['dar-cross-block', 'mhc'])
def test_ablation_replaces_a_read_by_its_batch_mean(name):
    """A mean ablation: for a batch of one repeated sequence the batch mean is the read itself."""
    model = make(name)
    same = torch.randint(0, 50, (1, 16)).repeat(3, 1)
    mixed = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        for j in (0, 1):
            assert torch.allclose(probed(model, ablated(model, j), same, same)[0], full_logits(model, same), atol=1e-5)
            assert not torch.allclose(probed(model, ablated(model, j), mixed, mixed)[0], full_logits(model, mixed), atol=1e-4)

@pytest.mark.parametrize('name', ['dar-cross-block', 'mhc'])
def test_the_probe_takes_every_read_the_final_one_too(name):
    """An ablation acts on every read, the final one included, for mHC as for DAR: ablating stream
    0 in the final read alone changes the logits; every read's weights are recorded."""
    model = make(name)
    idx = torch.randint(0, 50, (3, 16))
    class FinalOnly(analyze.Probe): # the ablation at the final read only
        def __call__(self, l, s, h, weights):
            self.ablate = {0: None} if l == self.L else {}
            return super().__call__(l, s, h, weights)
    probe = FinalOnly(model, {0: None})
    with torch.no_grad():
        assert not torch.allclose(probed(model, probe, idx, idx)[0], full_logits(model, idx), atol=1e-5)
    assert len(probe.weights) == 2 * model.config.n_layer + 1

def test_mhc_rescue_reads_the_donor_stream():
    """Stream j read as stream k: a model whose streams are equal reads as if clean."""
    model = make('mhc')
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        clean, _ = model(idx, idx)
        mean, _ = probed(model, ablated(model, 0), idx, idx)
        rescued, _ = probed(model, ablated(model, 0, donor=1), idx, idx)
        assert not torch.allclose(rescued, clean) and not torch.allclose(rescued, mean)
        res = model.transformer.res # streams stay equal: M mixes equal rows, post writes the same to both
        res.proj[:, :, 2:].zero_()
        res.b_post.zero_()
        res.B_res.zero_()
        clean, _ = model(idx, idx)
        assert torch.allclose(probed(model, ablated(model, 0, donor=1), idx, idx)[0], clean, atol=1e-5)
        assert torch.allclose(probed(model, ablated(model, 1, donor=0), idx, idx)[0], clean, atol=1e-5)

# -----------------------------------------------------------------------------
# train.py, sample.py, prepare_data.py

def test_get_lr_schedule():
    cfg = dict(train.DEFAULTS, learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, max_iters=100, lr_decay_iters=0)
    assert train.get_lr(0, cfg) > 0
    assert train.get_lr(9, cfg) < 1e-3
    assert train.get_lr(10, cfg) == pytest.approx(1e-3)
    assert train.get_lr(100, cfg) == pytest.approx(1e-4)
    assert train.get_lr(500, cfg) == pytest.approx(1e-4)
    assert train.get_lr(55, dict(cfg, decay_lr=False)) == 1e-3

def run(args, cwd, env=None, check=True, module='train.py'):
    cmd = [sys.executable, os.path.join(ROOT, module)] + args
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return p

@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A small char dataset made by prepare_data.py from a generated text (no ../shared needed)."""
    d = tmp_path_factory.mktemp('work')
    rng = np.random.default_rng(0)
    words = ['the', 'king', 'queen', 'of', 'and', 'my', 'lord', 'shall', 'be', 'not', 'to', 'is']
    lines = [' '.join(rng.choice(words, size=8)).capitalize() + '.' for _ in range(3000)]
    (d / 'input.txt').write_text('\n'.join(lines) + '\n')
    run(['--input=input.txt'], d, module='prepare_data.py')
    return d

SMALL = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
         '--eval_iters=2', '--log_interval=1', '--warmup_iters=2', '--lr_decay_iters=12', '--device=cpu', '--compile=False']

def losses(stdout):
    return [line.split(',')[0] for line in stdout.splitlines() if line.startswith('iter ')]

@pytest.mark.slow
def test_compile_default_is_off_on_cpu_and_a_compiled_run_evals_through_its_training_graph(workdir):
    """compile=None compiles on CUDA only: on CPU, with the depth reads as one operation, every path
    ran faster eager end to end (docs/bench.md). A compiled run evaluates through its training
    graph: its evals, before and after a step, compile nothing more, and its first eval equals the
    eager run's."""
    auto = [a for a in SMALL if a != '--compile=False'] + ['--max_iters=2', '--eval_interval=2', '--out_dir=auto', '--overwrite=True']
    for extra in ([], ['--residual=standard']):
        p = run(auto + extra, workdir)
        assert 'compiling the model' not in p.stdout and 'done: 2 iterations' in p.stdout, extra
    p = run(auto + ['--compile=True'], workdir, env=dict(os.environ, TORCH_LOGS='recompiles'))
    assert 'compiling the model' in p.stdout and 'done: 2 iterations' in p.stdout
    assert 'Recompiling' not in p.stderr, p.stderr
    eager = run(auto + ['--compile=False'], workdir)
    first_eval = [line for line in eager.stdout.splitlines() if line.startswith('step 0:')]
    assert first_eval and first_eval[0] in p.stdout.splitlines()

@pytest.mark.slow
def test_resume_equals_uninterrupted_run(workdir):
    args = SMALL + ['--dropout=0.1', '--eval_interval=100']
    full = run(args + ['--out_dir=full', '--max_iters=12'], workdir)
    run(args + ['--out_dir=part', '--max_iters=6'], workdir)
    resumed = run(args + ['--out_dir=part', '--max_iters=12', '--init_from=resume'], workdir)
    assert losses(resumed.stdout) == losses(full.stdout)[6:]
    a = torch.load(workdir / 'full' / 'ckpt.pt', weights_only=True)
    b = torch.load(workdir / 'part' / 'ckpt.pt', weights_only=True)
    assert a['iter_num'] == b['iter_num'] == 12
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]), k

@pytest.mark.slow
def test_resume_with_another_path_fails_clearly(workdir):
    run(SMALL + ['--out_dir=path', '--max_iters=2'], workdir)
    p = run(SMALL + ['--out_dir=path', '--max_iters=4', '--init_from=resume', '--residual=attnres'], workdir, check=False)
    assert p.returncode != 0
    assert p.stderr.strip() == f"error: {os.path.join('path', 'ckpt.pt')} was trained with residual='dar'; it cannot resume as residual='attnres'"

def torchrun(args, workdir, env, hang_s=180):
    """train.py under torchrun, 2 processes. A hang (the runs take seconds) is reported with every
    process's Python stacks (faulthandler, on SIGABRT) and run once more: a second hang fails."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           os.path.join(ROOT, 'train.py')] + args
    env = dict(env, PYTHONFAULTHANDLER='1')
    for attempt in range(2):
        p = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, start_new_session=True)
        try:
            out, err = p.communicate(timeout=hang_s)
            return subprocess.CompletedProcess(cmd, p.returncode, out, err)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, subprocess.signal.SIGABRT) # each Python process prints its stacks
            out, err = p.communicate()
            report = f"torchrun hung for {hang_s} s (attempt {attempt + 1}); stdout:\n{out}\nstacks:\n{err[-20000:]}"
            if attempt == 1:
                raise AssertionError(report)
            warnings.warn(report)

DDP_PATHS = {'dar-block': [], 'attnres-block': ['--residual=attnres'], 'mhc': ['--residual=mhc', '--depth_block=1'],
             'standard+moe': ['--residual=standard', '--depth_block=1', '--n_expert=4', '--expert_hidden=32']}

@pytest.mark.slow
@pytest.mark.parametrize('path', DDP_PATHS)
def test_ddp_two_processes_equal_one(workdir, path):
    args = SMALL + ['--gradient_accumulation_steps=2', '--max_iters=5', '--eval_interval=100', '--overwrite=True'] + DDP_PATHS[path]
    one = run(args + ['--out_dir=ddp1'], workdir)
    two = torchrun(args + ['--out_dir=ddp2'], workdir, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert two.returncode == 0, two.stderr
    l1 = [float(x.split()[-1]) for x in losses(one.stdout)]
    l2 = [float(x.split()[-1]) for x in losses(two.stdout)]
    assert len(l1) == len(l2) == 5
    assert l1 == pytest.approx(l2, abs=2e-4)
    a = torch.load(workdir / 'ddp1' / 'ckpt.pt', weights_only=True)['model']
    b = torch.load(workdir / 'ddp2' / 'ckpt.pt', weights_only=True)['model']
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)

@pytest.mark.slow
def test_unknown_key_fails_with_one_line(workdir):
    p = run(['--n_layers=2'], workdir, check=False)
    assert p.returncode != 0
    assert p.stderr.strip() == "error: unknown config key 'n_layers' (from --n_layers=2); did you mean 'n_layer'?"
    p = run(['--n_layer=two'], workdir, check=False)
    assert p.returncode != 0 and p.stderr.strip().count('\n') == 0 and 'should be of type int' in p.stderr

@pytest.mark.slow
@pytest.mark.parametrize('residual', ['standard', 'mhc'])
def test_every_path_runs_with_only_its_residual_flag(workdir, residual):
    """The default depth_block=2 is Block DAR's, and a preset file's is the depth paths'; neither
    blocks a path without depth blocks, but asking for it on the command line is still an error."""
    run(SMALL + [f'--residual={residual}', f'--out_dir=only-{residual}', '--max_iters=1'], workdir)
    (workdir / 'preset.py').write_text('depth_block = 4\n')
    run(SMALL + ['preset.py', f'--residual={residual}', f'--out_dir=only-{residual}-preset', '--max_iters=1'], workdir)
    p = run(SMALL + [f'--residual={residual}', '--depth_block=2', f'--out_dir=only-{residual}-K'], workdir, check=False)
    assert p.returncode == 1 and last_line(p.stderr) == f'error: depth_block=2 needs residual=attnres or dar'

@pytest.mark.slow
def test_train_and_sample_smoke(workdir):
    run(SMALL + ['--out_dir=smoke', '--max_iters=3'], workdir)
    assert (workdir / 'smoke' / 'ckpt.pt').exists()
    p = run(['--out_dir=smoke', '--num_samples=1', '--max_new_tokens=30', '--start=The king'], workdir, module='sample.py')
    text = p.stdout.split('Loading meta')[1].splitlines()[1]
    assert text.startswith('The king') and len(text) > len('The king')

def test_prepare_counts_on_shared_text(tmp_path):
    text = os.path.join(SHARED, 'data', 'tinyshakespeare', 'input.txt')
    if not os.path.exists(text):
        pytest.skip(f"{text} is absent: the token counts need the shared tiny Shakespeare copy")
    run([f'--input={text}'], tmp_path, module='prepare_data.py')
    run(['shakespeare', f'--input={text}', f"--gpt2_dir={os.path.join(SHARED, 'data', 'gpt2')}"], tmp_path, module='prepare_data.py')
    sizes = {p: os.path.getsize(tmp_path / 'data' / p) // 2 for p in
             ('shakespeare_char/train.bin', 'shakespeare_char/val.bin', 'shakespeare/train.bin', 'shakespeare/val.bin')}
    assert sizes == {'shakespeare_char/train.bin': 1003854, 'shakespeare_char/val.bin': 111540,
                     'shakespeare/train.bin': 301966, 'shakespeare/val.bin': 36059}
    with open(tmp_path / 'data' / 'shakespeare_char' / 'meta.pkl', 'rb') as f:
        assert pickle.load(f)['vocab_size'] == 65

def test_bpe_of_a_text_in_pieces_is_the_bpe_of_the_whole(monkeypatch):
    """prepare_data cuts a large text into pieces only where GPT-2's BPE never merges across: a
    cut after '\n\n' would end a piece in one '\n\n' token, where the whole text has two '\n'."""
    gpt2 = os.path.join(SHARED, 'data', 'gpt2')
    if not os.path.exists(gpt2):
        pytest.skip(f"{gpt2} is absent: BPE needs the shared GPT-2 vocabulary offline")
    import prepare_data
    monkeypatch.setattr(prepare_data, 'CHUNK', 20) # a cut every line or two
    rng = np.random.default_rng(0)
    text = ''.join(rng.choice(['the king', 'of my lord', ' shall', '\n', '\n\n', '\n \n', 'Be it.']) for _ in range(3000))
    enc = prepare_data.gpt2_encoding(gpt2)
    assert len(list(prepare_data.pieces(text))) > 50
    assert prepare_data.prepare_bpe(text, enc) == enc.encode_ordinary(text)

# -----------------------------------------------------------------------------
# mixture of experts

def test_moe_with_one_expert_equals_the_dense_mlp():
    torch.manual_seed(0)
    cfg = tiny(bias=True, n_expert=1, n_expert_active=1)
    mlp, moe = MLP(cfg), MoE(cfg)
    with torch.no_grad():
        moe.c_fc[0] = mlp.c_fc.weight.t()
        moe.b_fc[0] = mlp.c_fc.bias.normal_()
        moe.c_proj[0] = mlp.c_proj.weight.t()
        moe.b_proj[0] = mlp.c_proj.bias.normal_()
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(moe(x), mlp(x), atol=1e-5, rtol=1e-5)

def naive_moe(moe, x):
    """One token at a time: softmax by exp / sum, top-k, renormalised gates, experts one by one."""
    out = torch.zeros_like(x)
    k = moe.k
    for b in range(x.size(0)):
        for t in range(x.size(1)):
            v = x[b, t]
            logits = moe.router.weight @ v
            ex = torch.exp(logits - logits.max())
            p = ex / ex.sum()
            top = sorted(range(len(p)), key=lambda e: -p[e].item())[:k]
            total = sum(p[e] for e in top)
            for e in top:
                h = v @ moe.c_fc[e] + (moe.b_fc[e] if moe.b_fc is not None else 0)
                h = F.gelu(h) @ moe.c_proj[e] + (moe.b_proj[e] if moe.b_proj is not None else 0)
                out[b, t] += p[e] / total * h
            if moe.shared is not None:
                out[b, t] += moe.shared(v)
    return out

def random_moe():
    """An MoE with biases and perturbed weights, and an input for it."""
    torch.manual_seed(0)
    moe = MoE(tiny(bias=True, **MOE))
    with torch.no_grad():
        for p in moe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return moe, torch.randn(2, 8, 32)

def test_moe_matches_naive_per_token_reference():
    moe, x = random_moe()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), naive_moe(moe, x), atol=1e-5, rtol=1e-5)

def test_moe_grouped_mm_in_bf16_matches_naive_reference():
    """Under bf16 autocast the experts run as one grouped matmul: the fp32 per-token reference
    within bf16 rounding."""
    moe, x = random_moe()
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        got = moe(x)
    torch.testing.assert_close(got.float(), naive_moe(moe, x), atol=2e-2, rtol=2e-2)

@pytest.mark.slow
def test_moe_compiled_bf16_equals_eager_bf16():
    moe, x = random_moe()
    x.requires_grad_(True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        want = moe(x)
        got = torch.compile(moe, fullgraph=True)(x)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    g = torch.randn_like(want, dtype=torch.float)
    (want_grad,) = torch.autograd.grad((want.float() * g).sum(), x)
    (got_grad,) = torch.autograd.grad((got.float() * g).sum(), x)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-2, rtol=1e-2)

@pytest.mark.slow
@pytest.mark.parametrize('name', ['standard+moe', 'dar-cross-block+moe'])
def test_moe_is_one_graph_under_bf16(name):
    model = make(name)
    idx = torch.randint(0, 50, (2, 16))
    torch._dynamo.reset()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert torch._dynamo.explain(model)(idx, idx).graph_break_count == 0

def test_moe_token_output_does_not_depend_on_the_batch():
    torch.manual_seed(0)
    moe = MoE(tiny(**MOE))
    with torch.no_grad():
        moe.router.weight.normal_() # decisive routing: each token picks different experts
    x = torch.randn(4, 16, 32)
    with torch.no_grad():
        batched = moe(x)
        for b in range(4):
            torch.testing.assert_close(moe(x[b:b + 1, 3:4]), batched[b:b + 1, 3:4], atol=1e-6, rtol=1e-6)

def test_moe_top_1_gate_is_the_router_probability():
    """Top-1 (Switch): the gate is p_i, not p_i / p_i = 1, so the LM loss trains the router."""
    torch.manual_seed(0)
    moe = MoE(tiny(n_expert=4, n_expert_active=1))
    x = torch.randn(2, 8, 32)
    moe(x).pow(2).sum().backward()
    assert moe.router.weight.grad.abs().max() > 1e-4

@pytest.mark.parametrize('silenced', ['routed', 'shared'])
def test_moe_drops_out_each_experts_output_once(silenced):
    """With dropout p a kept output is scaled by 1/(1-p) once, by the routed and the shared experts
    alike (dropout twice would scale the kept ones by 1/(1-p)^2)."""
    torch.manual_seed(0)
    moe = MoE(tiny(**MOE, dropout=0.5))
    with torch.no_grad(): # one kind of expert silenced, so the other's scale shows
        (moe.c_proj if silenced == 'routed' else moe.shared.c_proj.weight).zero_()
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        want = moe.eval()(x)
        got = moe.train()(x)
    kept = got != 0
    assert 0.3 < kept.float().mean() < 0.7 and (want != 0).all()
    torch.testing.assert_close(got[kept], 2 * want[kept])

def test_moe_balance_loss_formula():
    torch.manual_seed(0)
    cfg = tiny(n_expert=4, n_expert_active=1)
    moe = MoE(cfg)
    x = torch.randn(1, 8, 32)
    with torch.no_grad():
        # hand-built routing: the router reads one input channel per expert
        moe.router.weight.zero_()
        for e in range(4):
            moe.router.weight[e, e] = 10.0
        x[..., :4] = 0
        for t, e in enumerate([0, 0, 0, 1, 1, 2, 3, 3]):
            x[0, t, e] = 1.0
        moe(x)
        stats = moe.stats
        probs = F.softmax(x[0, :, :4] * 10, -1)
        f = torch.tensor([3, 2, 1, 2]) / 8
        torch.testing.assert_close(stats['balance'], 4 * (f * probs.mean(0)).sum())
        torch.testing.assert_close(stats['z'], torch.logsumexp(x[0, :, :4] * 10, -1).pow(2).mean())
        # perfectly uniform routing: the loss is exactly 1
        moe.router.weight.zero_()
        cfg2 = tiny(n_expert=4, n_expert_active=4)
        uniform = MoE(cfg2)
        uniform.router.weight.zero_()
        uniform(x)
        torch.testing.assert_close(uniform.stats['balance'], torch.tensor(1.0))

@pytest.mark.parametrize('name', [n for n in PATHS if n.endswith('+moe')])
def test_moe_gradient_reaches_router_and_selected_experts(name):
    model = make(name)
    idx = torch.randint(0, 50, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    load = model.moe_stats['load'] # (n_moe_layers, E)
    for block, layer_load in zip(model.transformer.h, load):
        moe = block.mlp
        assert moe.router.weight.grad.abs().sum() > 0
        for e, f in enumerate(layer_load):
            assert (moe.c_fc.grad[e].abs().sum() > 0) == (f > 0), f"expert {e} with load {f}"

def test_moe_active_parameter_count():
    model = GPT(tiny(n_expert=4, n_expert_active=1, expert_hidden=24))
    per_expert = 2 * 32 * 24
    assert model.get_num_params() - model.get_num_params(active=True) == 3 * per_expert * 3

# -----------------------------------------------------------------------------
# analyze.py

def test_cka_properties():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2000, 16, generator=g, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
    assert analyze.cka(X, X) == pytest.approx(1.0)
    assert analyze.cka(X, X @ Q) == pytest.approx(1.0) # invariant to an orthogonal transform
    assert analyze.cka(X, 3.7 * X + 1.0) == pytest.approx(1.0) # and to isotropic scaling (and shifts)
    assert analyze.cka(X, torch.randn(2000, 16, generator=g, dtype=torch.float64)) < 0.02 # independent

def test_rescue_ablation_only_for_two_stream_paths():
    idx = torch.randint(0, 50, (2, 2, 16))
    batches = [(idx[0], idx[1])]
    for name in ('dar-cross-block', 'mhc'):
        r = analyze.rescue(make(name), batches)
        assert r['ablate'][0] != r['clean'] and r['ablate'][1] != r['clean'] and r['ablate_all'] != r['clean']
        assert r['rescue'][0][0] is None and r['gain'][0][1] == pytest.approx(r['ablate'][0] - r['rescue'][0][1])
        assert r['recovered'][1][0] == pytest.approx(r['gain'][1][0] / (r['ablate'][1] - r['clean']))
    with pytest.raises(ValueError, match='the rescue analysis needs two streams'):
        analyze.rescue(make('standard'), batches)

@pytest.mark.slow
@pytest.mark.parametrize('residual', ['dar', 'standard'])
def test_analyze_runs_on_a_tiny_checkpoint(workdir, residual):
    out = f'an-{residual}'
    run(SMALL + [f'--out_dir={out}', '--max_iters=2', f'--residual={residual}',
                 '--depth_block=' + ('2' if residual == 'dar' else '1')], workdir)
    run(SMALL + [f'--out_dir={out}-2', '--max_iters=2', '--seed=2', f'--residual={residual}'], workdir)
    p = run([f'--ckpt={out}/ckpt.pt,{out}*/ckpt.pt', f'--out={out}', '--batches=2', '--batch_size=2'], workdir, module='analyze.py')
    with open(workdir / out / 'analysis.json') as f:
        analysis = json.load(f)
    one, both = analysis['groups'] # the first entry alone, then the glob over both seeds
    assert [len(one['runs']), len(both['runs'])] == [1, 2] and both['label'] == f'{out}*'
    results = one['runs'][0]
    assert results['residual'] == residual and results['val_loss'] > 0
    assert both['summary']['val_loss'][0] == pytest.approx(np.mean([r['val_loss'] for r in both['runs']]))
    if residual == 'dar':
        assert len(results['depth_weights']) == 2 and len(results['cka']['paired']) == 3 # e + 2 blocks
        m = np.array(results['cka']['matrix'])
        assert results['cka']['paired_mean'] == pytest.approx(np.trace(m) / 3)
        assert results['cka']['unpaired_mean'] == pytest.approx((m.sum() - np.trace(m)) / 6)
        assert set(results['rescue']) >= {'clean', 'ablate', 'rescue', 'ablate_all', 'gain', 'recovered', 'balance'}
        plots = analysis['plots']
        try:
            import matplotlib # noqa: F401
            assert all(os.path.exists(workdir / f) for f in plots) and len(plots) == 3
        except ImportError:
            assert 'depth read weights, stream 0' in p.stdout

# -----------------------------------------------------------------------------
# sweep.py

import sweep as sweep_module

def test_sweep_puts_each_runs_seed_into_its_arguments(tmp_path, monkeypatch):
    """{seed} after '--' is the run's seed (an upcycled run starts from its own seed's checkpoint); a
    stopped run resumes from its own checkpoint, not from the one it started from."""
    cmds = []
    def fake(cmd, **kwargs):
        cmds.append(cmd)
        raise SystemExit # the command is all this test needs
    monkeypatch.setattr(sweep_module.subprocess, 'run', fake)
    for resumed in (False, True):
        if resumed:
            (tmp_path / 'standard-1338').mkdir()
            (tmp_path / 'standard-1338' / 'ckpt.pt').write_bytes(b'')
        with pytest.raises(SystemExit):
            sweep_module.run('standard', 1338, str(tmp_path), [], ['--init_from=base/standard-{seed}/ckpt.pt', '--max_iters=8'], 1)
    fresh, resumed = cmds
    assert '--init_from=base/standard-1338/ckpt.pt' in fresh and '--init_from=resume' not in fresh
    assert [a for a in resumed if a.startswith('--init_from')] == ['--init_from=resume'] and '--max_iters=8' in resumed

@pytest.mark.slow
def test_sweep_resumes_and_records_curves(workdir):
    """A finished run is read back, not repeated; a stopped one continues from its checkpoint to the
    same curve as an uninterrupted run; the table has Welch p-values once there are seeds."""
    def sweep(out, iters, seeds=1):
        return run([f'--seeds={seeds}', '--variants=standard,dar-block', f'--out={out}', '--', *SMALL,
                    f'--max_iters={iters}', '--eval_interval=2'], workdir, module='sweep.py')
    sweep('sw-full', 4, seeds=2)
    sweep('sw', 2)
    os.remove(workdir / 'sw' / 'dar-block-1337' / 'result.json') # as if stopped after its last checkpoint
    finished = (workdir / 'sw' / 'standard-1337' / 'log.txt').read_text()
    sweep('sw', 4)
    assert (workdir / 'sw' / 'standard-1337' / 'log.txt').read_text() == finished # not run again
    assert 'Resuming training' in (workdir / 'sw' / 'dar-block-1337' / 'log.txt').read_text()
    full, resumed = (json.loads((workdir / d / 'results.json').read_text()) for d in ('sw-full', 'sw'))
    assert [it for it, _ in resumed['dar-block'][0]['curve']] == [0, 2, 4]
    assert resumed['dar-block'][0]['curve'] == full['dar-block'][0]['curve']
    assert len(resumed['standard'][0]['curve']) == 2 # the finished 2-step run, read back
    table = (workdir / 'sw-full' / 'results.md').read_text().splitlines()
    dar = [l for l in table if l.startswith('| dar-block |')][0].split(' | ')
    vals = [r['val'] for r in full['dar-block']], [r['val'] for r in full['standard']]
    assert float(dar[3]) == pytest.approx(sweep_module.welch(*vals), abs=1e-3)

@pytest.mark.slow
def test_sweep_jobs_and_config_list(workdir):
    """--jobs=2 trains two runs at once to the curves of one at a time; config files given as a list
    apply in order (the second changes the depth), and each result records its n_layer."""
    (workdir / 'base.py').write_text('n_layer = 2\n')
    (workdir / 'deeper.py').write_text('n_layer = 3\n')
    def sweep(out, jobs, config):
        small = [a for a in SMALL if not a.startswith('--n_layer=')] # the config files set it
        return run([f'--jobs={jobs}', f'--config={config}', '--seeds=1', '--variants=standard,dar-block', f'--out={out}',
                    '--', *small, '--max_iters=4', '--eval_interval=2'], workdir, module='sweep.py')
    sweep('sw-serial', 1, 'base.py,deeper.py')
    sweep('sw-jobs', 2, 'base.py,deeper.py')
    serial, jobs = (json.loads((workdir / d / 'results.json').read_text()) for d in ('sw-serial', 'sw-jobs'))
    for v in ('standard', 'dar-block'):
        assert serial[v][0]['n_layer'] == jobs[v][0]['n_layer'] == 3
        assert np.allclose([l for _, l in jobs[v][0]['curve']], [l for _, l in serial[v][0]['curve']], atol=1e-4)

def write_sweep(folder, n_layer, vals, curve_steps=(0, 2, 4, 6, 8)):
    """A finished sweep's results.json: vals[variant] = final val loss per seed; each curve falls by
    0.1 per eval to it."""
    folder.mkdir()
    results = {v: [dict(seed=1337 + i, val=x, ms=1.0, n_layer=n_layer,
                        curve=[(it, x + 0.1 * (len(curve_steps) - 1 - k)) for k, it in enumerate(curve_steps)])
                   for i, x in enumerate(xs)] for v, xs in vals.items()}
    (folder / 'results.json').write_text(json.dumps(results))

def test_sweep_scan_tables_the_gap_against_depth(tmp_path, capsys):
    """--scan orders the sweeps by depth and gives each variant's difference from standard, its
    Welch p-value, the last quarter's drop and the DAR comparisons, from the sweeps' results."""
    deep = {'standard': [2.0, 2.1, 2.2], 'dar-block': [1.9, 2.0, 2.0], 'dar-self': [2.0, 2.0, 2.1]}
    shallow = {'standard': [2.0, 2.0, 2.1], 'dar-block': [2.0, 2.1, 2.1], 'dar-self': [2.1, 2.1, 2.2]}
    write_sweep(tmp_path / 'd48', 48, deep)
    write_sweep(tmp_path / 'd12', 12, shallow)
    sweep_module.scan([str(tmp_path / 'd48'), str(tmp_path / 'd12')], str(tmp_path / 'scan'))
    rows = [l.split(' | ') for l in (tmp_path / 'scan' / 'scan.md').read_text().splitlines() if l.startswith('| 12 ') or l.startswith('| 48 ')]
    assert [(r[0], r[1]) for r in rows[:6]] == [('| 12', v) for v in shallow] + [('| 48', v) for v in deep]
    dar48 = rows[4]
    assert dar48[3] == f"{100 * (np.mean(deep['dar-block']) / np.mean(deep['standard']) - 1):+.2f}%"
    assert float(dar48[4]) == pytest.approx(sweep_module.welch(deep['dar-block'], deep['standard']), abs=1e-3)
    assert dar48[5] == '0.1000 |' # eval at step 6 (>= 3/4 of 8) minus the last
    pair = [r for r in rows[6:] if r[0] == '| 48' and r[1] == 'dar-block vs dar-self'][0]
    assert float(pair[3].rstrip(' |')) == pytest.approx(sweep_module.welch(deep['dar-block'], deep['dar-self']), abs=1e-3)
    try:
        import matplotlib # noqa: F401
        assert (tmp_path / 'scan' / 'scan.png').exists()
    except ImportError:
        assert 'pip install matplotlib' in capsys.readouterr().out

def test_sweep_bad_inputs_fail_with_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / 'base.py').write_text('n_layer = 2\n')
    write_sweep(tmp_path / 'old', 12, {'dar-block': [2.0]})
    monkeypatch.chdir(tmp_path)
    cases = [(['--jobs=0'], "error: --jobs=0 is out of range: an integer from 1 to the"),
             (['--config=base.py,nope.py'], "error: --config=base.py,nope.py: no such file nope.py"),
             (['--scan=none,old'], "error: --scan: no none/results.json; run that sweep to its end first"),
             (['--scan=old'], "error: --scan: old/results.json has no standard runs with their n_layer")]
    for args, message in cases:
        monkeypatch.setattr(sys, 'argv', ['sweep.py', *args])
        with pytest.raises(SystemExit) as e:
            sweep_module.main()
        assert str(e.value.code).startswith(message), (args, e.value.code)

def test_welch_p_values():
    # two-sided Welch p-values; references from I_x(df/2, 1/2) by mpmath.betainc, an independent incomplete beta
    assert sweep_module.welch([1, 2, 3], [4, 5, 6]) == pytest.approx(0.021311641, abs=1e-6)
    assert sweep_module.welch([1, 2, 3, 4], [1.5, 2.5, 3.5, 9]) == pytest.approx(0.418219265, abs=1e-6)
    assert sweep_module.welch([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)

# -----------------------------------------------------------------------------
# bad input: one clear line and a non-zero exit; no lost work

def last_line(stderr):
    return stderr.replace('\r', '\n').strip().splitlines()[-1]

SAMPLE_CASES = [(['--temperature=0.0'], "error: temperature=0.0 is out of range: a number > 0"),
                (['--top_k=-1'], "error: top_k=-1 is out of range: an integer >= 0, or None"),
                (['--num_samples=0'], "error: num_samples=0 is out of range: an integer >= 1"),
                (['--start='], "error: --start is empty: give a prompt"),
                (['--start=Zebra {x}'], "error: the prompt has characters outside the vocabulary of")]

def bad_inputs(workdir, tmp_path, bad):
    """train.py's bad inputs and the line each must end in; bad is the out_dir of a checkpoint of
    train.py's small model. Writes the broken files they read to tmp_path."""
    (tmp_path / 'short').mkdir()
    np.zeros(10, dtype=np.uint16).tofile(tmp_path / 'short' / 'train.bin')
    np.zeros(10, dtype=np.uint16).tofile(tmp_path / 'short' / 'val.bin')
    truncated = tmp_path / 'trunc'
    truncated.mkdir()
    data = (workdir / bad / 'ckpt.pt').read_bytes()
    (truncated / 'ckpt.pt').write_bytes(data[:len(data) // 2])
    (tmp_path / 'other').mkdir()
    with open(tmp_path / 'other' / 'meta.pkl', 'wb') as f:
        pickle.dump(dict(vocab_size=99), f)
    for src in ('train.bin', 'val.bin'):
        (tmp_path / 'other' / src).write_bytes((workdir / 'data' / 'shakespeare_char' / src).read_bytes())
    (tmp_path / 'a-file').write_text('')
    for name, data in (('empty', b''), ('garbage', b'not a checkpoint at all')):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'ckpt.pt').write_bytes(data)
    (tmp_path / 'bpe').mkdir()
    for src in ('train.bin', 'val.bin'):
        (tmp_path / 'bpe' / src).write_bytes((workdir / 'data' / 'shakespeare_char' / src).read_bytes())
    std, moe = write_standard_checkpoint(workdir, tmp_path / 'std.pt'), write_standard_checkpoint(workdir, tmp_path / 'moe.pt', n_expert=4)
    return [
        (['--batch_size=big'], "error: batch_size='big' (from --batch_size=big) should be of type int, not str"),
        (['--learning_rate'], "error: --learning_rate: overrides take the form --key=value"),
        (['--dataset=nope'], f"error: no {os.path.join('data', 'nope', 'train.bin')}: prepare the data first"),
        ([f'--data_dir={tmp_path}', '--dataset=short'], f"error: {tmp_path / 'short' / 'train.bin'} has 10 tokens, fewer than block_size+1 = 17"),
        (['--out_dir=nothing', '--init_from=resume'], f"error: no checkpoint at {os.path.join('nothing', 'ckpt.pt')}"),
        ([f'--out_dir={truncated}', '--init_from=resume'], f"error: {truncated / 'ckpt.pt'} is not a readable checkpoint"),
        ([f'--out_dir={bad}', '--init_from=resume', f'--data_dir={tmp_path}', '--dataset=other'],
         f"error: {tmp_path / 'other' / 'meta.pkl'} has vocab_size 99 but {os.path.join(bad, 'ckpt.pt')} has"),
        ([f'--out_dir={bad}', '--init_from=resume', '--residual=mhc', '--depth_block=1'],
         f"error: {os.path.join(bad, 'ckpt.pt')} was trained with depth_block=2; it cannot resume as depth_block=1"),
        (['--device=cuda'], "error: device=cuda but CUDA is not available here"),
        (['--residual=dar', '--depth_block=0'], "error: depth_block=0 must be >= 1"),
        # every value checked at start, one line naming the flag and its range
        (['--eval_interval=0'], "error: eval_interval=0 is out of range: an integer >= 1"),
        (['--batch_size=0'], "error: batch_size=0 is out of range: an integer >= 1"),
        (['--n_head=0'], "error: n_head=0 is out of range: an integer >= 1"),
        (['--gradient_accumulation_steps=0'], "error: gradient_accumulation_steps=0 is out of range: an integer >= 1"),
        (['--dropout=1.5'], "error: dropout=1.5 is out of range: 0 <= dropout < 1"),
        (['--learning_rate=-0.001'], "error: learning_rate=-0.001 is out of range: a number > 0"),
        (['--device=gpu'], "error: device='gpu' is out of range: auto, cpu, mps, cuda or cuda:N"),
        (['--init_from=gpt2'], "error: init_from='gpt2' is out of range: scratch, resume or a checkpoint file, *.pt"),
        (['--compile=0'], "error: compile=0 is out of range: True, False or None"),
        (['--compile=false'], "error: compile='false' is out of range: True, False or None"), # a string: would be true
        # upcycling: a dense standard checkpoint of the same shape, to attnres or dar
        ([f'--init_from={std}', '--residual=attnres', '--n_embd=64'], f"error: {std} was trained with n_embd=32; it cannot start a run as n_embd=64"),
        ([f'--init_from={std}', '--residual=dar', '--n_layer=3'], f"error: {std} was trained with n_layer=2; it cannot start a run as n_layer=3"),
        ([f'--init_from={moe}', '--residual=dar'], f"error: --residual=dar: upcycling takes a dense standard checkpoint"),
        ([f'--init_from={os.path.join(bad, "ckpt.pt")}', '--residual=attnres'], "error: --residual=attnres: upcycling takes a dense standard"),
        ([f'--init_from={std}', '--residual=mhc', '--depth_block=1'], "error: --residual=mhc: upcycling takes a dense standard checkpoint"),
        ([f'--init_from={std}', '--residual=dar', '--dar_routing=fixed'], "error: --residual=dar: upcycling takes a dense standard"),
        ([f'--out_dir={tmp_path / "a-file" / "out"}'], f"error: --out_dir={tmp_path / 'a-file' / 'out'}: Not a directory"),
        # bad checkpoints: one complete line, never torch's advice to load with weights_only=False
        ([f'--out_dir={tmp_path / "empty"}', '--init_from=resume'], f"error: {tmp_path / 'empty' / 'ckpt.pt'} is empty (0 bytes): not a checkpoint"),
        ([f'--out_dir={tmp_path / "garbage"}', '--init_from=resume'],
         f"error: {tmp_path / 'garbage' / 'ckpt.pt'} is not a readable checkpoint: truncated, damaged or another format"),
        ([f'--out_dir={bad}', '--init_from=resume', f'--data_dir={tmp_path}', '--dataset=bpe'],
         f"error: {tmp_path / 'bpe'} holds GPT-2 BPE tokens (no meta.pkl) but {os.path.join(bad, 'ckpt.pt')} has a vocabulary of"),
        # nothing lost: a scratch run does not replace a checkpoint
        ([f'--out_dir={bad}'], f"error: {os.path.join(bad, 'ckpt.pt')} exists: continue it with --init_from=resume, replace it with --overwrite=True"),
    ]

def write_standard_checkpoint(workdir, path, **kw):
    """An untrained standard checkpoint of train.py's small shape, as nanoGPT writes it (its model_args)."""
    with open(workdir / 'data' / 'shakespeare_char' / 'meta.pkl', 'rb') as f:
        args = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False, dropout=0.0, vocab_size=pickle.load(f)['vocab_size'], **kw)
    torch.save(dict(model=GPT(GPTConfig(**args)).state_dict(), model_args=args), path)
    return path

def write_checkpoint(workdir, out_dir):
    """A checkpoint of the model train.py builds from SMALL, untrained, as train.py writes it."""
    cfg, _ = train.configure(train.DEFAULTS, SMALL)
    model_args = {k: cfg[k] for k in train.MODEL_KEYS if k != 'vocab_size'}
    with open(workdir / 'data' / 'shakespeare_char' / 'meta.pkl', 'rb') as f:
        model_args['vocab_size'] = pickle.load(f)['vocab_size']
    model = GPT(GPTConfig(**model_args))
    (workdir / out_dir).mkdir(exist_ok=True)
    torch.save(dict(model=model.state_dict(), model_args=model_args, config=cfg, iter_num=0), workdir / out_dir / 'ckpt.pt')

def fails(main, args, capsys):
    """main(args) in this process: its exit status and its stderr."""
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code, capsys.readouterr().err

def test_bad_inputs_fail_with_one_line_in_process(workdir, tmp_path, monkeypatch, capsys):
    """Every bad input of train.py and sample.py ends in its one line, checked in this process (the
    subprocess twin, marked slow, also checks the exit status and that no traceback is printed)."""
    monkeypatch.chdir(workdir)
    # a case that trained by mistake must not leave its signal handlers behind
    monkeypatch.setattr(train.signal, 'signal', lambda *args: None)
    write_checkpoint(workdir, 'bad-quick')
    cases = bad_inputs(workdir, tmp_path, 'bad-quick') + [
        (['--n_layers=2'], "error: unknown config key 'n_layers' (from --n_layers=2); did you mean 'n_layer'?"),
        (['--n_layer=two'], "error: n_layer='two' (from --n_layer=two) should be of type int, not str"),
        (['--fsdp=True'], "error: fsdp=True needs a distributed launch")]
    for args, message in cases:
        status, err = fails(train.main, SMALL + ['--max_iters=2'] + args, capsys)
        assert status == 1, (args, err)
        assert err.strip().startswith(message) and err.strip().count('\n') == 0, (args, err)
    for args, message in SAMPLE_CASES:
        status, err = fails(sample.main, ['--out_dir=bad-quick', '--num_samples=1'] + args, capsys)
        assert status == 1 and last_line(err).startswith(message), (args, err)
    assert last_line(err).endswith("'Zx{}'")
    for top_k in ('0', 'None'): # no top-k
        sample.main(['--out_dir=bad-quick', f'--top_k={top_k}', '--num_samples=1', '--max_new_tokens=5'])

def test_an_upcycled_run_starts_at_its_checkpoints_loss_and_resumes(workdir, monkeypatch, capsys):
    """A standard run's checkpoint, upcycled by --init_from with --residual=attnres or dar: its first
    eval is the checkpoint's (the same batches; docs/depth.md), and its run resumes as any run."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(train.signal, 'signal', lambda *args: None)
    base = SMALL + ['--eval_interval=100', '--overwrite=True']
    assert train.main(base + ['--residual=standard', '--out_dir=up-std', '--max_iters=4']) == 0
    def first_eval(*args):
        capsys.readouterr()
        assert train.main(base + ['--init_from=up-std/ckpt.pt', '--eval_only=True', '--out_dir=up-eval', *args]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith('step 0:')]
    standard = first_eval() # no --residual: the checkpoint's path
    assert standard and first_eval('--residual=attnres') == first_eval('--residual=dar', '--depth_block=1') == standard
    up = base + ['--init_from=up-std/ckpt.pt', '--residual=dar']
    assert train.main(up + ['--out_dir=up-full', '--max_iters=4']) == 0
    full = losses(capsys.readouterr().out)
    assert train.main(up + ['--out_dir=up-part', '--max_iters=2']) == 0
    part = losses(capsys.readouterr().out)
    assert train.main(base + ['--out_dir=up-part', '--max_iters=4', '--init_from=resume']) == 0
    assert part + losses(capsys.readouterr().out) == full
    checkpoint = torch.load(workdir / 'up-part' / 'ckpt.pt', weights_only=True)
    assert checkpoint['model_args']['residual'] == 'dar' and checkpoint['iter_num'] == 4

def test_a_run_from_a_checkpoint_takes_its_shape_and_may_set_its_dropout(workdir, monkeypatch, capsys):
    """Resuming, or starting from weights, the model's settings are the checkpoint's, block_size
    too (train.py's default 64 is not the checkpoint's 16); a run from weights may set its own
    dropout, as nanoGPT's override_args do."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(train.signal, 'signal', lambda *args: None)
    assert train.main(SMALL + ['--out_dir=shape', '--max_iters=2', '--overwrite=True']) == 0
    unsized = [a for a in SMALL if not a.startswith('--block_size')]
    assert train.main(unsized + ['--out_dir=shape', '--max_iters=4', '--init_from=resume']) == 0
    assert 'tokens per iteration will be: 64' in capsys.readouterr().out # 4 x 16
    checkpoint = torch.load(workdir / 'shape' / 'ckpt.pt', weights_only=True)
    assert checkpoint['iter_num'] == 4 and checkpoint['config']['block_size'] == 16
    assert train.main(unsized + ['--init_from=shape/ckpt.pt', '--dropout=0.1', '--out_dir=tuned', '--max_iters=2',
                                 '--overwrite=True']) == 0
    tuned = torch.load(workdir / 'tuned' / 'ckpt.pt', weights_only=True)
    assert tuned['model_args']['dropout'] == tuned['config']['dropout'] == 0.1 and tuned['model_args']['block_size'] == 16

def test_config_files_run_as_nanogpts_do(tmp_path, capsys):
    """A config file sees the config so far and may import; what it assigns at its top level is
    given; a broken one fails with one line. A string key takes a number-like value as text."""
    (tmp_path / 'a.py').write_text('import math\nmax_iters = max_iters * 2\nwarmup_iters = max_iters // 10\n'
                                   'learning_rate = math.sqrt(1e-6)\neval_iters = len([w for w in range(warmup_iters)]) // 40\n'
                                   'def helper():\n    dropout = 0.5\n')
    cfg, given = configure(train.DEFAULTS, [str(tmp_path / 'a.py'), '--out_dir=2024'])
    assert (cfg['max_iters'], cfg['warmup_iters'], cfg['learning_rate'], cfg['eval_iters']) == (4000, 400, 1e-3, 10)
    assert given == {'max_iters', 'warmup_iters', 'learning_rate', 'eval_iters', 'out_dir'} and cfg['out_dir'] == '2024'
    assert cfg['dropout'] == 0.0 # a function's names are no keys
    (tmp_path / 'b.py').write_text('max_iters = (\n')
    with pytest.raises(SystemExit):
        configure(train.DEFAULTS, [str(tmp_path / 'b.py')])
    assert capsys.readouterr().err.startswith(f"error: config file {tmp_path / 'b.py'}: SyntaxError")
    assert configure(sample.DEFAULTS, ['--start=123'])[0]['start'] == '123'

def test_sample_needs_the_meta_of_a_character_model(workdir, tmp_path, monkeypatch, capsys):
    """Run away from the data, a character-level model's meta.pkl is not found: one line, not BPE
    decoding of character ids."""
    monkeypatch.setattr(train.signal, 'signal', lambda *args: None)
    monkeypatch.chdir(workdir)
    assert train.main(SMALL + ['--out_dir=char', '--max_iters=1', '--overwrite=True']) == 0
    monkeypatch.chdir(tmp_path)
    status, err = fails(sample.main, [f"--out_dir={workdir / 'char'}", '--num_samples=1'], capsys)
    assert status == 1 and last_line(err).startswith(f"error: no {os.path.join('data', 'shakespeare_char', 'meta.pkl')} for this")

def test_a_compiled_run_evaluates_through_its_training_graph(workdir, monkeypatch, capsys):
    """Without dropout a compiled run's evals call the compiled model as training does, grad on
    and in train mode (one graph for both); with dropout they run the eager model."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(train.signal, 'signal', lambda *args: None)
    calls = [] # (grad enabled, train mode) of each call of the compiled model
    class Compiled(torch.nn.Module): # stands in for torch.compile's module
        def __init__(self, model):
            super().__init__()
            self.model = model
        def forward(self, *args):
            calls.append((torch.is_grad_enabled(), self.model.training))
            return self.model(*args)
    monkeypatch.setattr(train.torch, 'compile', Compiled)
    args = SMALL + ['--compile=True', '--max_iters=2', '--eval_interval=2', '--out_dir=graph-eval', '--overwrite=True']
    assert train.main(args) == 0
    assert calls == [(True, True)] * (2 * 2 * 2 + 2) # evals at steps 0 and 2, 2 splits x 2 batches each; 2 steps
    calls.clear()
    assert train.main(args + ['--dropout=0.1']) == 0
    assert calls == [(True, True)] * 2 # the training steps only

@pytest.mark.slow
def test_bad_inputs_fail_with_one_line(workdir, tmp_path):
    run(SMALL + ['--out_dir=bad', '--max_iters=2'], workdir)
    for args, message in bad_inputs(workdir, tmp_path, 'bad'):
        p = run(SMALL + ['--max_iters=2'] + args, workdir, check=False)
        assert p.returncode == 1, (args, p.stderr)
        assert last_line(p.stderr).startswith(message), (args, last_line(p.stderr))
        assert 'Traceback' not in p.stderr
    for args, message in SAMPLE_CASES:
        p = run(['--out_dir=bad', '--num_samples=1'] + args, workdir, check=False, module='sample.py')
        assert p.returncode == 1 and last_line(p.stderr).startswith(message), (args, p.stderr)
        assert 'Traceback' not in p.stderr
    assert p.stderr.strip().endswith("'Zx{}'")
    for top_k in ('0', 'None'): # no top-k
        run(['--out_dir=bad', f'--top_k={top_k}', '--num_samples=1', '--max_new_tokens=5'], workdir, module='sample.py')

HELD = """
import sys, select
sys.path.insert(0, {root!r})
import train

def hold(what):
    print(what, flush=True) # the test reads this on stdout, then releases the run with a line on stdin
    while not select.select([sys.stdin], [], [], 0.1)[0]: # wake often: signal handlers run between waits
        pass
    sys.stdin.readline()

where, calls = sys.argv.pop(1), [0]
get_batch, save_checkpoint = train.get_batch, train.save_checkpoint
def held_get_batch(*args): # calls 1-4 are the first eval's (eval_iters=2, two splits); 7 is the 3rd step's
    calls[0] += 1
    if where.startswith('step') and calls[0] == 7:
        hold('held in step 3')
    return get_batch(*args)
def held_save_checkpoint(*args):
    save_checkpoint(*args)
    if where.endswith('save'):
        hold('held after the save')
train.get_batch, train.save_checkpoint = held_get_batch, held_save_checkpoint
train.exit_now(train.main(sys.argv[1:]))
"""

class HeldRun:
    """train.py held at points the test controls, each until the test calls release(): 'step' holds
    the 3rd step (in its get_batch), 'step+save' also holds after a checkpoint is saved. A signal
    sent while it is held provably arrives there, whatever the machine's speed. Its output is read
    by threads, so that a missing line fails the test after a minute instead of hanging it."""

    def __init__(self, workdir, where, out_dir):
        script = workdir / 'held_train.py'
        script.write_text(HELD.format(root=ROOT))
        cmd = [sys.executable, str(script), where] + SMALL + [f'--out_dir={out_dir}', '--max_iters=100000', '--eval_interval=100000']
        self.p = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = {'out': queue.Queue(), 'err': queue.Queue()}
        self.text = {'out': [], 'err': []}
        for name, stream in (('out', self.p.stdout), ('err', self.p.stderr)):
            threading.Thread(target=self.read, args=(name, stream), daemon=True).start()
        self.wait_for('out', 'held in step 3')

    def read(self, name, stream):
        for line in stream:
            self.lines[name].put(line)
        self.lines[name].put(None) # end of the stream

    def wait_for(self, name, start):
        """Read the stream up to a line that starts with start (a string or a tuple of them); that line."""
        while True:
            line = self.lines[name].get(timeout=60)
            if line is None:
                raise AssertionError(f"no line starting with {start!r} in:\n{''.join(self.text[name])}")
            self.text[name].append(line)
            if line.startswith(start):
                return line

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.p.poll() is None: # a failed test leaves no run behind
            self.p.kill()
            self.p.wait()

    def signal(self, name):
        self.p.send_signal(getattr(subprocess.signal, name))

    def release(self):
        self.p.stdin.write('go\n')
        self.p.stdin.flush()

    def finish(self):
        """Release the run, wait for its end; its exit status, stdout and stderr."""
        with contextlib.suppress(BrokenPipeError): # it may have exited already
            self.release()
        self.p.wait(timeout=120)
        for name in self.lines:
            while (line := self.lines[name].get(timeout=60)) is not None:
                self.text[name].append(line)
        return self.p.returncode, ''.join(self.text['out']), ''.join(self.text['err'])

# timeout(1) sends SIGTERM twice; Ctrl-C under torchrun reaches a rank from the terminal and from torchrun
@pytest.mark.slow
@pytest.mark.parametrize('signals', [['SIGTERM'], ['SIGTERM', 'SIGTERM'], ['SIGINT', 'SIGTERM']])
def test_a_stop_signal_saves_a_checkpoint_at_the_end_of_the_step(workdir, signals):
    """The first signal asks for a stop at the end of the step: a checkpoint of that step, one line,
    exit status 128 + the signal's number. Repeats sent at once (microseconds apart, against
    train.REPEAT_S of 2 s) are the same request. Two kinds sent at once may be handled in either
    order (each thread of the process can take one), so the first is the one the run names."""
    out_dir = 'sig-' + '-'.join(signals)
    with HeldRun(workdir, 'step', out_dir) as run:
        for name in signals:
            run.signal(name)
        first = run.wait_for('err', tuple(f"{name}: stopping at the end of this step" for name in signals)).split(':')[0]
        status, out, err = run.finish()
    assert err.count('stopping at the end of this step') == 1, err
    assert status == 128 + getattr(subprocess.signal, first), err
    assert f"stopped by {first} at iteration 3; saved checkpoint to {os.path.join(out_dir, 'ckpt.pt')}" in out
    assert 'second' not in err
    assert torch.load(workdir / out_dir / 'ckpt.pt', weights_only=True)['iter_num'] == 3

@pytest.mark.slow
@pytest.mark.parametrize('where', ['step', 'save'])
def test_a_second_signal_exits_at_once(workdir, where):
    """A signal later than train.REPEAT_S after the first exits at once with one line and status 1:
    during the step, writing no checkpoint; after the stop's checkpoint is saved, leaving it whole
    (so never a bare -15 while a saved run shuts down)."""
    out_dir = f'sig2-{where}'
    with HeldRun(workdir, 'step+save' if where == 'save' else 'step', out_dir) as run:
        run.signal('SIGTERM')
        run.wait_for('err', "SIGTERM: stopping at the end of this step")
        if where == 'save': # let the step end; the run saves its checkpoint and is held there
            run.release()
            run.wait_for('out', 'held after the save')
        time.sleep(train.REPEAT_S + 0.1) # the run is held, so a longer wait changes nothing
        run.signal('SIGTERM')
        status, out, err = run.finish()
    assert status == 1, err
    assert f"second SIGTERM: exiting now; {os.path.join(out_dir, 'ckpt.pt')} keeps the last saved checkpoint" in err
    assert 'stopped by' not in out
    if where == 'step':
        assert not (workdir / out_dir / 'ckpt.pt').exists()
    else:
        assert torch.load(workdir / out_dir / 'ckpt.pt', weights_only=True)['iter_num'] == 3

@pytest.mark.slow
def test_eval_only_and_resuming_a_finished_run_leave_the_checkpoint(workdir):
    run(SMALL + ['--out_dir=keep', '--max_iters=2'], workdir)
    before = (workdir / 'keep' / 'ckpt.pt').read_bytes()
    run(SMALL + ['--out_dir=keep', '--init_from=resume', '--eval_only=True'], workdir)
    p = run(SMALL + ['--out_dir=keep', '--init_from=resume', '--max_iters=2'], workdir)
    assert 'saving checkpoint' not in p.stdout
    assert (workdir / 'keep' / 'ckpt.pt').read_bytes() == before
    p = run(SMALL + ['--out_dir=keep', '--overwrite=True', '--max_iters=1'], workdir)
    assert (workdir / 'keep' / 'ckpt.pt').read_bytes() != before
    assert 'done: 1 iterations, 1 in this run' in p.stdout and 'sample it with: python sample.py --out_dir=keep' in p.stdout

@pytest.mark.slow
@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'bench.py', 'analyze.py'])
def test_help_lists_every_key_with_its_default_and_comment(script, tmp_path):
    p = run(['--help'], tmp_path, module=script)
    assert p.returncode == 0 and 'keys (--key=value' in p.stdout
    want = {'train.py': "--eval_iters=20  # batches per split in an eval", 'sample.py': "--top_k=200  # retain only the top_k",
            'bench.py': "--rounds=10  # timed rounds per path", 'analyze.py': "--batches=8  # val batches"}[script]
    assert want in p.stdout

@pytest.mark.slow
def test_a_redirected_log_has_no_progress_bar(workdir):
    p = run(SMALL + ['--out_dir=bar', '--max_iters=3'], workdir)
    assert '\r' not in p.stderr and 'it/s' not in p.stderr

@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(workdir):
    run(SMALL + ['--out_dir=nan', '--max_iters=3'], workdir)
    before = (workdir / 'nan' / 'ckpt.pt').read_bytes()
    p = run(SMALL + ['--out_dir=nan', '--max_iters=10', '--init_from=resume', '--learning_rate=1e30',
                     '--always_save_checkpoint=False'], workdir, check=False)
    assert p.returncode == 1
    assert re.fullmatch(r"error: loss is (nan|inf) at iter \d+: stopping; \S+ keeps the last good checkpoint", last_line(p.stderr))
    assert (workdir / 'nan' / 'ckpt.pt').read_bytes() == before

# -----------------------------------------------------------------------------
# scale: large-corpus shards, FSDP2, activation checkpointing

def test_get_batch_reads_the_windows_of_every_shard(tmp_path):
    """open_split counts each shard's windows and skips a shard too short for one; window i of
    all shards in turn is tokens [i, i + block_size] of its shard, never crossing into the next;
    targets are the inputs shifted by one."""
    rng, T, windows = np.random.default_rng(0), 8, []
    for n, size in enumerate([50, 80, 5, 70]): # a shard of 5 tokens holds no window: skipped
        tokens = rng.integers(0, 65, size).astype(np.uint16)
        tokens.tofile(tmp_path / f'train_{n}.bin')
        windows += [tokens[i:i + T + 1] for i in range(size - T)]
    shards = train.open_split(str(tmp_path), 'train', T)
    assert [w for _, w in shards] == [42, 72, 62]
    ix = torch.randint(len(windows), (40,), generator=torch.Generator().manual_seed(0))
    x, y = train.get_batch(shards, ix, T, 'cpu')
    want = torch.from_numpy(np.stack([windows[i] for i in ix.tolist()]).astype(np.int64))
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])

@pytest.mark.slow
def test_large_corpus_shards_and_training_on_them(tmp_path):
    gpt2 = os.path.join(SHARED, 'data', 'gpt2')
    if not os.path.exists(gpt2):
        pytest.skip(f"{gpt2} is absent: BPE shards need the shared GPT-2 vocabulary offline")
    rng = np.random.default_rng(0)
    words = ['the', 'king', 'queen', 'of', 'and', 'my', 'lord', 'shall', 'be', 'not', 'to', 'is', '\n']
    docs = [' '.join(rng.choice(words, size=rng.integers(3, 80))) for _ in range(200)]
    with open(tmp_path / 'docs.jsonl', 'w') as f:
        for d in docs:
            f.write(json.dumps({'text': d}) + '\n')
    run(['docs', '--input=docs.jsonl', f'--gpt2_dir={gpt2}', '--shard_tokens=1000', '--num_proc=2'], tmp_path, module='prepare_data.py')
    files = sorted(os.listdir(tmp_path / 'data' / 'docs'), key=lambda n: n.split('_')[1])
    assert files[0] == 'val_000000.bin' and all(f.startswith('train_') for f in files[1:])
    shards = [np.fromfile(tmp_path / 'data' / 'docs' / f, dtype=np.uint16) for f in files]
    assert all(len(s) == 1000 for s in shards[:-1]) and 0 < len(shards[-1]) <= 1000
    from prepare_data import gpt2_encoding
    enc = gpt2_encoding(gpt2)
    want = [t for d in docs for t in [enc.eot_token] + enc.encode_ordinary(d)] # <|endoftext|> between documents
    assert np.concatenate(shards).tolist() == want
    p = run(SMALL + ['--dataset=docs', '--max_iters=2', '--out_dir=out'], tmp_path)
    assert 'step 2:' in p.stdout
    # a smaller corpus in the same folder: the earlier run's shards go, none is read as this one's
    (tmp_path / 'few.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs[:40]))
    run(['docs', '--input=few.jsonl', f'--gpt2_dir={gpt2}', '--shard_tokens=1000', '--num_proc=2'], tmp_path, module='prepare_data.py')
    few = [t for d in docs[:40] for t in [enc.eot_token] + enc.encode_ordinary(d)]
    files = sorted(os.listdir(tmp_path / 'data' / 'docs'), key=lambda n: n.split('_')[1])
    assert np.concatenate([np.fromfile(tmp_path / 'data' / 'docs' / f, dtype=np.uint16) for f in files]).tolist() == few
    # a bad line, met in the pool's reading thread: one line and exit 1, not a hang
    (tmp_path / 'bad.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs[:60]) + '{not json}\n')
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'prepare_data.py'), 'docs', '--input=bad.jsonl', f'--gpt2_dir={gpt2}',
                        '--shard_tokens=1000', '--num_proc=2'], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and last_line(p.stderr) == 'error: --input bad.jsonl, line 61: not a JSON object with a "text" field'
    assert 'Traceback' not in p.stderr and not glob.glob(str(tmp_path / 'data' / 'docs' / '*.bin')) # no corpus cut short

@pytest.mark.slow
def test_fsdp2_two_processes_equal_one(workdir):
    args = SMALL + ['--gradient_accumulation_steps=2', '--max_iters=4', '--eval_interval=100']
    # one thread in every process, the reference too: only FSDP's reduction order may differ
    env = dict(os.environ, OMP_NUM_THREADS='1')
    one = run(args + ['--out_dir=fsdp1'], workdir, env=env)
    two = torchrun(args + ['--out_dir=fsdp2', '--fsdp=True', '--activation_checkpointing=True'], workdir, env)
    assert two.returncode == 0, two.stderr[-3000:]
    l1 = [float(x.split()[-1]) for x in losses(one.stdout)]
    l2 = [float(x.split()[-1]) for x in losses(two.stdout)]
    assert len(l1) == len(l2) == 4 and l1 == pytest.approx(l2, abs=2e-4)
    a = torch.load(workdir / 'fsdp1' / 'ckpt.pt', weights_only=True)['model']
    b = torch.load(workdir / 'fsdp2' / 'ckpt.pt', weights_only=True)['model']
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    # the FSDP checkpoint resumes in a single process
    run(args + ['--out_dir=fsdp2', '--max_iters=5', '--init_from=resume'], workdir)

@pytest.mark.slow
def test_fsdp_needs_torchrun(workdir):
    p = run(SMALL + ['--fsdp=True'], workdir, check=False)
    assert p.returncode == 1 and last_line(p.stderr).startswith("error: fsdp=True needs a distributed launch")

@pytest.mark.slow
def test_bench_rows_per_path_and_mode(tmp_path):
    """bench.py's table: one row per path and mode, ratios to standard in the same mode, decode
    and memory only where they are measured."""
    out = tmp_path / 'bench.json'
    run(['--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2', '--decode_tokens=2',
         '--paths=dar-block', '--rounds=1', '--warmup=1', '--modes=eager', f'--json_out={out}'], tmp_path, module='bench.py')
    results = json.loads(out.read_text())['results']
    assert list(results) == ['standard eager', 'dar-block eager']
    assert results['standard eager']['train_ratio'] == 1.0
    assert results['dar-block eager']['decode_ratio'] > 0 and results['dar-block eager']['peak_memory_mb'] > 0
    assert results['dar-block eager']['saved_ratio'] > 1 # two streams' histories are kept for backward
    p = run(['--modes=fast'], tmp_path, module='bench.py', check=False)
    assert p.returncode == 1 and last_line(p.stderr) == 'error: --modes: unknown mode fast; compiled and / or eager'
    p = run(['--block_size=16', '--decode_tokens=9'], tmp_path, module='bench.py', check=False)
    assert p.returncode == 1 and last_line(p.stderr).startswith('error: decode_tokens=9 is out of range: at most block_size - block_size // 2 = 8')

@pytest.mark.slow
def test_bench_times_train_py_against_a_bare_loop(tmp_path):
    """bench.py --report=loop: train.py's step and a bare loop of the same model, in one process."""
    out = tmp_path / 'loop.json'
    p = run(['--report=loop', '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2',
             '--rounds=2', f'--json_out={out}'], tmp_path, module='bench.py')
    loop = json.loads(out.read_text())['loop']
    assert loop['train_py_s']['median'] > 0 and loop['bare_s']['median'] > 0 and loop['ratio']['min'] > 0
    assert re.search(r"^train\.py [\d.]+ ms, bare loop [\d.]+ ms, ratio [\d.]+ \(", p.stdout, flags=re.M)
    assert re.search(r"^bare loop with gradient clipping at 1.0 as train.py: [\d.]+ ms, ratio [\d.]+ \(", p.stdout, flags=re.M)
    assert loop['ratio_clipped']['min'] > 0
    assert os.listdir(tmp_path) == ['loop.json'] # its token files and checkpoints were temporary
    p = run(['--report=speed'], tmp_path, module='bench.py', check=False)
    assert p.returncode == 1 and last_line(p.stderr) == 'error: --report: unknown report speed; paths, loop, compile, e2e or gpu'
    p = run(['--report=compile', '--runs=0'], tmp_path, module='bench.py', check=False)
    assert p.returncode == 1 and last_line(p.stderr) == 'error: runs=0 is out of range: an integer >= 1'

@pytest.mark.slow
def test_bench_times_the_compile_from_a_fresh_cache_and_on_it(tmp_path):
    """bench.py --report=compile: per path and run, the first compiled training step in a fresh
    process from a fresh inductor cache, then in another on that cache, which it reads."""
    out = tmp_path / 'compile.json'
    p = run(['--report=compile', '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2',
             '--paths=dar-block', '--runs=1', f'--json_out={out}'], tmp_path, module='bench.py')
    res = json.loads(out.read_text())['compile']
    assert list(res) == ['standard', 'dar-block']
    for r in res.values():
        assert r['cold_s']['median'] > 0 and r['warm_s']['median'] > 0 and r['step_s']['median'] > 0
        assert r['cold_cache_hits'] == [0] and r['warm_cache_hits'][0] > 0
    assert re.search(r"^\| dar-block \| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+ \([\d.]+-[\d.]+\) \| ", p.stdout, flags=re.M)
    assert res['standard']['cold_ratio']['median'] == 1 and res['dar-block']['cold_ratio']['median'] > 0
    assert os.listdir(tmp_path) == ['compile.json'] # nothing else written here

@pytest.mark.slow
def test_bench_gpu_check_runs_at_a_tiny_size_on_cpu(tmp_path):
    """The prepared GPU check (docs/gpu.md), at a tiny size on CPU: every part reports."""
    out = tmp_path / 'gpu.json'
    p = run(['--report=gpu', '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2', '--rounds=1',
             '--moe_steps=2', f'--json_out={out}'], tmp_path, module='bench.py')
    res = json.loads(out.read_text())['gpu']
    names = ['standard', 'dar-block', 'attnres-block', 'dar-full']
    assert list(res['first_s']) == list(res['ratio']) == names
    assert res['ratio']['standard']['median'] == 1 and all(res['first_s'][n] > 0 for n in names)
    assert set(res['profile']) == {'standard', 'dar-block'} and 'Self CPU' in res['profile']['dar-block']
    assert res['kernels_vs_torch_ops']['median'] > 0 and "the depth ops' kernels x their torch ops" in p.stdout
    assert res['moe']['steps'] == 2 and all(math.isfinite(l) for l in res['moe']['losses'])
    assert 'Block DAR + MoE, compiled: 2 steps' in p.stdout

@pytest.mark.slow
def test_bench_times_train_py_end_to_end(workdir, tmp_path):
    """bench.py --report=e2e: pairs of train.py runs, DAR then standard, each start to exit, with
    the ratio per pair; a train.py that fails is named with its arguments."""
    out = tmp_path / 'e2e.json'
    small = ' '.join(SMALL + ['--max_iters=2', '--eval_interval=2', f"--data_dir={workdir / 'data'}"])
    p = run(['--report=e2e', '--runs=2', f'--train_args={small}', f'--json_out={out}'], tmp_path, module='bench.py')
    res = json.loads(out.read_text())['e2e']
    assert len(res['pairs_s']) == 2 and all(d > 0 and s > 0 for d, s in res['pairs_s'])
    assert re.search(r"^\| 1 \(cold cache\) \| [\d.]+ \(\d\.\d{4}\) \| [\d.]+ \(\d\.\d{4}\) \| \d\.\d{3} \|$", p.stdout, flags=re.M)
    assert len(res['val_loss']) == 2 and all(0 < v < 10 for pair in res['val_loss'] for v in pair)
    assert os.listdir(tmp_path) == ['e2e.json'] # train.py wrote to a temporary out_dir
    p = run(['--report=e2e', '--train_args=--n_layer=0'], workdir, module='bench.py', check=False)
    assert p.returncode == 1
    assert last_line(p.stderr) == "error: --report=e2e: train.py --n_layer=0 failed: error: n_layer=0 is out of range: an integer >= 1"

# -----------------------------------------------------------------------------
# the docs name only what exists

def doc_files():
    return [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))

def code_text():
    return '\n'.join(open(p).read() for p in glob.glob(os.path.join(ROOT, '**', '*.py'), recursive=True))

def defined(owner, name):
    """Whether owner.name exists where owner is one of our modules or classes: a def, class or
    assignment of name in that module, or a method or attribute in that class. Other owners
    (torch, np) are not checked here."""
    modules = {os.path.basename(p)[:-3]: open(p).read() for p in glob.glob(os.path.join(ROOT, '*.py'))}
    if owner in modules:
        return re.search(rf'^(def {name}\(|class {name}\b|{name}\s*[:=])', modules[owner], flags=re.M) is not None
    for text in modules.values():
        body = re.search(rf'^class {owner}\b.*?(?=^\S|\Z)', text, flags=re.M | re.S)
        if body:
            return re.search(rf'def {name}\(|self\.{name}\b[\w., ]*=[^=]|^\s+{name}\s*[:=]', body.group(0), flags=re.M) is not None
    return True

def test_every_code_name_in_the_docs_exists():
    """Every backticked name in README.md and docs/ (an identifier, a dotted name, a call, a
    --flag, a file) is in the code or the repository: no name left behind by a change."""
    code, missing = code_text(), []
    for path in doc_files():
        text = re.sub(r'```.*?```', '', open(path).read(), flags=re.S) # inline spans only
        for span in re.findall(r'`([^`\n]+)`', text):
            flag = re.fullmatch(r'--(\w+)(=\S*)?', span)
            if flag:
                names = [flag.group(1)]
            elif re.fullmatch(r'[\w/-][\w./-]*\.(py|md|json|png|txt|ini|cpp)', span): # not ../: outside the repository
                # a file of the repository, or one the code writes
                if not os.path.exists(os.path.join(ROOT, span)) and os.path.basename(span) not in code:
                    missing.append((os.path.basename(path), span))
                continue
            elif re.fullmatch(r'[A-Za-z_][\w.]*(\(.*\))?', span):
                names = span.split('(')[0].split('.')
                if len(names) > 1 and not defined(names[0], names[1]):
                    missing.append((os.path.basename(path), span))
            else:
                continue # a command, an equation or a value
            missing += [(os.path.basename(path), span) for n in names if not re.search(rf'\b{re.escape(n)}\b', code)]
    assert not missing, missing

def test_the_readme_code_is_the_models():
    """The README's python blocks are lines of model.py, as they are there."""
    model_lines = {l.strip() for l in open(os.path.join(ROOT, 'model.py'))}
    readme = open(os.path.join(ROOT, 'README.md')).read()
    lines = [l.strip() for block in re.findall(r'```python\n(.*?)```', readme, flags=re.S) for l in block.splitlines()]
    assert lines and [l for l in lines if l and l not in model_lines] == []

@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='glibc only')
def test_keep_freed_memory_is_taken_by_glibc():
    """train.py and bench.py keep freed blocks in the process (docs/bench.md); glibc must accept both
    settings, or the fresh gradient buffers page-fault on every step again."""
    import configurator
    assert configurator.keep_freed_memory() is True
