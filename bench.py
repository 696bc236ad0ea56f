"""
Speed and memory of the residual paths, side by side, against the standard residual.

$ python bench.py                            # Block AttnRes and Block DAR at the train.py default model
$ python bench.py --paths=all                # every path
$ python bench.py config/bench_shakespeare.py # nanoGPT's shakespeare_char width: 6 layers, 384 wide
$ python bench.py --moe=True --json_out=bench.json
$ python bench.py config/bench_gpu.py        # GPU-sized, bf16, compiled
$ python bench.py --report=loop              # train.py's step against a bare loop of the same model
$ python bench.py --report=compile --n_layer=12 --depth_block=4 # compile time, cold and warm cache
$ python bench.py --report=e2e               # python train.py against --residual=standard, start to exit
$ python bench.py config/bench_gpu.py --report=gpu # the GPU check: steps, first steps, memory, profiles, MoE

Per path and mode (compiled: torch.compile of the model, one graph per path; eager: none):
training step (forward + backward + AdamW), forward-only prefill, KV-cache decode per token
(compiled rows: the one-token step compiled once, as sample.py compiles it; the prefill before it runs eager),
peak memory, the tensors saved for backward, parameters, the warm-up time
(which holds the compilation), and MFU on CUDA. After the warm-up all rows run interleaved
(A B C A B C ...), so drift hits all alike; each ratio to standard in the same mode is taken
round by round and its median reported. Compiling a path takes about a minute on 2 CPU cores.
"""
import io
import os
import re
import sys
import json
import shlex
import signal
import tempfile
import contextlib
import time
import statistics
import subprocess

import numpy as np
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import depth_op
from model import GPT, GPTConfig, KVCache
from sample import compile_for_generation
from configurator import autocast, check, configure, count, keep_freed_memory, resolve_device
from train import main as train_main, DEFAULTS as TRAIN_DEFAULTS
from prepare_data import fail, write_pickle, write_tokens

# -----------------------------------------------------------------------------
# the train.py default model, on random tokens
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 12
vocab_size = 65
bias = False
depth_block = 2 # for the Block variants
moe = False # also run each path with an MoE of equal active parameters
paths = 'attnres-block,dar-block' # comma-separated, beside standard; 'all': every path
rounds = 10 # timed rounds per path
warmup = 2 # untimed rounds first
decode_tokens = 32 # tokens decoded per round, after a prefill of block_size // 2
device = 'auto'
dtype = 'auto' # 'auto': bfloat16 on CUDA where supported, float32 elsewhere; or explicit
modes = 'compiled,eager' # comma-separated: compiled (torch.compile) and / or eager
json_out = '' # write all numbers here too
report = 'paths' # paths (every path's table), loop, compile, e2e or gpu: see the examples above
moe_steps = 20 # gpu: training steps of Block DAR + MoE
runs = 3 # compile: cold + warm runs per path; e2e: pairs of train.py runs
train_args = '' # e2e: more train.py arguments for both runs of a pair, space-separated
memory_probe = '' # internal: measure the peak RSS of one path in this (fresh) process
compile_probe = '' # internal: time one path's first compiled training steps in this (fresh) process
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))}

PATHS = {
    'standard': dict(),
    'attnres-full': dict(residual='attnres'),
    'attnres-block': dict(residual='attnres', depth_block=None),
    'mhc-2': dict(residual='mhc'),
    'dar-full': dict(residual='dar'),
    'dar-block': dict(residual='dar', depth_block=None),
    'dar-self': dict(residual='dar', depth_block=None, dar_routing='self'),
}

def model_config(cfg, name):
    args = dict(n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'], block_size=cfg['block_size'],
                vocab_size=cfg['vocab_size'], bias=cfg['bias'])
    base, is_moe = name.removesuffix('+moe'), name.endswith('+moe')
    args.update({k: (cfg['depth_block'] if v is None else v) for k, v in PATHS[base].items()})
    if is_moe: # 4 experts of half the dense width, top-2: the active parameters of the dense MLP
        args.update(n_expert=4, n_expert_active=2, expert_hidden=2 * cfg['n_embd'])
    return GPTConfig(**args)

