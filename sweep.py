"""
Small-scale reproduction: train every residual path for a few seeds at identical
hyperparameters and tokens, then write one results table and the val-loss curves.

$ python sweep.py                                   # 10 variants x 3 seeds, CPU preset
$ python sweep.py --config=config/deep_shakespeare.py --out=out-sweep-deep --variants=standard,dar-block
$ python sweep.py --seeds=1 --variants=standard,dar-block -- --max_iters=200
$ python sweep.py --scan=out-depth-12,out-depth-24,out-depth-48 --out=assets/depth

--config is a train.py config file (or several, comma-separated, in order) applied after the CPU
preset below; arguments after '--' go to every train.py run last ({seed} in them: the run's seed). Each run writes
<out>/<variant>-<seed>/ (checkpoint, log.txt, and result.json once finished). The sweep resumes: a
finished run is read back, not repeated, and a stopped one continues from its checkpoint. The table
goes to <out>/results.md and results.json (with every run's val-loss curve), the curves to
<out>/curves.png (needs matplotlib).
--jobs=N trains N runs at once, each on cpu_count/N threads: on 2 cores two 1-thread runs give
1.46-1.58x the tokens/s of one 2-thread run (48-layer Block DAR); their step times are contended.

--scan reads finished sweeps of one preset at several depths and writes each variant's val-loss
difference from the standard residual against depth: <out>/scan.md (Welch p-values) and scan.png.
"""
import os
import sys
import json
import math
import argparse
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

VARIANTS = { # block variants take depth_block from the preset (train.py's default: 2)
    'standard': ['--residual=standard'],
    'attnres-block': ['--residual=attnres'],
    'attnres-full': ['--residual=attnres', '--depth_block=1'],
    'mhc-2': ['--residual=mhc'],
    'dar-block': ['--residual=dar'],
    'dar-full': ['--residual=dar', '--depth_block=1'],
    'dar-self': ['--residual=dar', '--dar_routing=self'],
    'dar-crossv': ['--residual=dar', '--dar_routing=crossv'],
    'dar-fixed': ['--residual=dar', '--dar_routing=fixed'],
    'dar-sepv': ['--residual=dar', '--dar_routing=sepv'],
}
# the CPU preset of every run: the train.py defaults, 1000 steps, a final eval on 50 batches
PRESET = ['--max_iters=1000', '--eval_interval=1000', '--eval_iters=50', '--log_interval=50', '--device=cpu']
# the claims tested: each variant against standard, DAR against AttnRes and against SelfKV
PAIRS = [('dar-block', 'attnres-block'), ('dar-full', 'attnres-full'), ('dar-block', 'dar-self')]

def run(variant, seed, out_root, config, extra, threads):
    """Train one run on threads CPU threads to the end (or read it back when finished); its final
    val loss, median step time in ms, val-loss curve [(iter, val)] and n_layer."""
    out_dir = os.path.join(out_root, f'{variant}-{seed}')
    result_path = os.path.join(out_dir, 'result.json')
    if os.path.exists(result_path):
        with open(result_path) as f:
            return json.load(f)
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    start = '--init_from=resume' if os.path.exists(ckpt_path) else '--overwrite=True'
    # {seed}: e.g. --init_from=out-base/standard-{seed}/ckpt.pt; a stopped run resumes from its own checkpoint
    extra = [a.replace('{seed}', str(seed)) for a in extra if not (start == '--init_from=resume' and a.startswith('--init_from='))]
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py'), *PRESET, *config, *VARIANTS[variant], f'--seed={seed}', f'--out_dir={out_dir}', start, *extra]
    log = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': str(threads)})
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'log.txt'), 'a') as f: # a resumed run adds to the log of its start
        f.write(log.stdout + log.stderr)
    if log.returncode != 0:
        tail = '\n'.join('  ' + l for l in (log.stdout + log.stderr).strip().splitlines()[-5:])
        sys.exit(f"error: {' '.join(cmd)} failed; its last lines (all of them in {out_dir}/log.txt):\n{tail}")
    with open(os.path.join(out_dir, 'log.txt')) as f:
        ms = [float(l.split('time ')[1].split('ms')[0]) for l in f if l.startswith('iter ')]
    checkpoint = torch.load(ckpt_path, weights_only=True)
    curve = [(it, val) for it, _, val in checkpoint['curve']]
    result = dict(seed=seed, val=curve[-1][1], ms=statistics.median(ms), curve=curve, n_layer=checkpoint['model_args']['n_layer'])
    with open(result_path + '.tmp', 'w') as f:
        json.dump(result, f)
    os.replace(result_path + '.tmp', result_path)
    return result

