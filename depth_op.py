"""
The depth read of model.py (the lines of model.DepthState.depth_read, its definition) as one
operation, fused_read, with its backward written out, and DAR's write (model.DAR.write's lines) as
another (after the read): the same
values and gradients (test_model.py compares them in fp64), the read built so that
- one call reads J targets (AttnRes: one; DAR: both, with their fusion) over S streams of
  candidates, each stream read once per pass;
- backward keeps only the weights and scores (J, R, B, T) and the rms (S, R, B, T), besides the
  candidates: no temporary of the model's width. A DAR candidate given with the writes that made
  it (model.py: blocks of 1 or 2) is not kept either: backward makes it again, row by row as it
  reads it, from their outputs y, which the writes keep anyway (beta's gradient), as the write's
  backward makes its partials again (rho's gradient);
- torch.compile sees every read as one call, of any depth, and generates no code for it;
- it runs as one pass over the candidates per token: depth_op.cpp on CPU (fp32, fp64), Triton
  kernels on CUDA (tested on CPU in Triton's interpreter), torch ops elsewhere. So does the write.

Target t reads the keys k_r of one stream and the values v_r of one (the same or another), with
its pseudo-query w_t, the key-norm weight g (u_t = g * w_t) and a gate gate_t (1 if none):
    rms_r = sqrt(mean(k_r^2) + eps) ;  s_r = (k_r . u_t) / rms_r ;  a = softmax_r(s)
    x = scale sum_t gate_t h_t ,  h_t = sum_r a_r v_r      (scale: model.py's |C|)
Its backward, from dx (times scale), with q_r = dx . v_r (per target):
    dv_r = gate_t a_r dx ;  dgate_t = sum_r a_r q_r
    c_r = ds_r / rms_r ,  ds_r = a_r (da_r - sum_p a_p da_p) ,  da_r = gate_t q_r
    dk_r = c_r (u_t - s_r k_r / (C rms_r))      (the second term: the gradient through rms_r)
    du_t = sum_r c_r k_r ;  dw_t = du_t * g ;  dg = sum_t du_t * w_t
summed over the targets that read a candidate as a key or as a value.

The gradient of the committed history: a history entry is read by every later sublayer, so its
gradient is a sum over its readers. In a compiled graph such a sum is one kernel per entry, with
as many inputs as the entry has readers: new code for every entry, more and larger with depth. So
each stream's committed entries are data to the read, and their gradient runs through a handle S
(n, B, T, C) per stream that every read takes and passes on (grow appends an entry): backward
hands each read the gradient of the reads after it, to which it adds its own part in the same pass
(dS = dS' + dk + dv, slot by slot). A handle holds no data (an expanded zero). The partial block,
read by at most a block's sublayers, takes its gradient as a tensor of its own.
"""
import os
import ctypes
import contextlib
import functools
import hashlib
import threading
import subprocess
from typing import Optional

import torch

def fp32(v):
    """v in fp32, where the depth scores and rms are computed (zero-init query gradients underflow
    in bf16); fp64 stays fp64, for the tests that compare in fp64."""
    return v if v.dtype == torch.float64 else v.float()

def empty_handle(like, n):
    """A handle (n, *like.shape), fp32 at least (its gradient sums the reads'): no data, an
    expanded zero."""
    return like.new_zeros((), dtype=torch.promote_types(like.dtype, torch.float32)).expand(n, *like.shape)

def passed_on(S):
    """The handle a read passes on for S: the same shape and dtype, no data."""
    return S.new_zeros(()).expand(S.shape)

# -----------------------------------------------------------------------------
# on CPU, in fp32 and fp64: depth_op.cpp

CPP = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'depth_op.cpp')
ISA_FLAGS = {'AVX2': ['-mavx2', '-mfma'], 'AVX512': ['-mavx512f', '-mavx512dq', '-mavx512vl', '-mavx512bw', '-mfma']}
_lib = [] # the loaded library, or None where it could not be built
_lib_lock = threading.Lock()

def library():
    """depth_op.cpp built for this CPU's vector unit, once (cached by source, flags and compiler
    in ~/.cache/dar-gpt), and loaded; None, after a one-line warning, where that fails."""
    with _lib_lock:
        return _lib[0] if _lib else build()

def build():
    cxx = os.environ.get('CXX', 'c++')
    # for the vector unit torch found, not -march=native: machines that share a home share the cache
    flags = ['-O3', '-fopenmp', '-shared', '-fPIC', *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]
    with open(CPP, 'rb') as f:
        key = hashlib.sha256(f.read() + ' '.join([cxx, *flags]).encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get('XDG_CACHE_HOME', os.path.expanduser('~/.cache')), 'dar-gpt')
    path = os.path.join(cache, f'depth_op-{key}.so')
    try:
        if not os.path.exists(path):
            os.makedirs(cache, exist_ok=True)
            tmp = f'{path}.{os.getpid()}.tmp' # then renamed: a concurrent build never loads half a file
            subprocess.run([cxx, *flags, CPP, '-o', tmp], check=True, capture_output=True, text=True)
            os.replace(tmp, path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip().splitlines()[-1] if getattr(e, 'stderr', None) else e
        print(f"depth_op: could not build {CPP} ({detail}); depth reads run as torch ops, slower")
        lib = None
    _lib.append(lib)
    return lib

def on_kernel(tensors):
    """Whether depth_op.cpp computes a read of these tensors: all on CPU, all fp32 or all fp64."""
    dtype = tensors[0].dtype
    return (tensors[0].device.type == 'cpu' and dtype in (torch.float32, torch.float64)
            and all(t.dtype == dtype for t in tensors) and library() is not None)

def ptr(t):
    return ctypes.c_void_p(None if t is None else t.data_ptr())

def ptrs(tensors):
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])

def int64s(values):
    return (ctypes.c_int64 * len(values))(*values)

# -----------------------------------------------------------------------------
# on CUDA: Triton kernels, the same passes as depth_op.cpp (on CPU, under TRITON_INTERPRET=1, in
# Triton's interpreter: how the tests run them). A program takes BN tokens; the candidates reach it
# as a table of addresses, so a read stacks no history (it copies only a bf16 candidate, AttnRes's
# partial under autocast, into fp32), and one compile serves every R. Computed in fp32 (fp64 stays
# fp64).

try:
    import triton
    import triton.language as tl
except ImportError: # the CPU build of torch comes without Triton
    triton = None
INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
_triton_failed = [] # a kernel that failed to compile, once: torch ops from then on

def on_triton(tensors):
    """Whether the Triton kernels compute a read of these tensors: on CUDA, or any device under
    Triton's interpreter; float tensors (bfloat16 candidates are read in fp32)."""
    return (triton is not None and not _triton_failed and (tensors[0].is_cuda or INTERPRET)
            and all(t.is_floating_point() for t in tensors))