class Runner:
    """One path's model, optimizer and inputs, with timed train / prefill / decode calls."""

    def __init__(self, cfg, name, device, ctx, compiled):
        torch.manual_seed(0)
        self.model = GPT(model_config(cfg, name)).to(device)
        self.params = self.model.get_num_params()
        self.active = self.model.get_num_params(active=True)
        self.optimizer = self.model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.split(':')[0])
        # static shapes: the training step and the prefill are compiled once each; the decode step
        # once, compiled as sample.py compiles it
        self.fwd = torch.compile(self.model, dynamic=False) if compiled else self.model
        self.gen = compile_for_generation(self.model) if compiled else self.model
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randint(cfg['vocab_size'], (2, cfg['batch_size'], cfg['block_size']), generator=g).to(device)
        self.prompt = self.x[:1, :cfg['block_size'] // 2]
        self.decode_tokens = cfg['decode_tokens']
        self.ctx = ctx
        self.device = device

    def train_step(self):
        """One training step; its loss."""
        with self.ctx:
            _, loss = self.fwd(self.x, self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def cuda_peak_mb(self):
        """MB of CUDA memory one training step allocates at its peak, above what was allocated."""
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.train_step()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    @torch.no_grad()
    def prefill(self):
        with self.ctx:
            self.fwd(self.x)

    @torch.no_grad()
    def decode(self):
        """Seconds per decoded token after a prefill (eager: it is not timed, and compiling it
        would only lengthen the bench), greedy, with the static KV cache."""
        with self.ctx:
            cache = KVCache(self.model, 1, self.prompt.device)
            logits, _ = self.model(self.prompt, cache=cache)
            sync(self.device)
            t0 = time.perf_counter()
            for _ in range(self.decode_tokens):
                logits, _ = self.gen(logits[:, -1:].argmax(-1), cache=cache)
            sync(self.device)
        return (time.perf_counter() - t0) / self.decode_tokens

    def saved_mb(self):
        with self.ctx:
            return saved_mb(self.model, lambda: self.fwd(self.x, self.y))

def saved_mb(model, forward):
    """MB of the tensors forward() saves for backward (compiled: what the forward/backward
    partition hands to backward), each storage once, model's parameters excluded (under autocast
    their low-precision copies count)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}
    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values()) / 2**20

def sync(device):
    if 'cuda' in device:
        torch.cuda.synchronize()

def timed(fn, device):
    """Seconds one call takes (CUDA events on GPU)."""
    if 'cuda' in device:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

def status_mb(field):
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field)) / 1024

def probe_memory(cfg, device, ctx):
    """Peak RSS of this fresh process over 3 training steps, above its RSS after the imports
    (Linux: writing 5 to /proc/self/clear_refs resets the peak, VmHWM, to the current RSS)."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    base = status_mb('VmRSS')
    r = Runner(cfg, cfg['memory_probe'], device, ctx, compiled=False)
    for _ in range(3):
        r.train_step()
    print(status_mb('VmHWM') - base)

def last_line(text):
    """The last line of a failed process's stderr: its one-line error."""
    return (text.strip().splitlines() or ['no output'])[-1]

def run_probe(key, name, argv, env=None):
    """This script in a fresh process with --key=name (a probe); the last line it prints."""
    args = [a for a in argv if not a.startswith(f'--{key}=')] + [f'--{key}={name}']
    p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        fail(f"{key.replace('_', ' ')} of {name} failed: {last_line(p.stderr)}")
    return p.stdout.strip().splitlines()[-1]

def probe_compile(cfg, device, ctx):
    """In this fresh process: seconds of one path's first compiled training step (forward,
    backward, AdamW; it holds the compilation), the median of 5 later steps, and the hits in
    the compile caches (AOTAutograd's and inductor's)."""
    with contextlib.redirect_stdout(io.StringIO()): # configure_optimizers prints
        r = Runner(cfg, cfg['compile_probe'], device, ctx, compiled=True)
    first = timed(r.train_step, device)
    step = statistics.median(timed(r.train_step, device) for _ in range(5))
    hits = counters['aot_autograd']['autograd_cache_hit'] + counters['inductor']['fxgraph_cache_hit']
    print(json.dumps(dict(first_s=first, step_s=step, cache_hits=hits)))

def compile_times(cfg, names, argv):
    """runs times, every path in turn: the first compiled training step in a fresh process from a
    fresh compile cache (cold), then in another fresh process on that cache (warm); a path's ratio
    to standard is taken run by run."""
    per_path = {name: [] for name in names}
    for _ in range(cfg['runs']):
        for name in names:
            with tempfile.TemporaryDirectory() as cache:
                env = fresh_cache(cache)
                per_path[name].append([json.loads(run_probe('compile_probe', name, argv, env)) for _ in ('cold', 'warm')])
    res = {}
    for name, runs in per_path.items():
        res[name] = dict(cold_s=summary([c['first_s'] for c, _ in runs]), warm_s=summary([w['first_s'] for _, w in runs]),
                         step_s=summary([r['step_s'] for run in runs for r in run]),
                         cold_cache_hits=[c['cache_hits'] for c, _ in runs], warm_cache_hits=[w['cache_hits'] for _, w in runs],
                         runs=runs)
    for name, r in res.items(): # run i of a path against run i of standard
        std = res['standard']['runs']
        r['cold_ratio'], r['warm_ratio'] = (summary([a[k]['first_s'] / b[k]['first_s'] for a, b in zip(r['runs'], std)]) for k in (0, 1))
        r['step_ratio'] = summary([a[k]['step_s'] / b[k]['step_s'] for a, b in zip(r['runs'], std) for k in (0, 1)])
    print(f"# compile time: n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} block_size={cfg['block_size']} "
          f"batch_size={cfg['batch_size']} depth_block={cfg['depth_block']}, runs: {cfg['runs']}; the first training step "
          f"of torch.compile(model) in a fresh process: cold = fresh inductor cache, warm = again on it")
    print('| path | first step, cold s (min-max) | x std | first step, warm s (min-max) | x std | later steps ms (min-max) | x std |')
    print('|---|---|---|---|---|---|---|')
    span = lambda x, k=1, f='.1f': f"{k * x['median']:{f}} ({k * x['min']:{f}}-{k * x['max']:{f}})"
    for name, r in res.items():
        print(f"| {name} | {span(r['cold_s'])} | {span(r['cold_ratio'], f='.2f')} | {span(r['warm_s'])} | {span(r['warm_ratio'], f='.2f')} "
              f"| {span(r['step_s'], 1e3)} | {span(r['step_ratio'], f='.2f')} |")
    return res

def fresh_cache(path):
    """The environment of a process whose compile caches (inductor's, Triton's, depth_op.cpp's
    build) start empty in path."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=path, XDG_CACHE_HOME=path)
    env.pop('TRITON_CACHE_DIR', None) # it would override the Triton cache under path
    return env

def end_to_end(cfg):
    """Wall time, start to exit, of `python train.py` (Block DAR) and `python train.py
    --residual=standard`, runs pairs in turn; the first pair from a fresh compile cache (cold:
    on CPU only DAR compiles), the later ones on it (warm). The ratio is taken within each pair;
    each run's best val loss too."""
    train_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')
    extra = shlex.split(cfg['train_args'])
    with tempfile.TemporaryDirectory() as tmp:
        env = fresh_cache(os.path.join(tmp, 'inductor'))
        def wall(args):
            """Seconds of one train.py run, start to exit, and its best val loss."""
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, train_py, *args, *extra, f'--out_dir={tmp}/out', '--overwrite=True'],
                               capture_output=True, text=True, env=env)
            if p.returncode != 0:
                fail(f"--report=e2e: train.py {' '.join(args + extra)} failed: {last_line(p.stderr)}")
            best = re.search(r'best val loss ([\d.]+)', p.stdout) # none without a checkpoint
            return time.perf_counter() - t0, best and float(best[1])
        runs = [(wall([]), wall(['--residual=standard'])) for _ in range(cfg['runs'])]
    pairs = [(d, st) for (d, _), (st, _) in runs]
    ratios = [d / st for d, st in pairs]
    print(f"# end to end: {' '.join(['python train.py'] + extra)} (Block DAR) against the same with --residual=standard, "
          f"{cfg['runs']} pairs in turn, start to exit; the first pair starts from a fresh compile cache")
    print('| pair | python train.py s (val loss) | --residual=standard s (val loss) | ratio |')
    print('|---|---|---|---|')
    loss = lambda v: '-' if v is None else f'{v:.4f}'
    for i, (((d, dl), (st, sl)), r) in enumerate(zip(runs, ratios)):
        print(f"| {i + 1}{' (cold cache)' if i == 0 else ''} | {d:.1f} ({loss(dl)}) | {st:.1f} ({loss(sl)}) | {r:.3f} |")
    res = dict(pairs_s=pairs, val_loss=[(dl, sl) for (_, dl), (_, sl) in runs], cold_ratio=ratios[0],
               warm_ratio=summary(ratios[1:]) if len(ratios) > 1 else None)
    if res['warm_ratio']:
        print(f"warm: ratio {res['warm_ratio']['median']:.3f} ({res['warm_ratio']['min']:.3f}-{res['warm_ratio']['max']:.3f})")
    return res