def welch(a, b):
    """Two-sided p-value of Welch's t-test that samples a and b have equal means.
    P(|T| <= t) for Student's t with df degrees of freedom is I_y(1/2, df/2) at y = t^2 / (df + t^2);
    with u = v^2 the regularized incomplete beta is an integral of a function bounded on [0, sqrt(y)]."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return 1.0 if statistics.mean(a) == statistics.mean(b) else 0.0
    t = abs(statistics.mean(a) - statistics.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) # Welch-Satterthwaite
    v = torch.linspace(0.0, t / math.sqrt(df + t * t), 100001, dtype=torch.float64)
    beta = math.exp(math.lgamma(0.5) + math.lgamma(df / 2) - math.lgamma(df / 2 + 0.5)) # B(1/2, df/2)
    return 1.0 - torch.trapezoid(2 * (1 - v * v) ** (df / 2 - 1), v).item() / beta

def pvalue(p):
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"

def p_cell(vals, v, ref):
    """Welch p of variant v against ref as a table cell: '' for ref itself or without two seeds each."""
    return pvalue(welch(vals[v], vals[ref])) if v != ref and len(vals[v]) > 1 and len(vals[ref]) > 1 else ''

def comparisons(vals):
    """The PAIRS that vals (variant -> final val losses) can test: both present, with seeds."""
    return [(a, b) for a, b in PAIRS if a in vals and b in vals and len(vals[a]) > 1 and len(vals[b]) > 1]

def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt

def tables(results):
    """The results table (mean +- std, vs standard with Welch p) and the DAR comparisons."""
    vals = {v: [r['val'] for r in rs] for v, rs in results.items()}
    ms = {v: statistics.mean(r['ms'] for r in rs) for v, rs in results.items()}
    mean = {v: statistics.mean(x) for v, x in vals.items()}
    ref = 'standard' if 'standard' in results else None
    rows = ['| variant | val loss (mean +- std) | vs standard | p (Welch, vs standard) | step time (median ms) | step time ratio |',
            '|---|---|---|---|---|---|']
    for v, x in vals.items():
        std = statistics.stdev(x) if len(x) > 1 else 0.0
        rel = p = ratio = ''
        if ref:
            rel, ratio = f"{100 * (mean[v] / mean[ref] - 1):+.2f}%", f"{ms[v] / ms[ref]:.2f}x"
            p = p_cell(vals, v, ref)
        rows.append(f"| {v} | {mean[v]:.4f} +- {std:.4f} | {rel} | {p} | {ms[v]:.1f} | {ratio} |")
    pairs = comparisons(vals)
    if pairs:
        rows += ['', '| comparison | difference in val loss | p (Welch) |', '|---|---|---|']
        rows += [f"| {a} vs {b} | {mean[a] - mean[b]:+.4f} ({100 * (mean[a] / mean[b] - 1):+.2f}%) | {pvalue(welch(vals[a], vals[b]))} |" for a, b in pairs]
    return '\n'.join(rows)

def plot_curves(results, path):
    """Val loss against step, mean over seeds with a +-1 std band: all steps, and zoomed on the second half."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    lows, highs = [], []
    for v, rs in results.items():
        steps = np.array([it for it, _ in rs[0]['curve']])
        curves = np.array([[val for _, val in r['curve']] for r in rs]) # (seeds, evals)
        mean, std = curves.mean(0), curves.std(0, ddof=1) if len(rs) > 1 else np.zeros(len(steps))
        late = steps >= steps[-1] / 2
        lows.append((mean - std)[late].min())
        highs.append((mean + std)[late].max())
        for ax in axes:
            line, = ax.plot(steps, mean, label=v)
            ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    axes[0].set_title('val loss (mean over seeds, band: +-1 std)')
    axes[1].set_title('second half, zoomed')
    axes[1].set_xlim(steps[-1] / 2, steps[-1])
    pad = 0.05 * (max(highs) - min(lows))
    axes[1].set_ylim(min(lows) - pad, max(highs) + pad)
    for ax in axes:
        ax.set_xlabel('step')
        ax.set_ylabel('val loss')
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

