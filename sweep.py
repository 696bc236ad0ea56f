"""
Small-scale reproduction: train every residual path for a few seeds at identical
hyperparameters and tokens, then write one results table.

$ python sweep.py                                   # 10 variants x 3 seeds, CPU preset
$ python sweep.py --seeds=1 --variants=standard,dar-block -- --max_iters=200

Arguments after '--' go to every train.py run. Each run writes out-sweep/<variant>-<seed>/
(checkpoint and log); the table goes to out-sweep/results.md and results.json.
"""
import os
import sys
import json
import argparse
import statistics
import subprocess

VARIANTS = {
    'standard': ['--residual=standard', '--depth_block=1'],
    'attnres-block': ['--residual=attnres', '--depth_block=2'],
    'attnres-full': ['--residual=attnres', '--depth_block=1'],
    'mhc-2': ['--residual=mhc', '--depth_block=1'],
    'dar-block': ['--residual=dar', '--depth_block=2'],
    'dar-full': ['--residual=dar', '--depth_block=1'],
    'dar-self': ['--residual=dar', '--depth_block=2', '--dar_routing=self'],
    'dar-crossv': ['--residual=dar', '--depth_block=2', '--dar_routing=crossv'],
    'dar-fixed': ['--residual=dar', '--depth_block=2', '--dar_routing=fixed'],
    'dar-sepv': ['--residual=dar', '--depth_block=2', '--dar_routing=sepv'],
}
# the CPU preset of every run: the train.py defaults, 1000 steps, a final eval on 50 batches
PRESET = ['--max_iters=1000', '--eval_interval=1000', '--eval_iters=50', '--log_interval=50', '--device=cpu']

def run(variant, seed, out_root, extra):
    out_dir = os.path.join(out_root, f'{variant}-{seed}')
    cmd = [sys.executable, 'train.py', *PRESET, *VARIANTS[variant], f'--seed={seed}', f'--out_dir={out_dir}', '--overwrite=True', *extra]
    log = subprocess.run(cmd, capture_output=True, text=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'log.txt'), 'w') as f:
        f.write(log.stdout + log.stderr)
    if log.returncode != 0:
        tail = '\n'.join('  ' + l for l in (log.stdout + log.stderr).strip().splitlines()[-5:])
        sys.exit(f"error: {' '.join(cmd)} failed; its last lines (all of them in {out_dir}/log.txt):\n{tail}")
    lines = log.stdout.splitlines()
    val = float([l for l in lines if l.startswith('step ')][-1].split('val loss ')[1].split(',')[0])
    ms = [float(l.split('time ')[1].split('ms')[0]) for l in lines if l.startswith('iter ')]
    return val, statistics.median(ms)

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--seeds', type=int, default=3)
    parser.add_argument('--variants', default=','.join(VARIANTS))
    parser.add_argument('--out', default='out-sweep')
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != '--']
    if args.seeds < 1:
        sys.exit(f"error: --seeds={args.seeds} is out of range: an integer >= 1")
    variants = args.variants.split(',')
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"error: unknown variant {v}; one of {', '.join(VARIANTS)}")
    results = {v: [] for v in variants}
    for seed in range(args.seeds): # seeds outermost: a stopped sweep still has every variant
        for v in variants:
            val, ms = run(v, 1337 + seed, args.out, extra)
            results[v].append(dict(seed=1337 + seed, val=val, ms=ms))
            print(f"{v} seed {1337 + seed}: val loss {val:.4f}, {ms:.1f} ms/step", flush=True)
    ref = results.get('standard')
    rows = ['| variant | val loss (mean +- std) | vs standard | step time (median ms) | step time ratio |',
            '|---|---|---|---|---|']
    for v, rs in results.items():
        vals, ms = [r['val'] for r in rs], statistics.mean(r['ms'] for r in rs)
        mean, std = statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
        rel = ratio = ''
        if ref:
            ref_val, ref_ms = statistics.mean(r['val'] for r in ref), statistics.mean(r['ms'] for r in ref)
            rel, ratio = f"{100 * (mean / ref_val - 1):+.2f}%", f"{ms / ref_ms:.2f}x"
        rows.append(f"| {v} | {mean:.4f} +- {std:.4f} | {rel} | {ms:.1f} | {ratio} |")
    table = '\n'.join(rows)
    print(table)
    with open(os.path.join(args.out, 'results.md'), 'w') as f:
        f.write(table + '\n')
    with open(os.path.join(args.out, 'results.json'), 'w') as f:
        json.dump(results, f, indent=1)

if __name__ == '__main__':
    main()