def bare_loop(model, optimizer, batches, ctx, device, iters, clip=0.0):
    """Seconds per step of a bare loop: forward, backward, AdamW step, on pre-made batches; with
    clip > 0 it clips the gradient norm first, as train.py does."""
    dts, t0 = [], time.perf_counter()
    for i in range(iters):
        x, y = batches[i % len(batches)]
        with ctx:
            _, loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t1 = time.perf_counter()
        dts.append(t1 - t0)
        t0 = t1
    return dts

def train_py_loop(args):
    """Seconds per step of train.py's own loop, from its log line of every step."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            status = train_main(args)
    finally: # train.main installs its stop handlers
        for s, h in handlers.items():
            signal.signal(s, h)
    if status != 0:
        fail(f"--report=loop: train.py stopped with status {status}")
    return [float(ms) / 1e3 for ms in re.findall(r'^iter \d+: .*?time ([\d.]+)ms', out.getvalue(), flags=re.M)]

def loop_ratio(cfg, device, ctx):
    """train.py's step (its whole loop: data, learning rate, clipping, logging) against a bare loop
    of the same standard model, eager, in this process: rounds of 30 steps of each in turn, the
    ratio of their medians per round; also against a bare loop that clips the gradient norm as
    train.py does, so that the rest is the loop's own cost. train.py logs every step here (by
    default every 10th), so its time is an upper bound; the first 2 steps of each run (the first
    eval) are not counted."""
    iters = 30
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, 'random'))
        tokens = np.random.default_rng(0).integers(cfg['vocab_size'], size=100_000)
        for split in ('train', 'val'):
            write_tokens(os.path.join(tmp, 'random', f'{split}.bin'), tokens)
        write_pickle(os.path.join(tmp, 'random', 'meta.pkl'), dict(vocab_size=cfg['vocab_size']))
        args = [f'--{k}={cfg[k]}' for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'bias', 'dtype')] + [
            f'--data_dir={tmp}', '--dataset=random', '--residual=standard', '--compile=False', f'--device={device}',
            f'--max_iters={iters}', f'--eval_interval={iters}', '--eval_iters=1', '--log_interval=1',
            f'--out_dir={os.path.join(tmp, "out")}', '--overwrite=True']
        torch.manual_seed(0)
        model = GPT(model_config(cfg, 'standard')).to(device)
        with contextlib.redirect_stdout(io.StringIO()): # configure_optimizers prints
            optimizer = model.configure_optimizers(TRAIN_DEFAULTS['weight_decay'], TRAIN_DEFAULTS['learning_rate'],
                                                   (TRAIN_DEFAULTS['beta1'], TRAIN_DEFAULTS['beta2']), device.split(':')[0])
        g = torch.Generator().manual_seed(0)
        batches = torch.randint(cfg['vocab_size'], (8, 2, cfg['batch_size'], cfg['block_size']), generator=g).to(device)
        clip = TRAIN_DEFAULTS['grad_clip']
        loops = lambda: (train_py_loop(args)[2:], bare_loop(model, optimizer, batches, ctx, device, iters)[2:],
                         bare_loop(model, optimizer, batches, ctx, device, iters, clip)[2:])
        loops() # warm-up
        rounds = [[statistics.median(dts) for dts in loops()] for _ in range(cfg['rounds'])]
    train_s, bare_s, clipped_s = zip(*rounds)
    res = dict(ratio=summary([a / b for a, b in zip(train_s, bare_s)]), train_py_s=summary(train_s), bare_s=summary(bare_s),
               ratio_clipped=summary([a / c for a, c in zip(train_s, clipped_s)]), bare_clipped_s=summary(clipped_s))
    print(f"# train.py's step against a bare loop: standard, n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} "
          f"block_size={cfg['block_size']} batch_size={cfg['batch_size']}, eager, {cfg['rounds']} rounds of {iters} steps")
    print(f"train.py {1e3 * res['train_py_s']['median']:.1f} ms, bare loop {1e3 * res['bare_s']['median']:.1f} ms, "
          f"ratio {res['ratio']['median']:.3f} ({res['ratio']['min']:.3f}-{res['ratio']['max']:.3f} over the rounds)")
    print(f"bare loop with gradient clipping at {clip} as train.py: {1e3 * res['bare_clipped_s']['median']:.1f} ms, "
          f"ratio {res['ratio_clipped']['median']:.3f} ({res['ratio_clipped']['min']:.3f}-{res['ratio_clipped']['max']:.3f})")
    return res

def gpu_check(cfg, device, ctx):
    """The GPU check (docs/gpu.md), in the order of what matters most, each result printed as it
    comes: every path's first compiled training step (which compiles it) and its later steps,
    interleaved, against standard's; peak memory; Block DAR's step with the depth ops' kernels
    against their torch ops; a torch.profiler summary of a standard and a Block DAR step; Block
    DAR + MoE compiled, moe_steps training steps."""
    names = ['standard', 'dar-block', 'attnres-block', 'dar-full']
    res = dict(first_s={}, train_s={}, ratio={}, peak_mb={})
    with contextlib.redirect_stdout(io.StringIO()): # configure_optimizers prints
        runners = {n: Runner(cfg, n, device, ctx, compiled=True) for n in names}
    print(f"# GPU check: n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} block_size={cfg['block_size']} "
          f"batch_size={cfg['batch_size']}, compiled, {cfg['rounds']} interleaved rounds", flush=True)
    for n, r in runners.items():
        res['first_s'][n] = timed(r.train_step, device)
        print(f"first step (compiles) {n}: {res['first_s'][n]:.1f} s", flush=True)
    times = {n: [] for n in names}
    for _ in range(cfg['rounds']):
        for n, r in runners.items():
            times[n].append(timed(r.train_step, device))
    for n, r in runners.items():
        ratios = [a / b for a, b in zip(times[n], times['standard'])]
        res['train_s'][n], res['ratio'][n] = summary(times[n]), summary(ratios)
        if 'cuda' in device:
            res['peak_mb'][n] = r.cuda_peak_mb()
        peak = res['peak_mb'].get(n)
        print(f"| {n} | {1e3 * res['train_s'][n]['median']:.1f} ms | x std {res['ratio'][n]['median']:.3f} "
              f"({res['ratio'][n]['min']:.3f}-{res['ratio'][n]['max']:.3f}) | peak {'-' if peak is None else f'{peak:.0f} MB'} |", flush=True)
    # the depth ops' bodies as dispatched (CUDA: Triton kernels; CPU: depth_op.cpp) against torch
    # ops, in the same compiled Block DAR step (the operations are opaque: no recompile)
    kernels, torch_ops = [], []
    dispatch = depth_op.on_triton, depth_op.on_kernel
    try:
        for _ in range(cfg['rounds']):
            depth_op.on_triton, depth_op.on_kernel = dispatch
            kernels.append(timed(runners['dar-block'].train_step, device))
            depth_op.on_triton = depth_op.on_kernel = lambda tensors: False
            torch_ops.append(timed(runners['dar-block'].train_step, device))
    finally:
        depth_op.on_triton, depth_op.on_kernel = dispatch
    res['kernels_vs_torch_ops'] = summary([a / b for a, b in zip(kernels, torch_ops)])
    r = res['kernels_vs_torch_ops']
    print(f"Block DAR step, the depth ops' kernels x their torch ops: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})", flush=True)
    res['profile'] = {}
    for n in ('standard', 'dar-block'):
        with torch.profiler.profile() as prof:
            for _ in range(3):
                runners[n].train_step()
            sync(device)
        key = 'self_device_time_total' if 'cuda' in device else 'self_cpu_time_total'
        res['profile'][n] = prof.key_averages().table(sort_by=key, row_limit=12)
        print(f"# profile, 3 training steps of {n}, by {key}\n{res['profile'][n]}", flush=True)
    del runners
    with contextlib.redirect_stdout(io.StringIO()):
        r = Runner(cfg, 'dar-block+moe', device, ctx, compiled=True)
    t0 = time.perf_counter()
    losses = [r.train_step().item() for _ in range(cfg['moe_steps'])]
    res['moe'] = dict(steps=len(losses), seconds=time.perf_counter() - t0, losses=losses)
    print(f"Block DAR + MoE, compiled: {len(losses)} steps in {res['moe']['seconds']:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return res

def summary(xs):
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs))

def main(argv):
    cfg, _ = configure(DEFAULTS, argv)
    check(cfg, [count(k) for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'vocab_size', 'depth_block',
                                   'rounds', 'decode_tokens', 'runs', 'moe_steps')] + [count('warmup', 0)])
    # every path's model compiles GPT.forward for training, prefill and decode: more than the default 8 entries
    torch._dynamo.config.recompile_limit = 64
    keep_freed_memory() # as train.py does
    device = resolve_device(cfg['device'])
    dtype, ctx = autocast(device.split(':')[0], cfg['dtype'])
    if cfg['memory_probe']:
        return probe_memory(cfg, device, ctx)
    if cfg['compile_probe']:
        return probe_compile(cfg, device, ctx)
    if cfg['report'] not in ('paths', 'loop', 'compile', 'e2e', 'gpu'):
        fail(f"--report: unknown report {cfg['report']}; paths, loop, compile, e2e or gpu")
    if cfg['report'] == 'gpu':
        return write_json(cfg, dict(gpu=gpu_check(cfg, device, ctx)))
    if cfg['report'] in ('loop', 'e2e'):
        res = loop_ratio(cfg, device, ctx) if cfg['report'] == 'loop' else end_to_end(cfg)
        return write_json(cfg, {cfg['report']: res})
    names = list(PATHS) if cfg['paths'] == 'all' else cfg['paths'].split(',')
    for name in names:
        if name not in PATHS:
            fail(f"--paths: unknown path {name}; one of {', '.join(PATHS)}, or all")
    if 'standard' not in names:
        names.insert(0, 'standard')
    if cfg['moe']:
        names += [n + '+moe' for n in names]
    if cfg['report'] == 'compile':
        return write_json(cfg, dict(compile=compile_times(cfg, names, argv)))
    check(cfg, [('decode_tokens', lambda v: cfg['block_size'] // 2 + v <= cfg['block_size'],
                 f"at most block_size - block_size // 2 = {cfg['block_size'] - cfg['block_size'] // 2} (decoding follows a prompt of block_size // 2)")])
    modes = cfg['modes'].split(',')
    for mode in modes:
        if mode not in ('compiled', 'eager'):
            fail(f"--modes: unknown mode {mode}; compiled and / or eager")
    rows = [(n, mode) for mode in modes for n in names]

    with contextlib.redirect_stdout(io.StringIO()): # configure_optimizers prints
        runners = {row: Runner(cfg, row[0], device, ctx, row[1] == 'compiled') for row in rows}
    times = {row: dict(train=[], prefill=[], decode=[]) for row in rows}
    warmup_s = {}
    for row, runner in runners.items(): # warm-up, which compiles, one row at a time
        t0 = time.perf_counter()
        for _ in range(cfg['warmup']):
            runner.train_step()
            runner.prefill()
            runner.decode()
        sync(device)
        warmup_s[row] = time.perf_counter() - t0
    for r in range(cfg['rounds']):
        for row, runner in runners.items(): # interleaved: A B C A B C ...
            times[row]['train'].append(timed(runner.train_step, device))
            times[row]['prefill'].append(timed(runner.prefill, device))
            times[row]['decode'].append(runner.decode())
    memory, saved = {}, {row: runner.saved_mb() for row, runner in runners.items()}
    for row, runner in runners.items():
        if 'cuda' in device:
            memory[row] = runner.cuda_peak_mb()
        elif row[1] == 'eager': # a compiled process's peak would hold the compiler's memory
            memory[row] = float(run_probe('memory_probe', row[0], argv))

    tokens = cfg['batch_size'] * cfg['block_size']
    results = {}
    for (n, mode), runner in runners.items():
        t, std = times[(n, mode)], times[('standard', mode)]
        res = dict(path=n, mode=mode, params=runner.params, active_params=runner.active, warmup_s=warmup_s[(n, mode)],
                   peak_memory_mb=memory.get((n, mode)), train_s=summary(t['train']), prefill_s=summary(t['prefill']),
                   train_tok_s=tokens / statistics.median(t['train']), prefill_tok_s=tokens / statistics.median(t['prefill']))
        for k in ('train', 'prefill', 'decode'): # ratio round by round, then the median and the spread
            ratios = [a / b for a, b in zip(t[k], std[k])]
            res[f'{k}_ratio'], res[f'{k}_ratio_span'] = statistics.median(ratios), (min(ratios), max(ratios))
        res['decode_s_per_token'] = summary(t['decode'])
        res['memory_ratio'] = memory[(n, mode)] / memory[('standard', mode)] if (n, mode) in memory else None
        res['saved_mb'], res['saved_ratio'] = saved[(n, mode)], saved[(n, mode)] / saved[('standard', mode)]
        if 'cuda' in device:
            res['mfu'] = runner.model.estimate_mfu(cfg['batch_size'], statistics.median(t['train']))
        results[f'{n} {mode}'] = res

    where = torch.cuda.get_device_name() if 'cuda' in device else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench: {where}, {dtype}, n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} block_size={cfg['block_size']} "
          f"batch_size={cfg['batch_size']}, {cfg['warmup']} warm-up + {cfg['rounds']} interleaved rounds; x std = time (or memory) "
          f"over dense standard's in the same mode: 1.25 is 1/1.25 of its tok/s")
    print("peak: " + ("CUDA max_memory_allocated during a training step" if 'cuda' in device else
                      "CPU peak RSS of a fresh eager process per path over 3 training steps, minus its RSS after imports")
          + "; saved: what a training forward saves for backward, parameters excluded")
    mfu = 'cuda' in device
    print('| path | mode | params (active) | warm-up s | train ms/step (min-max) | train tok/s | x std (min-max) | prefill tok/s | x std | '
          'decode ms/token | x std | peak MB | x std | saved MB | x std |' + (' MFU |' if mfu else ''))
    print('|---' * (15 + mfu) + '|')
    num = lambda x, f: '-' if x is None else format(x, f)
    for r in results.values():
        tr, dec = r['train_s'], r['decode_s_per_token']
        print(f"| {r['path']} | {r['mode']} | {r['params']:,} ({r['active_params']:,}) | {r['warmup_s']:.0f} "
              f"| {1e3 * tr['median']:.1f} ({1e3 * tr['min']:.1f}-{1e3 * tr['max']:.1f}) | {r['train_tok_s']:,.0f} "
              f"| {r['train_ratio']:.2f} ({r['train_ratio_span'][0]:.2f}-{r['train_ratio_span'][1]:.2f}) "
              f"| {r['prefill_tok_s']:,.0f} | {r['prefill_ratio']:.2f} | {1e3 * dec['median']:.2f} | {r['decode_ratio']:.2f} "
              f"| {num(r['peak_memory_mb'], '.1f')} | {num(r['memory_ratio'], '.2f')} | {r['saved_mb']:.1f} | {r['saved_ratio']:.2f} |"
              + (f" {num(r['mfu'], '.1%')} |" if mfu else '')) # None: a GPU without a known peak
    write_json(cfg, dict(device=where, dtype=dtype, results=results))

def write_json(cfg, res):
    """The report's numbers and the config, to --json_out if given."""
    if cfg['json_out']:
        with open(cfg['json_out'], 'w') as f:
            json.dump(dict(config=cfg, **res), f, indent=1)

if __name__ == '__main__':
    main(sys.argv[1:])