def scan(folders, out):
    """Each variant's val-loss difference from the standard residual against depth, from finished
    sweeps of one preset at several depths: <out>/scan.md and <out>/scan.png."""
    sweeps = {}
    for folder in folders:
        path = os.path.join(folder, 'results.json')
        if not os.path.isfile(path):
            sys.exit(f"error: --scan: no {path}; run that sweep to its end first")
        with open(path) as f:
            results = json.load(f)
        if 'standard' not in results or 'n_layer' not in results['standard'][0]:
            sys.exit(f"error: --scan: {path} has no standard runs with their n_layer to compare with")
        sweeps[results['standard'][0]['n_layer']] = results
    rows = ['| depth | variant | val loss (mean +- std) | vs standard | p (Welch, vs standard) | last-quarter drop |',
            '|---|---|---|---|---|---|']
    pairs, gaps = [], {} # gaps[variant]: (depth, each seed's difference from standard's mean, %)
    for depth, results in sorted(sweeps.items()):
        vals = {v: [r['val'] for r in rs] for v, rs in results.items()}
        mean = {v: statistics.mean(x) for v, x in vals.items()}
        for v, rs in results.items():
            x = vals[v]
            std = statistics.stdev(x) if len(x) > 1 else 0.0
            p = p_cell(vals, v, 'standard')
            # the curve's last quarter: val loss at the first eval from 3/4 of the run, minus the last
            drop = statistics.mean(next(val for it, val in r['curve'] if it >= 0.75 * r['curve'][-1][0]) - r['val'] for r in rs)
            rows.append(f"| {depth} | {v} | {mean[v]:.4f} +- {std:.4f} | {100 * (mean[v] / mean['standard'] - 1):+.2f}% | {p} | {drop:.4f} |")
            gaps.setdefault(v, []).append((depth, [100 * (xi / mean['standard'] - 1) for xi in x]))
        pairs += [(depth, a, b, mean[a], mean[b], welch(vals[a], vals[b])) for a, b in comparisons(vals)]
    if pairs:
        rows += ['', '| depth | comparison | difference in val loss | p (Welch) |', '|---|---|---|---|']
        rows += [f"| {d} | {a} vs {b} | {ma - mb:+.4f} ({100 * (ma / mb - 1):+.2f}%) | {pvalue(p)} |" for d, a, b, ma, mb, p in pairs]
    table = '\n'.join(rows)
    print(table)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'scan.md'), 'w') as f:
        f.write(table + '\n')
    png = plot_scan(gaps, os.path.join(out, 'scan.png'))
    print(f"wrote {os.path.join(out, 'scan.md')}" + (f" and {png}" if png else " (pip install matplotlib for the figure)"))

def plot_scan(gaps, path):
    """Val-loss difference from standard against depth: each variant's mean, and every seed as a dot."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.axhline(0.0, color='gray', lw=1)
    variants = [v for v in gaps if v != 'standard']
    for i, v in enumerate(variants):
        shift = 2 ** (0.03 * (i - (len(variants) - 1) / 2)) # each variant a little aside, so seeds don't overlap
        depths = [d * shift for d, _ in gaps[v]]
        line, = ax.plot(depths, [statistics.mean(seeds) for _, seeds in gaps[v]], marker='o', label=v)
        for d, seeds in gaps[v]:
            ax.scatter([d * shift] * len(seeds), seeds, color=line.get_color(), s=10, alpha=0.5)
    ax.set_xscale('log', base=2)
    ax.set_xticks(sorted({d for points in gaps.values() for d, _ in points}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel('layers (about equal non-embedding parameters)')
    ax.set_ylabel('val loss vs standard residual (%)')
    ax.set_title('val loss vs the standard residual (line: mean over seeds, dots: seeds)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--seeds', type=int, default=3)
    parser.add_argument('--variants', default=','.join(VARIANTS))
    parser.add_argument('--config', default=None, help='train.py config files for every run, comma-separated')
    parser.add_argument('--out', default='out-sweep')
    parser.add_argument('--jobs', type=int, default=1, help='runs trained at once')
    parser.add_argument('--scan', default=None, help='comma-separated sweep folders of one preset at several depths')
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != '--']
    if args.scan is not None:
        return scan(args.scan.split(','), args.out)
    if args.seeds < 1:
        sys.exit(f"error: --seeds={args.seeds} is out of range: an integer >= 1")
    if not 1 <= args.jobs <= (os.cpu_count() or 1):
        sys.exit(f"error: --jobs={args.jobs} is out of range: an integer from 1 to the {os.cpu_count()} CPUs")
    config = args.config.split(',') if args.config else []
    for c in config:
        if not os.path.isfile(c):
            sys.exit(f"error: --config={args.config}: no such file {c}")
    variants = args.variants.split(',')
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"error: unknown variant {v}; one of {', '.join(VARIANTS)}")
    results = {v: [] for v in variants}
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    runs = [(v, 1337 + seed) for seed in range(args.seeds) for v in variants] # seeds outermost: a stopped sweep still has every variant
    pool = ThreadPoolExecutor(args.jobs)
    futures = [pool.submit(run, v, seed, args.out, config, extra, threads) for v, seed in runs]
    try:
        for (v, seed), future in zip(runs, futures):
            r = future.result()
            results[v].append(r)
            print(f"{v} seed {seed}: val loss {r['val']:.4f}, {r['ms']:.1f} ms/step", flush=True)
    finally: # a failed run stops the sweep: the runs not started are dropped
        pool.shutdown(cancel_futures=True)
    table = tables(results)
    print(table)
    with open(os.path.join(args.out, 'results.md'), 'w') as f:
        f.write(table + '\n')
    with open(os.path.join(args.out, 'results.json'), 'w') as f:
        json.dump(results, f, indent=1)
    png = plot_curves(results, os.path.join(args.out, 'curves.png'))
    print(f"wrote {os.path.join(args.out, 'results.md')}, results.json" + (f" and {png}" if png else " (pip install matplotlib for the curves)"))

if __name__ == '__main__':
    main()