if triton is not None:
    @triton.jit
    def _tile(table, i, offs, mask, DT: tl.constexpr):
        """Rows offs of the tensor whose address is table[i] (none: zeros)."""
        addr = tl.load(table + i)
        given = offs * 0 + addr != 0 # (as a block: the interpreter takes no scalar in a mask)
        return tl.load(addr.to(tl.pointer_type(DT)) + offs, mask=mask & given, other=0.0)

    @triton.jit
    def _candidate(cand, ca, yb, cb, i, offs, c, mask, C, DT: tl.constexpr):
        """Rows offs of candidate i: the tensor at cand[i], or, given as terms (ca[i] not 0), made
        from them: ca[i] * (the tensor at cand[i]) + cb[i] * (the tensor at yb[i]), rows of C."""
        k = _tile(cand, i, offs, mask, DT)
        if tl.load(ca + i) != 0:
            k = k * _tile(ca, i, c, c < C, DT)[None, :] + _tile(cb, i, c, c < C, DT)[None, :] * _tile(yb, i, offs, mask, DT)
        return k

    # one compile for every history length: Triton would specialize R (and N) at 1 and the tables'
    # addresses (views of one copy) on their alignment
    TABLES = ['cand', 'ca', 'yb', 'cb', 'ks', 'vs', 'gin', 'gout']

    @triton.jit(do_not_specialize=['R', 'N'], do_not_specialize_on_alignment=['cand', 'ks', 'vs'])
    def _read_fwd(cand, u, ks, vs, gt, x, sc, rms, N, C, R, S, eps, TN: tl.constexpr, BN: tl.constexpr,
                  BC: tl.constexpr, DT: tl.constexpr):
        N = N.to(tl.int64) # (offsets past 2**31 at scale)
        n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
        c = tl.arange(0, BC)
        rows = n < N
        mask = rows[:, None] & (c < C)[None, :]
        offs = n[:, None] * C + c[None, :]
        xn = tl.zeros([BN, BC], dtype=DT)
        for t in tl.static_range(TN):
            kt, vt = tl.load(ks + t), tl.load(vs + t)
            ut = tl.load(u + t * C + c, mask=c < C, other=0.0)
            # h = sum_r softmax_r(s) v_r, online: running max m, sum z of exp(s_r - m), and h
            m = tl.full([BN], float('-inf'), DT)
            z = tl.zeros([BN], dtype=DT)
            h = tl.zeros([BN, BC], dtype=DT)
            for r in range(R):
                k = _tile(cand, kt * R + r, offs, mask, DT)
                # rms_r = sqrt(mean(k_r^2) + eps) (kept for backward: the key streams' only) ;
                # s_r = (k_r . u) / rms_r
                rms_r = tl.sqrt(tl.sum(k * k, 1) / C + eps)
                tl.store(rms + (kt * R + r) * N + n, rms_r, mask=rows)
                s = tl.sum(k * ut[None, :], 1) / rms_r
                tl.store(sc + (t * R + r) * N + n, s, mask=rows)
                m_new = tl.maximum(m, s)
                z = z * tl.exp(m - m_new) + tl.exp(s - m_new)
                h = h * tl.exp(m - m_new)[:, None] + tl.exp(s - m_new)[:, None] * _tile(cand, vt * R + r, offs, mask, DT)
                m = m_new
            # x += gate_t h
            xn += (tl.load(gt + t) / z)[:, None] * h
        tl.store(x + offs, xn, mask=mask)

    @triton.jit
    def _coefficients(t, r, kt, gt_t, sa_t, a, q, sc, rms, n, rows, N, C, R):
        """Of target t and candidate r: c_r = a_r gate (q_r - sum_p a_p q_p) / rms_r, the key part's
        -c_r s_r / (C rms_r), and the value part's gate a_r."""
        i = (t * R + r) * N + n
        ar = tl.load(a + i, mask=rows, other=0.0)
        rh = tl.load(rms + (kt * R + r) * N + n, mask=rows, other=1.0)
        cr = ar * gt_t * (tl.load(q + i, mask=rows, other=0.0) - sa_t) / rh
        return cr, -cr * tl.load(sc + i, mask=rows, other=0.0) / (C * rh), gt_t * ar

    @triton.jit(do_not_specialize=['R', 'N'], do_not_specialize_on_alignment=TABLES)
    def _read_bwd(dx, cand, ca, yb, cb, u, ks, vs, gt, a, sc, rms, gin, gout, q, sa, du, dgate, N, C, R, S,
                  TN: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
        # a fixed number of programs, each over every num_programs-th block of BN tokens: du and
        # dgate summed in registers, one partial per program
        N = N.to(tl.int64)
        pid = tl.program_id(0)
        c = tl.arange(0, BC)
        k0, v0, g0 = tl.load(ks), tl.load(vs), tl.load(gt)
        u0 = tl.load(u + c, mask=c < C, other=0.0)
        du0, aq0 = tl.zeros([BC], dtype=DT), tl.zeros([BN], dtype=DT)
        if TN == 2:
            k1, v1, g1 = tl.load(ks + 1), tl.load(vs + 1), tl.load(gt + 1)
            u1 = tl.load(u + C + c, mask=c < C, other=0.0)
        du1, aq1 = tl.zeros([BC], dtype=DT), tl.zeros([BN], dtype=DT)
        for block in range(pid, tl.cdiv(N, BN), tl.num_programs(0)):
            n = (block * BN + tl.arange(0, BN)).to(tl.int64)
            rows = n < N
            mask = rows[:, None] & (c < C)[None, :]
            offs = n[:, None] * C + c[None, :]
            d = tl.load(dx + offs, mask=mask, other=0.0).to(DT)
            # q_r = dx . v_r ; sum_r a_r q_r per token (sa), and over the tokens (dgate / scale)
            for t in tl.static_range(TN):
                vt = tl.load(vs + t)
                aq = tl.zeros([BN], dtype=DT)
                for r in range(R):
                    qr = tl.sum(d * _candidate(cand, ca, yb, cb, vt * R + r, offs, c, mask, C, DT), 1)
                    tl.store(q + (t * R + r) * N + n, qr, mask=rows)
                    aq += tl.load(a + (t * R + r) * N + n, mask=rows, other=0.0) * qr
                tl.store(sa + t * N + n, aq, mask=rows)
                if t == 0:
                    aq0 += aq
                else:
                    aq1 += aq
            tl.debug_barrier() # q and sa, stored above by other threads of the program, read below
            sa0 = tl.load(sa + n, mask=rows, other=0.0)
            if TN == 2:
                sa1 = tl.load(sa + N + n, mask=rows, other=0.0)
            # per candidate: out = in + dk_r + dv_r of every target keyed or valued there, and du_t
            for i in range(S * R):
                s, r = i // R, i % R
                k = _candidate(cand, ca, yb, cb, i, offs, c, mask, C, DT)
                out = _tile(gin, i, offs, mask, DT)
                cr, kk, w = _coefficients(0, r, k0, g0, sa0, a, q, sc, rms, n, rows, N, C, R)
                key, value = (k0 == s).to(DT), (v0 == s).to(DT)
                # dk_r = c_r (u - s_r k_r / (C rms_r)) ; dv_r = gate a_r dx ; du_t += c_r k_r
                out += key * (kk[:, None] * k + cr[:, None] * u0[None, :]) + value * w[:, None] * d
                du0 += key * tl.sum(cr[:, None] * k, 0)
                if TN == 2:
                    cr, kk, w = _coefficients(1, r, k1, g1, sa1, a, q, sc, rms, n, rows, N, C, R)
                    key, value = (k1 == s).to(DT), (v1 == s).to(DT)
                    out += key * (kk[:, None] * k + cr[:, None] * u1[None, :]) + value * w[:, None] * d
                    du1 += key * tl.sum(cr[:, None] * k, 0)
                addr = tl.load(gout + i)
                tl.store(addr.to(tl.pointer_type(DT)) + offs, out, mask=mask)
        tl.store(du + pid * TN * C + c, du0, mask=c < C)
        tl.store(dgate + pid * TN, tl.sum(aq0, 0))
        if TN == 2:
            tl.store(du + (pid * TN + 1) * C + c, du1, mask=c < C)
            tl.store(dgate + pid * TN + 1, tl.sum(aq1, 0))

    @triton.jit
    def _write_fwd(P0, P1, y, beta, rho, o0, o1, N, C, HAS_P: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
        n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN) # (offsets past 2**31 at scale)
        c = tl.arange(0, BC)
        mask = (n < N)[:, None] & (c < C)[None, :]
        offs = n[:, None] * C + c[None, :]
        DT = o0.dtype.element_ty # fp32 (fp64 stays fp64); y may be bf16
        yv = tl.load(y + offs, mask=mask, other=0.0).to(DT)
        b0 = tl.load(beta + c, mask=c < C, other=0.0).to(DT)[None, :]
        b1 = tl.load(beta + C + c, mask=c < C, other=0.0).to(DT)[None, :]
        if HAS_P:
            # P^0' = rho P^0 + (1-rho) P^1 + beta^0 y ; P^1' = (1-rho) P^0 + rho P^1 + beta^1 y
            r = tl.load(rho).to(DT)
            p0 = tl.load(P0 + offs, mask=mask, other=0.0).to(DT)
            p1 = tl.load(P1 + offs, mask=mask, other=0.0).to(DT)
            tl.store(o0 + offs, r * p0 + (1 - r) * p1 + b0 * yv, mask=mask)
            tl.store(o1 + offs, (1 - r) * p0 + r * p1 + b1 * yv, mask=mask)
        else: # a block starts: P^j' = beta^j y
            tl.store(o0 + offs, b0 * yv, mask=mask)
            tl.store(o1 + offs, b1 * yv, mask=mask)

    @triton.jit
    def _write_bwd(P0, P1, y, beta, rho, d0, d1, dP0, dP1, dy, dbeta, drho, N, C, HAS_P: tl.constexpr,
                   BN: tl.constexpr, BC: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        n = pid * BN + tl.arange(0, BN)
        c = tl.arange(0, BC)
        mask = (n < N)[:, None] & (c < C)[None, :]
        offs = n[:, None] * C + c[None, :]
        DT = d0.dtype.element_ty
        yv = tl.load(y + offs, mask=mask, other=0.0).to(DT)
        g0 = tl.load(d0 + offs, mask=mask, other=0.0)
        g1 = tl.load(d1 + offs, mask=mask, other=0.0).to(DT)
        b0 = tl.load(beta + c, mask=c < C, other=0.0).to(DT)[None, :]
        b1 = tl.load(beta + C + c, mask=c < C, other=0.0).to(DT)[None, :]
        # dy = beta^0 d0 + beta^1 d1 ; dbeta^j = sum over tokens of y d_j (this program's part)
        tl.store(dy + offs, b0 * g0 + b1 * g1, mask=mask)
        tl.store(dbeta + pid * 2 * C + c, tl.sum(yv * g0, 0), mask=c < C)
        tl.store(dbeta + (pid * 2 + 1) * C + c, tl.sum(yv * g1, 0), mask=c < C)
        if HAS_P:
            # dP^0 = rho d0 + (1-rho) d1 ; dP^1 = (1-rho) d0 + rho d1 ; drho = sum (P^0 - P^1) . (d0 - d1)
            r = tl.load(rho).to(DT)
            tl.store(dP0 + offs, r * g0 + (1 - r) * g1, mask=mask)
            tl.store(dP1 + offs, (1 - r) * g0 + r * g1, mask=mask)
            p0 = tl.load(P0 + offs, mask=mask, other=0.0).to(DT)
            p1 = tl.load(P1 + offs, mask=mask, other=0.0).to(DT)
            tl.store(drho + pid, tl.sum(tl.sum((p0 - p1) * (g0 - g1), 1), 0))

# 8 warps, and tiles of these many values: no register spills on sm_90 (docs/gpu.md)
WARPS, READ_FWD_TILE, READ_BWD_TILE, WRITE_TILE = 8, 2048, 1024, 4096

def blocks(C, tile):
    """Tokens a program (BN) and the row width padded to a power of two (BC), for width C."""
    BC = triton.next_power_of_2(C)
    return max(1, tile // BC), BC

def programs(device, N, BN):
    """A fixed grid for the kernels that sum over the tokens: two programs per multiprocessor, as
    many as fit at once (sm_90: 128 registers a thread, 8 warps); the interpreter: three, so that
    each takes several blocks."""
    most = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 3
    return min(triton.cdiv(N, BN), most)

def on_device(device):
    """The kernels launch on torch's current CUDA device: make it the tensors'."""
    return torch.cuda.device(device) if device.type == 'cuda' else contextlib.nullcontext()

def launch(kernel, grid, args, device, **constants):
    """kernel over grid programs, on the tensors' device."""
    with on_device(device):
        kernel[(grid,)](*args, **constants, num_warps=WARPS)

def compute_type(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32

def triton_failed(e):
    """A kernel that did not compile or launch (a Triton or driver this code has not met): one line,
    then torch ops for every read. Under the interpreter (the tests) the error stands."""
    if INTERPRET:
        raise e
    last = (str(e).strip().splitlines() or [''])[-1]
    print(f"depth_op: the Triton kernels failed ({type(e).__name__}: {last}); depth reads run as torch ops, slower")
    _triton_failed.append(e)

def by_triton(run, device_type, *args):
    """run(*args), a Triton wrapper below, with autocast off (its torch ops in the compute dtype);
    None where the kernels failed (triton_failed): the caller goes on to its other bodies."""
    try:
        with torch.autocast(device_type, enabled=False):
            return run(*args)
    except Exception as e:
        triton_failed(e)

def triton_dtype(tensors):
    return torch.float64 if tensors[0].dtype == torch.float64 else torch.float32

def tables(device, *parts):
    """Tables of int64 on device, one per part, each a list of ints or of tensors (their
    addresses; None: 0): sent in one copy."""
    values = [[0 if t is None else t if isinstance(t, int) else t.data_ptr() for t in part] for part in parts]
    # pinned, so the copy does not wait for the GPU (from pageable memory it would, each call)
    sent = torch.tensor(sum(values, []), dtype=torch.int64, pin_memory=device.type == 'cuda').to(device, non_blocking=True)
    return sent.split([len(v) for v in values])

def triton_inputs(ws, g, cand, R, routes, gates, scale):
    """The compute dtype, the candidates in it (contiguous), u (J, C) and scale * gate_t (J,), on
    the candidates' device."""
    dtype = triton_dtype(cand)
    cand = [k.to(dtype).contiguous() for k in cand]
    device, Tn = cand[0].device, len(ws)
    u = g.to(dtype) * torch.stack(ws).to(dtype) # u_t = g * w_t
    gt = scale * (torch.stack(gates).to(dtype) if gates else torch.ones(Tn, dtype=dtype, device=device))
    return dtype, cand, u.contiguous(), gt.contiguous()

def read_forward_triton(ws, g, cand, R, routes, gates, eps, scale):
    S, Tn = len(cand) // R, len(ws)
    dtype, cand, u, gt = triton_inputs(ws, g, cand, R, routes, gates, scale)
    N, C = cand[0].numel() // cand[0].size(-1), cand[0].size(-1)
    x = torch.empty(cand[0].shape, dtype=dtype, device=cand[0].device)
    # the kernel takes the rms of the streams read as keys (backward's): the others' stay 0
    s, rms = x.new_empty((Tn, R, N)), x.new_empty((S, R, N)) if set(routes[0::2]) == set(range(S)) else x.new_zeros((S, R, N))
    addrs, ks, vs = tables(x.device, cand, routes[0::2], routes[1::2])
    BN, BC = blocks(C, READ_FWD_TILE)
    launch(_read_fwd, triton.cdiv(N, BN), (addrs, u, ks, vs, gt, x, s, rms, N, C, R, S, eps), x.device,
           TN=Tn, BN=BN, BC=BC, DT=compute_type(dtype))
    shape = (R, *cand[0].shape[:-1])
    return x, s.softmax(1).view(Tn, *shape), s.view(Tn, *shape), rms.view(S, *shape)

def read_backward_triton(dx, ws, g, cand, terms_of, R, routes, gates, a, s, rms, gin, gout, scale):
    """dw (J, C), dg and dgate (J,); the candidates' gradients written to gout (in place: gin). A
    candidate with terms (y_a, c_a, y_b, c_b) is made by the kernel as it reads it (cand: y_a)."""
    S, Tn = len(cand) // R, len(ws)
    dtype, cand, u, gt = triton_inputs(ws, g, cand, R, routes, gates, scale)
    ca, yb, cb = term_parts(terms_of, dtype)
    N, C, device = cand[0].numel() // cand[0].size(-1), cand[0].size(-1), cand[0].device
    # a handle's gradient that holds no data (an expanded zero) adds nothing: no address
    gin = [None if t is None or max(t.stride()) == 0 else t.contiguous() for t in gin]
    q, sa = a.new_empty((Tn, R, N), dtype=dtype), a.new_empty((Tn, N), dtype=dtype)
    BN, BC = blocks(C, READ_BWD_TILE)
    grid = programs(device, N, BN)
    du, dgate = a.new_empty((grid, Tn, C), dtype=dtype), a.new_empty((grid, Tn), dtype=dtype)
    # (the tensors behind the addresses held by their names here until the kernel is queued)
    addrs, *made, ks, vs, gin_addrs, gout_addrs = tables(device, cand, ca, yb, cb, routes[0::2], routes[1::2], gin, gout)
    args = (dx.contiguous(), addrs, *made, u, ks, vs, gt, a.contiguous(), s.contiguous(), rms.contiguous(), gin_addrs,
            gout_addrs, q, sa, du, dgate, N, C, R, S)
    launch(_read_bwd, grid, args, device, TN=Tn, BN=BN, BC=BC, DT=compute_type(dtype))
    # dw_t = du_t * g ; dg = sum_t du_t * w_t ; dgate_t = scale sum_r a_r q_r
    du, dgate = du.sum(0), scale * dgate.sum(0)
    dws = [(du[t] * g.to(dtype)).to(w.dtype) for t, w in enumerate(ws)]
    dg = (du * torch.stack(ws).to(dtype)).sum(0).to(g.dtype)
    return dws, dg, [dgate[t].to(gt.dtype) for t, gt in enumerate(gates)]

def write_forward_triton(P, y, beta, rho):
    N, C = y.numel() // y.size(-1), y.size(-1)
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in write_inputs(P, y, beta, rho)])
    out = [torch.empty(y.shape, dtype=dtype, device=y.device) for _ in range(2)]
    BN, BC = blocks(C, WRITE_TILE)
    # (without partials, the kernel reads none: out and beta stand in for P and rho)
    args = (*([p.contiguous() for p in P] or out), y.contiguous(), beta.contiguous(), beta if rho is None else rho, *out, N, C)
    launch(_write_fwd, triton.cdiv(N, BN), args, y.device, HAS_P=bool(P), BN=BN, BC=BC)
    return out

def write_backward_triton(P, y, beta, rho, d0, d1):
    N, C = y.numel() // y.size(-1), y.size(-1)
    BN, BC = blocks(C, WRITE_TILE)
    grid = triton.cdiv(N, BN)
    dtype = triton_dtype([d0])
    d0, d1, y, beta = d0.to(dtype).contiguous(), d1.to(dtype).contiguous(), y.contiguous(), beta.contiguous()
    dP, dy = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in P], torch.empty_like(y)
    dbeta, drho = d0.new_empty((grid, 2, C)), d0.new_empty(grid)
    # (without partials, the kernel reads and writes none: d0, d1 and beta stand in)
    args = (*([p.contiguous() for p in P] or [d0, d1]), y, beta, beta if rho is None else rho, d0, d1, *(dP or [d0, d1]),
            dy, dbeta, drho, N, C)
    launch(_write_bwd, grid, args, y.device, HAS_P=bool(P), BN=BN, BC=BC)
    return dP, dy, dbeta.sum(0).to(beta.dtype), drho.sum().to(rho.dtype) if P else None

# -----------------------------------------------------------------------------
# the read, forward and backward: by depth_op.cpp or by torch ops. S streams of R candidates, cand
# flat (stream s's candidate r at s * R + r); J targets, target t reading the keys of stream
# routes[2t] and the values of stream routes[2t + 1], with the query row ws[t], the key-norm weight
# g and the gate gates[t] (no gates: 1).

def read_forward(ws, g, cand, R, routes, gates, eps, scale=1.0):
    """x = scale sum_t gate_t h_t, the weights a and scores s (J, R, B, T), the keys' rms (S, R, B, T)."""
    S, Tn, dtype = len(cand) // R, len(ws), cand[0].dtype
    ks, vs = routes[0::2], routes[1::2]
    if on_triton(cand + ws + gates + [g]):
        out = by_triton(read_forward_triton, g.device.type, ws, g, cand, R, routes, gates, eps, scale)
        if out is not None:
            return out
    if on_kernel(cand + ws + gates + [g]):
        # (every tensor the kernel reads held by a name here, alive through the call)
        cand, ws, g = [t.contiguous() for t in cand], [t.contiguous() for t in ws], g.contiguous()
        x = torch.empty_like(cand[0])
        a, s = (cand[0].new_empty((Tn, R, *cand[0].shape[:-1])) for _ in range(2))
        rms = cand[0].new_empty((S, R, *cand[0].shape[:-1]))
        fn = library().forward_double if dtype == torch.float64 else library().forward_float
        fn(*map(ctypes.c_int64, (S, R, Tn, x.numel() // x.size(-1), x.size(-1))), ptrs(cand), ptr(g), ptrs(ws),
           int64s(ks), int64s(vs), ptrs(gates) if gates else None, ctypes.c_double(scale), ctypes.c_double(eps),
           ptr(x), ptr(a), ptr(s), ptr(rms), ctypes.c_int(torch.get_num_threads()))
        return x, a, s, rms
    return read_torch(ws, g, cand, R, routes, gates, eps, scale)

def read_torch(ws, g, cand, R, routes, gates, eps, scale=1.0):
    """read_forward in torch ops."""
    S, Tn = len(cand) // R, len(ws)
    ks, vs = routes[0::2], routes[1::2]
    with torch.autocast(g.device.type, enabled=False): # the caller's autocast would reach in here
        u = [fp32(g) * fp32(w) for w in ws]
        # rms_r = sqrt(mean(k_r^2) + eps), fp32
        rms = torch.stack([torch.sqrt(fp32(k).pow(2).mean(-1) + eps) for k in cand]).unflatten(0, (S, R))
        a, s, x = [], [], 0
        for t in range(Tn):
            # s_r = (k_r . u) / rms_r
            keys, values = cand[ks[t] * R:(ks[t] + 1) * R], cand[vs[t] * R:(vs[t] + 1) * R]
            s.append(torch.stack([(fp32(k) * u[t]).sum(-1) for k in keys]) / rms[ks[t]])
            # a = softmax_r(s)
            a.append(s[-1].softmax(0))
            # x += gate_t sum_r a_r v_r
            weights = a[-1] if not gates else a[-1] * gates[t]
            x = x + sum(wr.unsqueeze(-1) * v for wr, v in zip(weights, values))
    return scale * x, torch.stack(a), torch.stack(s), rms

def term_parts(terms_of, dtype):
    """Per candidate, its c_a, y_b, c_b (terms (y_a, c_a, y_b, c_b)) in dtype, contiguous, as the
    kernels read them: None where a candidate is a tensor, or has one term."""
    return ([None if not p or p[i] is None else p[i].to(dtype).contiguous() for p in terms_of] for i in (1, 2, 3))

def read_backward(dx, ws, g, cand, R, routes, gates, a, s, rms, dS, scale=1.0, in_place=False):
    """From dx and the incoming gradients dS of the S handles (n, B, T, C; n = R or R - 1): the
    gradients of ws, g and gates, the handles' gradients (n slots of each stream), and, where the
    last candidate is a partial (n = R - 1), the partials' gradients. x = scale * (the sum): the
    backward of the sum from scale * dx. in_place: a handle's gradient is added into dS where dS
    holds data (eager: one buffer per stream for the whole backward, not a new one per read). A
    candidate given as terms (y_a, c_a, y_b, c_b) (assemble) is made as it is read, token by token,
    by depth_op.cpp and the Triton kernel; as a tensor first by the torch ops."""
    terms_of = [() if torch.is_tensor(c) else c for c in cand]
    cand = [c if torch.is_tensor(c) else c[0] for c in cand] # (as read by depth_op.cpp: y_a)
    S, Tn, n, dtype = len(cand) // R, len(ws), dS[0].size(0), cand[0].dtype
    ks, vs = routes[0::2], routes[1::2]
    gS = [d if in_place and d.is_contiguous() else torch.empty_like(d, memory_format=torch.contiguous_format)
          for d in dS]
    dP = [torch.empty_like(cand[0], memory_format=torch.contiguous_format) for _ in range(S)] if n < R else []
    # where each candidate's gradient goes, and what it adds to: its handle's slot, or a partial's
    gout = [t for j in range(S) for t in [*gS[j].unbind(0), *dP[j:j + 1]]]
    gin = [t for j in range(S) for t in [*dS[j].unbind(0), None][:R]]
    if on_triton(cand + ws + gates + [g, dx]) and all(t.dtype == triton_dtype(cand) for t in gout):
        out = by_triton(read_backward_triton, g.device.type, dx, ws, g, cand, terms_of, R, routes, gates, a, s, rms, gin,
                        gout, scale)
        if out is not None:
            return *out, gS, dP
    parts = [t for p in terms_of for t in p[1:] if t is not None] # the terms' coefficients and y_b
    if on_kernel(cand + parts + ws + gates + [g, dx] + dS): # (all of one dtype: so are dw, dg and dgate)
        # (every tensor the kernel reads held by a name here, alive through the call)
        cand, ws, g, dx = [t.contiguous() for t in cand], [t.contiguous() for t in ws], g.contiguous(), dx.contiguous()
        gin, a, s, rms = [t if t is None else t.contiguous() for t in gin], a.contiguous(), s.contiguous(), rms.contiguous()
        c_a, y_b, c_b = term_parts(terms_of, dtype)
        dw, dg, dgate = cand[0].new_empty((Tn, g.size(-1))), g.new_empty(g.shape), cand[0].new_empty(Tn)
        fn = library().backward_double if dtype == torch.float64 else library().backward_float
        fn(*map(ctypes.c_int64, (S, R, Tn, dx.numel() // dx.size(-1), dx.size(-1))), ptr(dx), ptrs(cand), ptrs(c_a),
           ptrs(y_b), ptrs(c_b), ptr(g), ptrs(ws), int64s(ks), int64s(vs), ptrs(gates) if gates else None,
           ctypes.c_double(scale), ptr(a), ptr(s), ptr(rms), ptrs(gout), ptrs(gin), ptr(dw), ptr(dg), ptr(dgate),
           ctypes.c_int(torch.get_num_threads()))
        return list(dw.unbind(0)), dg, list(dgate.unbind(0)) if gates else [], gS, dP
    cand = [make(*p) if p else c for c, p in zip(cand, terms_of)]
    with torch.autocast(g.device.type, enabled=False):
        u = [fp32(g) * fp32(w) for w in ws]
        dx = scale * fp32(dx)
        grads = [0 if t is None else fp32(t) for t in gin]
        du, dgate = [], []
        for t in range(Tn):
            keys, values = cand[ks[t] * R:(ks[t] + 1) * R], cand[vs[t] * R:(vs[t] + 1) * R]
            gate = 1 if not gates else gates[t]
            # q_r = dx . v_r ; dgate_t = sum_r a_r q_r ; da_r = gate_t q_r
            q = torch.stack([torch.linalg.vecdot(dx, fp32(v)) for v in values])
            dgate.append((a[t] * q).sum())
            da = gate * q
            # c_r = a_r (da_r - sum_p a_p da_p) / rms_r
            c = a[t] * (da - (a[t] * da).sum(0)) / rms[ks[t]]
            du.append(sum(cr.flatten() @ fp32(k).flatten(0, -2) for cr, k in zip(c, keys)))
            for r in range(R):
                # dk_r = c_r (u - s_r k_r / (C rms_r)) ; dv_r = gate_t a_r dx
                k = fp32(keys[r])
                dk = c[r].unsqueeze(-1) * (u[t] - (s[t, r] / (k.size(-1) * rms[ks[t], r])).unsqueeze(-1) * k)
                grads[ks[t] * R + r] = grads[ks[t] * R + r] + dk
                grads[vs[t] * R + r] = grads[vs[t] * R + r] + (gate * a[t, r]).unsqueeze(-1) * dx
        for out, grad in zip(gout, grads):
            out.copy_(grad)
        du, dgate = torch.stack(du), torch.stack(dgate)
    # dw_t = du_t * g ; dg = sum_t du_t * w_t
    dws = [(du[t] * g).to(w.dtype) for t, w in enumerate(ws)]
    dg = sum(du[t] * w for t, w in enumerate(ws)).to(g.dtype)
    dgates = [dgate[t].to(gt.dtype, copy=True) for t, gt in enumerate(gates)]
    return dws, dg, dgates, gS, dP

def split(tensors, counts):
    """Consecutive lists of the given lengths from one flat sequence."""
    out, i = [], 0
    for c in counts:
        out.append(list(tensors[i:i + c]))
        i += c
    return out

# -----------------------------------------------------------------------------
# DAR's partials and entries made again in backward from the writes that made them, instead of kept

def recorded(made, y, beta, rho):
    """The terms (ys, cs) of the partials after DAR's write of y (model.DAR.write), from those
    before it (None: P = 0): P^j = sum_i c^j_i y_i, cs = [c^0_1, c^1_1, c^0_2, ...], each (C,).
    Each coefficient computed once, at its write, not again at every read of the entry; compiled,
    as an operation: no code generated for it (docs/bench.md). Without grad, none (nothing made)."""
    if not torch.is_grad_enabled():
        return None
    if made is None: # P^j <- beta^j y
        return [y], [beta[0], beta[1]]
    ys, cs = made
    cs, rho = [c.detach() for c in cs], rho.detach()
    return ys + [y], (_mixed(cs, rho) if torch.compiler.is_compiling() else mixed(cs, rho)) + [beta[0], beta[1]]

def mixed(cs, rho):
    # P^0 <- rho P^0 + (1-rho) P^1 + beta^0 y ; P^1 <- (1-rho) P^0 + rho P^1 + beta^1 y, term by term
    return [c for c0, c1 in zip(cs[0::2], cs[1::2]) for c in (rho * c0 + (1 - rho) * c1, (1 - rho) * c0 + rho * c1)]

@torch.library.custom_op('dar::mixed', mutates_args=())
def _mixed(cs: list[torch.Tensor], rho: torch.Tensor) -> list[torch.Tensor]:
    return mixed(cs, rho)

@_mixed.register_fake
def _(cs, rho):
    return [torch.empty_like(c) for c in cs]

def recipe(made):
    """Flat ys, cs and lengths (terms) of the terms (ys, cs) of candidates."""
    return [y for ys, _ in made for y in ys], [c for _, cs in made for c in cs], [len(ys) for ys, _ in made]

def terms(ys, cs, lengths):
    """Per candidate of one or two terms (model.py: blocks of 1, 2), per stream j, P^j as
    (y_a, c^j_a, y_b, c^j_b): P^j = c^j_a y_a + c^j_b y_b (one term: y_b, c^j_b None)."""
    made, term = [], iter(zip(ys, cs[0::2], cs[1::2])) # (y_i, c^0_i, c^1_i)
    for n in lengths:
        a, b = next(term), next(term) if n == 2 else (None, None, None)
        made.append([(a[0], a[1 + j], b[0], b[1 + j]) for j in range(2)])
    return made

def make(y_a, c_a, y_b, c_b):
    """A candidate from its terms: c_a y_a + c_b y_b (y_b None: c_a y_a)."""
    return c_a * y_a if y_b is None else c_a * y_a + c_b * y_b

def made_partials(ys, cs):
    """[P^0, P^1] made again from the terms (ys, cs) of the block's writes before this one."""
    return [make(*t) for t in terms(ys, cs, [len(ys)])[0]]

def assemble(kept, R, S, replayed, ys, cs, lengths):
    """The flat candidates (stream j's r at j * R + r): where r = replayed[i], the terms of stream
    j's, made again from the writes; else the next kept one (a tensor)."""
    made, kept = terms(ys, cs, lengths), iter(kept)
    return [made[replayed.index(r)][j] if r in replayed else next(kept) for j in range(S) for r in range(R)]

# -----------------------------------------------------------------------------
# eager: an autograd.Function (a fraction of a custom operation's dispatch cost)

class DepthRead(torch.autograd.Function):

    @staticmethod
    def forward(ctx, g, R, routes, eps, scale, counts, lengths, replayed, *tensors):
        ws, gates, handles, partials, cand, ys, cs = split(tensors, counts)
        x, a, s, rms = read_forward(ws, g, cand, R, routes, gates, eps, scale)
        kept = [c for i, c in enumerate(cand) if i % R not in replayed] # the others: made again
        ctx.save_for_backward(g, a, s, rms, *ws, *gates, *kept, *ys, *cs)
        ctx.mark_non_differentiable(a, s, rms)
        ctx.R, ctx.routes, ctx.scale, ctx.lengths, ctx.replayed = R, routes, scale, lengths, replayed
        ctx.counts = (*counts[:2], len(kept), *counts[5:])
        return x, a, s, rms, *[passed_on(S) for S in handles]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dx, da, ds, drms, *dS):
        g, a, s, rms, *rest = ctx.saved_tensors
        ws, gates, kept, ys, cs = split(rest, ctx.counts)
        cand = assemble(kept, ctx.R, len(dS), ctx.replayed, ys, cs, ctx.lengths)
        dws, dg, dgates, gS, dP = read_backward(dx, ws, g, cand, ctx.R, ctx.routes, gates, a, s, rms, list(dS), ctx.scale,
                                                   in_place=True)
        return (dg, *[None] * 7, *dws, *dgates, *gS, *dP, *[None] * (len(cand) + len(ys) + len(cs)))

# -----------------------------------------------------------------------------
# compiled: custom operations, forward and backward, opaque to the compiler

@torch.library.custom_op('dar::fused_read', mutates_args=())
def _read(ws: list[torch.Tensor], g: torch.Tensor, cand: list[torch.Tensor], R: int, routes: list[int],
          gates: list[torch.Tensor], eps: float, scale: float, handles: list[torch.Tensor],
          partials: list[torch.Tensor], ys: list[torch.Tensor], cs: list[torch.Tensor], lengths: list[int],
          replayed: list[int]) -> list[torch.Tensor]:
    x, a, s, rms = read_forward(ws, g, cand, R, routes, gates, eps, scale)
    return [x, a, s, rms, *[passed_on(S) for S in handles]]

@_read.register_fake
def _(ws, g, cand, R, routes, gates, eps, scale, handles, partials, ys, cs, lengths, replayed):
    v = cand[0]
    x = v.new_empty(v.shape, dtype=torch.promote_types(v.dtype, torch.float32))
    a, s = (x.new_empty((len(ws), R, *v.shape[:-1])) for _ in range(2))
    rms = x.new_empty((len(cand) // R, R, *v.shape[:-1]))
    return [x, a, s, rms, *[passed_on(S) for S in handles]]

@torch.library.custom_op('dar::fused_read_backward', mutates_args=())
def _read_backward(dx: torch.Tensor, ws: list[torch.Tensor], g: torch.Tensor, kept: list[torch.Tensor], R: int,
                   routes: list[int], gates: list[torch.Tensor], a: torch.Tensor, s: torch.Tensor, rms: torch.Tensor,
                   dS: list[torch.Tensor], scale: float, ys: list[torch.Tensor], cs: list[torch.Tensor],
                   lengths: list[int], replayed: list[int]) -> list[torch.Tensor]:
    cand = assemble(kept, R, len(dS), replayed, ys, cs, lengths)
    dws, dg, dgates, gS, dP = read_backward(dx, ws, g, cand, R, routes, gates, a, s, rms, dS, scale)
    # (a custom operation's outputs are tensors of their own: the kernel's rows are views)
    return [*[t.clone() for t in dws], dg, *[t.clone() for t in dgates], *gS, *dP]

@_read_backward.register_fake
def _(dx, ws, g, kept, R, routes, gates, a, s, rms, dS, scale, ys, cs, lengths, replayed):
    # (kept[0] is e, H^j_0: never made again)
    partial = [torch.empty_like(kept[0]) for _ in dS] if dS[0].size(0) < R else []
    return ([torch.empty_like(w) for w in ws] + [torch.empty_like(g)] + [torch.empty_like(t) for t in gates]
            + [torch.empty_like(d) for d in dS] + partial)

def _setup_context(ctx, inputs, output):
    ws, g, cand, R, routes, gates, eps, scale, handles, partials, ys, cs, lengths, replayed = inputs
    kept = [c for i, c in enumerate(cand) if i % R not in replayed] # the others: made again
    ctx.save_for_backward(g, *output[1:4], *ws, *gates, *kept, *ys, *cs)
    ctx.mark_non_differentiable(*output[1:4])
    ctx.R, ctx.routes, ctx.scale, ctx.lengths, ctx.replayed = R, routes, scale, lengths, replayed
    ctx.counts = (len(ws), len(gates), len(kept), len(ys), len(cs), len(handles), len(partials), len(cand))

def _backward(ctx, grads):
    g, a, s, rms, *rest = ctx.saved_tensors
    Tn, nG, nK, nY, nCs, S, nP, nC = ctx.counts
    ws, gates, kept, ys, cs = split(rest, (Tn, nG, nK, nY, nCs))
    out = _read_backward(grads[0], ws, g, kept, ctx.R, ctx.routes, gates, a, s, rms, list(grads[4:]), ctx.scale,
                         ys, cs, ctx.lengths, ctx.replayed)
    dws, dg, dgates, gS, dP = split(out, (Tn, 1, nG, S, nP))
    # the candidates get no gradient as data: it runs through the handles and partials
    # (a list of ints takes None, but an empty one [], as an empty list of tensors would)
    ints = [None if x else [] for x in (ctx.lengths, ctx.replayed)]
    return (dws, dg[0], [None] * nC, None, None, dgates, None, None, gS, dP, [None] * nY, [None] * nCs, *ints)

_read.register_autograd(_backward, setup_context=_setup_context)

def fused_read(ws, g, cand, key_streams, value_streams, gates, handles, eps, scale=1.0, made=None):
    """x = scale sum_t gate_t h_t, h_t = the read of target t by model.DepthState.depth_read's lines,
    as one operation. ws: the targets' query rows; g: the key-norm weight; cand: per stream, its R
    candidates, committed first (data: their gradients run through handles and partials);
    key_streams, value_streams: per target, the index in cand of the stream it takes its keys from
    and of the one it takes its values from (each stream is read once); gates: per target, or
    None; handles: per stream, the handle of its committed candidates (a stream with more
    candidates than its handle has entries ends in its partial block); eps: the key norm's; scale:
    a number (inside the operation, so that the code compiled around it is the same for every R);
    made: per candidate r, the terms (ys, cs) it is made of (recorded), or None: given, backward
    makes it again from them, so it is not kept. Returns x, the weights a (J, R, B, T) and the
    handles."""
    routes = [j for k, v in zip(key_streams, value_streams) for j in (k, v)] # flat: (k, v) per target
    R, flat, gates = len(cand[0]), sum(cand, []), gates or []
    if not torch.is_grad_enabled(): # no backward: no autograd, the handles as they are; compiled
        # (prefill, decode) traced, so that inductor fuses the reads: at a token a call costs more
        read = read_torch if torch.compiler.is_compiling() else read_forward
        x, a, _, _ = read(ws, g, flat, R, routes, gates, eps, scale)
        return x, a, handles
    partials = [c[-1] for c in cand] if R > handles[0].size(0) else [] # more than the committed
    replayed = [r for r in range(R) if made and made[r] is not None]
    ys, cs, lengths = recipe([made[r] for r in replayed])
    if torch.compiler.is_compiling():
        out = _read(ws, g, flat, R, routes, gates, eps, float(scale), handles, partials, ys, cs, lengths, replayed)
    else:
        counts = (len(ws), len(gates), len(handles), len(partials), len(flat), len(ys), len(cs))
        out = DepthRead.apply(g, R, routes, eps, scale, counts, lengths, replayed, *ws, *gates, *handles, *partials, *flat,
                              *ys, *cs)
    return out[0], out[1], list(out[4:])

# -----------------------------------------------------------------------------
# DAR's write (model.DAR.write, its definition) as one operation

def write_inputs(P, y, beta, rho):
    """The tensors a write reads: rho only with partials (a block's first write has none)."""
    return P + [y, beta] + ([rho] if P else [])

def write_args(P, y, beta, rho):
    """The arguments depth_op.cpp's write_forward and write_backward begin with: N, C, P^0, P^1,
    y, beta^0, beta^1, rho (null pointers for the partials and rho where a block starts)."""
    return (*map(ctypes.c_int64, (y.numel() // y.size(-1), y.size(-1))), *map(ptr, P or [None, None]), ptr(y),
            ptr(beta[0]), ptr(beta[1]), ptr(rho if P else None))

def write_forward(P, y, beta, rho):
    """[P^0', P^1'] from the partials P ([P^0, P^1], or [] where a block starts), the output y and
    the gates beta (2, C) and rho (a scalar; None with blocks of one)."""
    if on_triton(write_inputs(P, y, beta, rho)):
        out = by_triton(write_forward_triton, y.device.type, P, y, beta, rho)
        if out is not None:
            return out
    if on_kernel(write_inputs(P, y, beta, rho)):
        P, y, beta = [p.contiguous() for p in P], y.contiguous(), beta.contiguous()
        out = [torch.empty_like(y), torch.empty_like(y)]
        fn = library().write_forward_double if y.dtype == torch.float64 else library().write_forward_float
        fn(*write_args(P, y, beta, rho), *map(ptr, out), ctypes.c_int(torch.get_num_threads()))
        return out
    return write_torch(P, y, beta, rho)

def write_torch(P, y, beta, rho):
    """write_forward in torch ops."""
    if not P:
        return [beta[0] * y, beta[1] * y]
    return [rho * P[0] + (1 - rho) * P[1] + beta[0] * y, (1 - rho) * P[0] + rho * P[1] + beta[1] * y]

def write_backward(P, y, beta, rho, d):
    """From d = [dP^0', dP^1']: the partials' gradients (none without), dy, dbeta and drho:
        dP^0 = rho d0 + (1-rho) d1 ;  dP^1 = (1-rho) d0 + rho d1 ;  dy = beta^0 d0 + beta^1 d1
        dbeta^j = sum over (B, T) of y d_j ;  drho = sum (P^0 - P^1) . (d0 - d1)"""
    d0, d1 = [torch.zeros_like(y) if t is None else t for t in d]
    if on_triton(write_inputs(P, y, beta, rho) + [d0, d1]):
        out = by_triton(write_backward_triton, y.device.type, P, y, beta, rho, d0, d1)
        if out is not None:
            return out
    if on_kernel(write_inputs(P, y, beta, rho) + [d0, d1]):
        P, y, beta, d0, d1 = [p.contiguous() for p in P], y.contiguous(), beta.contiguous(), d0.contiguous(), d1.contiguous()
        dP, dy, dbeta = [torch.empty_like(p) for p in P], torch.empty_like(y), torch.empty_like(beta)
        drho = torch.empty_like(rho) if P else None
        fn = library().write_backward_double if y.dtype == torch.float64 else library().write_backward_float
        fn(*write_args(P, y, beta, rho), ptr(d0), ptr(d1), *map(ptr, dP or [None, None]), ptr(dy), ptr(dbeta[0]),
           ptr(dbeta[1]), ptr(drho), ctypes.c_int(torch.get_num_threads()))
        return dP, dy, dbeta, drho
    with torch.autocast(y.device.type, enabled=False):
        dy = (beta[0] * d0 + beta[1] * d1).to(y.dtype)
        dbeta = torch.stack([(y * d0).flatten(0, -2).sum(0), (y * d1).flatten(0, -2).sum(0)]).to(beta.dtype)
        if not P:
            return [], dy, dbeta, None
        dP = [(rho * d0 + (1 - rho) * d1).to(P[0].dtype), ((1 - rho) * d0 + rho * d1).to(P[1].dtype)]
        return dP, dy, dbeta, ((P[0] - P[1]) * (d0 - d1)).sum().to(rho.dtype)

class Write(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, beta, rho, counts, *tensors):
        P, ys, cs = split(tensors, counts)
        ctx.save_for_backward(y, beta, rho, *(ys + cs if ys else P)) # ys: P made again, not kept
        ctx.counts = counts
        return tuple(write_forward(P, y, beta, rho))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d0, d1):
        y, beta, rho, *kept = ctx.saved_tensors
        nP, nY, nCs = ctx.counts
        P = made_partials(*split(kept, (nY, nCs))) if nY else kept
        dP, dy, dbeta, drho = write_backward(P, y, beta, rho, [d0, d1])
        return dy, dbeta, drho, None, *dP, *[None] * (nY + nCs)

@torch.library.custom_op('dar::write', mutates_args=())
def _write(P: list[torch.Tensor], y: torch.Tensor, beta: torch.Tensor, rho: Optional[torch.Tensor],
           ys: list[torch.Tensor], cs: list[torch.Tensor]) -> list[torch.Tensor]:
    return write_forward(P, y, beta, rho)

@_write.register_fake
def _(P, y, beta, rho, ys, cs):
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in write_inputs(P, y, beta, rho)])
    return [y.new_empty(y.shape, dtype=dtype) for _ in range(2)]

@torch.library.custom_op('dar::write_backward', mutates_args=())
def _write_backward(P: list[torch.Tensor], y: torch.Tensor, beta: torch.Tensor, rho: Optional[torch.Tensor],
                    d: list[torch.Tensor], ys: list[torch.Tensor], cs: list[torch.Tensor]) -> list[torch.Tensor]:
    P = made_partials(ys, cs) if ys else P # ys: P made again
    dP, dy, dbeta, drho = write_backward(P, y, beta, rho, d)
    return [*dP, dy, dbeta, *([] if drho is None else [drho])]

@_write_backward.register_fake
def _(P, y, beta, rho, d, ys, cs):
    if ys: # P made again: write_forward's dtype over its writes
        P = 2 * [y.new_empty(y.shape, dtype=functools.reduce(torch.promote_types, [t.dtype for t in ys + cs]))]
    return [torch.empty_like(t) for t in write_inputs(P, y, beta, rho)]

def _write_setup(ctx, inputs, output):
    P, y, beta, rho, ys, cs = inputs
    ctx.save_for_backward(y, beta, rho, *(ys + cs if ys else P)) # ys: P made again, not kept
    ctx.counts = (len(P), len(ys), len(cs))

def _write_grad(ctx, d):
    y, beta, rho, *kept = ctx.saved_tensors
    n, nY, nCs = ctx.counts
    ys, cs = split(kept, (nY, nCs)) # both empty where P was kept
    out = _write_backward([] if nY else kept, y, beta, rho, list(d), ys, cs)
    return out[:n], out[n], out[n + 1], out[n + 2] if n else None, [None] * nY, [None] * nCs

_write.register_autograd(_write_grad, setup_context=_write_setup)

def write(P, y, beta, rho, made=None):
    """model.DAR.write's lines as one operation: the partials P ([P^0, P^1], or None where a block
    starts), the output y (B, T, C), beta = beta_l (2, C), rho = rho_l (a scalar tensor, or None with blocks
    of one); compiled for training, beta and rho are depth_op.rows' (their code is every
    sublayer's). made: the terms (ys, cs) P is made of (recorded), or None: given, backward makes P
    again from them (for rho's gradient), so P is not kept. Returns [P^0', P^1']."""
    P = P or []
    if torch.compiler.is_compiling() and not torch.is_grad_enabled():
        return write_torch(P, y, beta, rho) # inference: traced, fused with its neighbours
    if not torch.is_grad_enabled():
        return write_forward(P, y, beta, rho)
    ys, cs, _ = recipe([made] if P and made is not None else [])
    if torch.compiler.is_compiling():
        return _write(P, y, beta, rho, ys, cs)
    return list(Write.apply(y, beta, rho, (len(P), len(ys), len(cs)), *P, *ys, *cs))

# -----------------------------------------------------------------------------
# the handles

@torch.library.custom_op('dar::grow', mutates_args=())
def _grow(S: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return empty_handle(p, S.size(0) + 1)

@_grow.register_fake
def _(S, p):
    return empty_handle(p, S.size(0) + 1)

@torch.library.custom_op('dar::take', mutates_args=())
def _take(dS: torch.Tensor, n: int) -> torch.Tensor:
    return dS[n].clone()

@_take.register_fake
def _(dS, n):
    return dS.new_empty(dS.shape[1:])

def _grow_setup(ctx, inputs, output):
    ctx.n, ctx.dtype = inputs[0].size(0), inputs[1].dtype

def _grow_backward(ctx, dS):
    # S's gradient is the first n slots; p's, the last (as a tensor of its own: a view at a constant
    # offset would make the code that takes it new in every block)
    return dS[:ctx.n], _take(dS, ctx.n).to(ctx.dtype)

_grow.register_autograd(_grow_backward, setup_context=_grow_setup)

class Grow(torch.autograd.Function):

    @staticmethod
    def forward(ctx, S, p):
        ctx.n, ctx.dtype = S.size(0), p.dtype
        return empty_handle(p, S.size(0) + 1)

    @staticmethod
    def backward(ctx, dS):
        return dS[:ctx.n], dS[ctx.n].to(ctx.dtype)

def grow(S, p):
    """The handle S (n, B, T, C) of a history to which p is appended: (n + 1, B, T, C); S None: []."""
    if not torch.is_grad_enabled():
        return S # no backward, no handle
    S = empty_handle(p, 0) if S is None else S
    return _grow(S, p) if torch.compiler.is_compiling() else Grow.apply(S, p)

# -----------------------------------------------------------------------------
# a parameter's rows as tensors of their own, under torch.compile

@torch.library.custom_op('dar::rows', mutates_args=())
def _rows(p: torch.Tensor) -> list[torch.Tensor]:
    return [r.clone() for r in p]

@_rows.register_fake
def _(p):
    return [p.new_empty(p.shape[1:]) for _ in range(p.size(0))]

@torch.library.custom_op('dar::stack', mutates_args=())
def _stack(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(grads)

@_stack.register_fake
def _(grads):
    return grads[0].new_empty((len(grads), *grads[0].shape))

def _rows_setup(ctx, inputs, output):
    p, = inputs
    ctx.shape, ctx.dtype, ctx.device = p.shape[1:], p.dtype, p.device

def _rows_backward(ctx, grads):
    return _stack([torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device) if g is None else g for g in grads])

_rows.register_autograd(_rows_backward, setup_context=_rows_setup)

def rows(p, dims=1):
    """p's entries along its first dims dimensions, as nested lists. Compiled for training, each is
    a tensor of its own: an entry taken by index is a constant offset in the generated code, which
    would make each sublayer's kernels differ from the others' (inference reads are traced and
    fused with their neighbours anyway; there a call of the operation would cost more)."""
    flat = p.flatten(0, dims - 1)
    flat = _rows(flat) if torch.compiler.is_compiling() and torch.is_grad_enabled() else list(flat.unbind(0))
    for size in reversed(p.shape[1:dims]):
        flat = [flat[i:i + size] for i in range(0, len(flat), size)]
    return flat

# -----------------------------------------------------------------------------
# what the operations keep beside model.DepthState's H^j and P^j

class Tape:
    """A DepthState's bookkeeping for the operations' backward: per stream the handle of its
    committed entries (their gradient), and for DAR with blocks of K = 1 or 2 (remade) the terms
    each entry and the partial are made of (made[r]: H^j_r's; made[-1]: P^j's), so that backward
    makes them again instead of keeping them (with larger blocks, K writes each: kept)."""

    def __init__(self, e, streams, K):
        self.handle = [grow(None, e) for _ in range(streams)]
        self.made, self.remade = [None, None], streams == 2 and K <= 2

    def read(self, ws, g, cand, key_streams, value_streams, gates, eps, N):
        x, weights, self.handle = fused_read(ws, g, cand, key_streams, value_streams, gates, self.handle, eps, N,
                                             self.made)
        return x, weights

    def write(self, P, y, beta, rho):
        new = write(P, y, beta, rho, self.made[-1])
        if self.remade:
            self.made[-1] = recorded(self.made[-1], y, beta, rho)
        return new

    def commit(self, P):
        self.handle = [grow(S, p) for S, p in zip(self.handle, P)]
        self.made = self.made + [None]
