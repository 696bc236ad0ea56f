"""
Look inside trained checkpoints: where each sublayer reads from over depth, how different the
two streams are, and whether both streams carry the model (the paper's two analyses).

$ python analyze.py --ckpt=out/ckpt.pt --out=analysis
$ python analyze.py --ckpt='out-sweep-deep/dar-block-*/ckpt.pt,out-sweep-deep/dar-self-*/ckpt.pt' --out=assets

--ckpt is a comma-separated list; each entry may be a glob, and the checkpoints it matches (seeds
of one variant) form one group: the numbers are reported per checkpoint and as the group's mean
+- std, and the plots show one panel per group, side by side. Writes <out>/analysis.json with
every number, and PNG plots when matplotlib is installed (pip install matplotlib); without it the
same numbers are printed as text tables.
  depth weights  mean softmax weight of every sublayer over its candidates, averaged over val
                 tokens (per stream for DAR; for mHC the pre weights over the streams)
  CKA            linear CKA of the two streams' histories H^0_r and H^1_q, every (r, q): the mean
                 over paired depths (r = q) and over unpaired depths (r != q)
  rescue         ablate and rescue: val loss clean; with stream j's read at every sublayer replaced
                 by its mean over the batch at each position (ablate j: a mean ablation); with it
                 replaced by stream k's read (rescue j from k); with every stream ablated. Rescue
                 gain = ablate j - rescue j from k, and the fraction of the ablation damage it recovers.
"""
import os
import sys
import glob
import json
import contextlib

import numpy as np
import torch

from model import GPT
from prepare_data import fail
from configurator import check, configure, count, load_checkpoint
from prepare_data import open_split, get_batch

# -----------------------------------------------------------------------------
ckpt = 'out/ckpt.pt' # checkpoints, comma-separated; each entry a path or a glob (one group)
data_dir = '' # as in train.py: val tokens are read from data_dir/dataset; '' = the checkpoint's data_dir
dataset = '' # '' = the checkpoint's dataset
out = 'analysis' # folder for analysis.json and the plots
batches = 8 # val batches for every number
batch_size = 8
seed = 1337
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))}

def cka(X, Y):
    """Linear CKA of two (n, C) representations of the same n tokens, centred:
    ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)."""
    X = X - X.mean(0, keepdim=True)
    Y = Y - Y.mean(0, keepdim=True)
    return (torch.linalg.matrix_norm(Y.t() @ X) ** 2 / (torch.linalg.matrix_norm(X.t() @ X) * torch.linalg.matrix_norm(Y.t() @ Y))).item()

def val_batches(cfg, config, block_size):
    shards = open_split(os.path.join(cfg['data_dir'] or config['data_dir'], cfg['dataset'] or config['dataset']), 'val', block_size)
    g = torch.Generator().manual_seed(cfg['seed'])
    ix = torch.randint(sum(w for _, w in shards), (cfg['batches'], cfg['batch_size']), generator=g)
    return [get_batch(shards, i, block_size, 'cpu') for i in ix]

class Probe:
    """analyze.py's view into a forward, attached to the model's residual path while it is used
    as a context (`with Probe(model) as probe: model(X)`): at every read of DAR or mHC it takes
    the path's reads apart, res.reads(s, l) -> (h, weights), hands them to __call__ and fuses what
    it returns, res.fuse(s, l, h, weights); of AttnRes it records the weights. Records the weights of every read and the streams' histories; with
    ablate = {stream j: None} replaces j's read by its mean over the batch at each position (a mean
    ablation: a zero read would only rescale the pre-normed branch input), with {j: k} by stream
    k's read (rescue). mHC's reads are its streams X_i, weighted by pre, at every sublayer and in
    the final readout (sigmoid-weighted), as DAR's final read."""

    def __init__(self, model, ablate=None):
        cfg = model.config
        self.ablate = ablate or {}
        if self.ablate and cfg.residual not in ('dar', 'mhc'):
            raise ValueError(f"ablation needs a multi-stream path (dar or mhc), not residual={cfg.residual}")
        for j, k in self.ablate.items():
            if k is not None and k in self.ablate:
                raise ValueError(f"donor={k} must be a stream that is not ablated (ablated: {sorted(self.ablate)})")
        self.res, self.mhc, self.L = model.transformer.res, cfg.residual == 'mhc', 2 * cfg.n_layer
        self.attnres = cfg.residual == 'attnres'
        self.weights = [] # per read: (R, B, T) over the candidates, (streams, R, B, T) for DAR, (n, B, T) for mHC
        self.states = [] # mHC: the streams X at every read
        self.H = None # AttnRes, DAR: the committed histories, per stream

    def __enter__(self):
        res = self.res
        if hasattr(res, 'reads'): # DAR, mHC: the streams' reads apart, then fused
            res.read = lambda s, l: res.fuse(s, l, *self(l, s, *res.reads(s, l)))
        elif self.attnres: # AttnRes: the weights of its one read, recorded from the state
            begin = type(res).begin
            res.begin = lambda e: self.recording(begin(res, e))
        return self

    def __exit__(self, *exc):
        for name in ('read', 'begin'): # the path's own again
            self.res.__dict__.pop(name, None)

    def recording(self, s):
        """The AttnRes state s, each of its depth reads' weights recorded; its history kept."""
        read = s.depth_read
        def recorded(*args, **kwargs):
            x, weights = read(*args, **kwargs)
            self.weights.append(weights[0].detach())
            return x, weights
        s.depth_read, self.H = recorded, s.H
        return s

    def __call__(self, l, s, h, weights):
        """The reads h of sublayer l and their weights, as the fusion should take them."""
        a = weights
        if self.mhc:
            self.states.append(s.detach()) # the state: the streams X
            a = a.permute(2, 0, 1) # pre (B, T, n) -> (n, B, T)
        elif l == self.L:
            self.H = s.H
        self.weights.append(a.detach())
        h = list(h)
        for j, k in self.ablate.items():
            h[j] = h[j].mean(0, keepdim=True).expand_as(h[j]) if k is None else h[k]
        return h, weights

    def histories(self):
        """Per stream, its history entries (B, T, C): H^j for DAR and AttnRes; every X_i for mHC."""
        if self.mhc:
            return [[X[:, :, i] for X in self.states] for i in range(self.states[0].size(2))]
        return self.H

@torch.no_grad()
def val_loss(model, batches, ablate=None):
    with Probe(model, ablate) if ablate else contextlib.nullcontext():
        return float(np.mean([model(X, Y)[1].item() for X, Y in batches]))

@torch.no_grad()
def depth_weights(model, batches):
    """Per stream, a (sublayers + final read) x (max candidates) matrix of mean read weights;
    None where a sublayer has fewer candidates."""
    sums = None
    for X, _ in batches:
        with Probe(model) as probe:
            model(X)
        w = [a.mean(dim=(-2, -1)) for a in probe.weights] # each (R,) or (streams, R)
        sums = w if sums is None else [s + x for s, x in zip(sums, w)]
    means = [(s / len(batches)).reshape(-1, s.size(-1)) for s in sums] # (streams, R)
    R = max(m.size(-1) for m in means)
    grid = torch.full((means[0].size(0), len(means), R), float('nan'))
    for l, m in enumerate(means):
        grid[:, l, :m.size(-1)] = m
    return [[[None if np.isnan(x) else x for x in row] for row in g] for g in grid.tolist()]

@torch.no_grad()
def stream_cka(model, batches):
    """Linear CKA between the two streams' history entries H^0_r and H^1_q over the val tokens,
    every (r, q); the mean over paired (r = q) and over unpaired (r != q) depths."""
    H = None
    for X, _ in batches:
        with Probe(model) as probe:
            model(X)
        h = [[e.reshape(-1, e.size(-1)) for e in stream] for stream in probe.histories()[:2]]
        H = h if H is None else [[torch.cat([a, b]) for a, b in zip(sa, sb)] for sa, sb in zip(H, h)]
    n = len(H[0])
    matrix = [[cka(H[0][r], H[1][q]) for q in range(n)] for r in range(n)]
    paired = [matrix[r][r] for r in range(n)]
    unpaired = [matrix[r][q] for r in range(n) for q in range(n) if r != q]
    return dict(matrix=matrix, paired=paired, paired_mean=float(np.mean(paired)), unpaired_mean=float(np.mean(unpaired)))

@torch.no_grad()
def rescue(model, batches):
    """Ablate and rescue over the streams j of a two-stream path: clean loss; stream j's read
    replaced by its batch mean at every sublayer (ablate j); replaced by stream k's read (rescue j from k);
    all streams ablated. The damage of ablating j, the rescue gain of each donor k and the fraction
    of the damage it recovers; balance = min / max damage over the streams (1 = both carry the model)."""
    if model.config.residual not in ('dar', 'mhc'):
        raise ValueError(f"the rescue analysis needs two streams (residual=dar or mhc), this checkpoint has residual={model.config.residual}")
    n = 2 if model.config.residual == 'dar' else model.config.mhc_streams
    L0 = val_loss(model, batches)
    abl = [val_loss(model, batches, ablate={j: None}) for j in range(n)]
    resc = [[None if k == j else val_loss(model, batches, ablate={j: k}) for k in range(n)] for j in range(n)]
    damage = [a - L0 for a in abl]
    gain = [[None if r is None else abl[j] - r for r in row] for j, row in enumerate(resc)]
    return dict(clean=L0, ablate=abl, rescue=resc, ablate_all=val_loss(model, batches, ablate=dict.fromkeys(range(n))),
                damage=damage, rescue_damage=[[None if r is None else r - L0 for r in row] for row in resc], gain=gain,
                recovered=[[None if g is None else g / damage[j] for g in row] for j, row in enumerate(gain)],
                balance=min(damage) / max(damage))

def analyze(model, batches):
    """Every analysis of one model: a dict of numbers."""
    results = dict(residual=model.config.residual, val_loss=val_loss(model, batches))
    if model.config.residual != 'standard':
        results['depth_weights'] = depth_weights(model, batches)
    if model.config.residual in ('dar', 'mhc'):
        results['cka'] = stream_cka(model, batches)
        results['rescue'] = rescue(model, batches)
    return results

def mean_std(values):
    """Mean and std over checkpoints of equally shaped nested lists (None stays None)."""
    a = np.array(values, dtype=float)
    mean, std = a.mean(0), a.std(0, ddof=1) if len(a) > 1 else np.zeros(a.shape[1:])
    clean = lambda x: None if isinstance(x, float) and np.isnan(x) else x
    return [clean(x) for x in np.ravel(mean)] if mean.ndim else clean(float(mean)), \
           [clean(x) for x in np.ravel(std)] if std.ndim else clean(float(std))

def summarize(runs):
    """A group's mean and std of every number its checkpoints share."""
    summary = {'val_loss': mean_std([r['val_loss'] for r in runs])}
    if 'cka' in runs[0]:
        for key in ('paired_mean', 'unpaired_mean'):
            summary[f'cka_{key}'] = mean_std([r['cka'][key] for r in runs])
        summary['cka_matrix'] = np.mean([r['cka']['matrix'] for r in runs], 0).tolist()
    if 'rescue' in runs[0]:
        for key in ('clean', 'ablate', 'ablate_all', 'damage', 'balance'):
            summary[key] = mean_std([r['rescue'][key] for r in runs])
        for key in ('rescue', 'rescue_damage', 'gain', 'recovered'):
            summary[key] = mean_std([[[np.nan if x is None else x for x in row] for row in r['rescue'][key]] for r in runs])
    if 'depth_weights' in runs[0]:
        summary['depth_weights'] = np.array([r['depth_weights'] for r in runs], dtype=float).mean(0).tolist()
    return summary

def plot(groups, folder):
    """One figure per analysis, one panel per group (the mean over its checkpoints)."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    shown = [g for g in groups if 'depth_weights' in g['summary']]
    if shown:
        rows = max(len(g['summary']['depth_weights']) for g in shown)
        fig, axes = plt.subplots(rows, len(shown), figsize=(4 * len(shown), 3.5 * rows), squeeze=False)
        for c, g in enumerate(shown):
            grid = np.array(g['summary']['depth_weights'], dtype=float)
            for j in range(rows):
                ax = axes[j][c]
                if j >= len(grid):
                    ax.axis('off')
                    continue
                ax.imshow(grid[j], cmap='viridis', vmin=0, vmax=np.nanmax(grid), aspect='auto')
                ax.set_xticks(range(grid.shape[-1]))
                ax.set_title(f"{g['label']}: stream {j}" if len(grid) > 1 else g['label'], fontsize=9)
                ax.set_xlabel('stream' if g['residual'] == 'mhc' else 'candidate (0 = embedding)')
                ax.set_ylabel('sublayer (last: final read)')
        fig.suptitle('depth read weights (mean over val tokens and checkpoints)')
        fig.tight_layout()
        files.append(os.path.join(folder, 'depth_weights.png'))
        fig.savefig(files[-1], dpi=80)
    shown = [g for g in groups if 'cka_matrix' in g['summary']]
    if shown:
        fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 4), squeeze=False)
        for ax, g in zip(axes[0], shown):
            m = g['summary']
            im = ax.imshow(np.array(m['cka_matrix']), cmap='magma', vmin=0, vmax=1)
            ax.set_title(f"{g['label']}\npaired {m['cka_paired_mean'][0]:.2f}, unpaired {m['cka_unpaired_mean'][0]:.2f}", fontsize=9)
            ax.set_xlabel('stream 1 entry q')
            ax.set_ylabel('stream 0 entry r')
        fig.colorbar(im, ax=axes[0].tolist())
        files.append(os.path.join(folder, 'cka.png'))
        fig.savefig(files[-1], dpi=80)
    shown = [g for g in groups if 'rescue' in g['summary'] and len(g['summary']['ablate'][0]) == 2]
    if shown:
        # val loss minus clean, of each intervention: (key, index), rescue_damage the flattened 2 x 2 (ablated j, donor k)
        bars = {'ablate 0': ('damage', 0), 'ablate 1': ('damage', 1), 'rescue 0 from 1': ('rescue_damage', 1), 'rescue 1 from 0': ('rescue_damage', 2)}
        fig, ax = plt.subplots(figsize=(2.5 + 2.2 * len(shown), 4))
        for b, (name, (key, i)) in enumerate(bars.items()):
            mean, std = zip(*[(g['summary'][key][0][i], g['summary'][key][1][i]) for g in shown])
            ax.bar(np.arange(len(shown)) + (b - 1.5) * 0.18, mean, 0.18, yerr=std, label=name)
        ax.axhline(0, color='black', lw=0.8)
        ax.set_ylabel('val loss - clean val loss')
        ax.set_title('ablate and rescue (mean +- std over checkpoints)')
        ax.legend(fontsize=7)
        ax.set_xticks(np.arange(len(shown)))
        ax.set_xticklabels([f"{g['label']}\n(ablate both: {g['summary']['ablate_all'][0] - g['summary']['clean'][0]:+.2f})" for g in shown], fontsize=8)
        fig.tight_layout()
        files.append(os.path.join(folder, 'rescue.png'))
        fig.savefig(files[-1], dpi=80)
    plt.close('all')
    return files

def print_tables(groups):
    for g in groups:
        m = g['summary']
        pm = lambda key, fmt='.4f': f"{m[key][0]:{fmt}} +- {m[key][1]:{fmt}}"
        print(f"{g['label']} ({len(g['runs'])} checkpoints, residual={g['residual']}): val loss {pm('val_loss')}")
        for j, grid in enumerate(m.get('depth_weights', [])):
            print(f"  depth read weights, stream {j} (rows: sublayers, last = final read; columns: candidates)")
            for row in grid:
                print('    ' + ' '.join('  -  ' if np.isnan(x) else f"{x:.3f}" for x in row))
        if 'cka_matrix' in m:
            print(f"  cross-stream CKA: paired mean {pm('cka_paired_mean', '.3f')}, unpaired mean {pm('cka_unpaired_mean', '.3f')}")
        if 'ablate' in m:
            n = len(m['ablate'][0])
            print(f"  ablate and rescue: clean {pm('clean')}, ablate all {pm('ablate_all')}, balance {pm('balance', '.3f')}")
            for j in range(n):
                print(f"    ablate {j}: {m['ablate'][0][j]:.4f} (damage {m['damage'][0][j]:+.4f})" + ''.join(
                    f"; rescue from {k}: {m['rescue'][0][j * n + k]:.4f}, gain {m['gain'][0][j * n + k]:+.4f}, "
                    f"recovers {100 * m['recovered'][0][j * n + k]:.1f}% of the damage" for k in range(n) if k != j))

def main(argv):
    cfg, _ = configure(DEFAULTS, argv)
    check(cfg, [count('batches'), count('batch_size')])
    groups = []
    for entry in cfg['ckpt'].split(','):
        paths = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry]
        if not paths:
            fail(f"--ckpt: no checkpoint matches {entry}")
        runs = []
        for path in paths:
            checkpoint = load_checkpoint(path)
            model = GPT.from_checkpoint(checkpoint)
            model.eval()
            batches = val_batches(cfg, checkpoint['config'], model.config.block_size)
            runs.append(dict(ckpt=path, iter_num=checkpoint['iter_num'], **analyze(model, batches)))
            print(f"{path}: val loss {runs[-1]['val_loss']:.4f}", flush=True)
        if len({r['residual'] for r in runs}) > 1:
            fail(f"--ckpt: {entry} matches checkpoints of different paths ({', '.join(sorted({r['residual'] for r in runs}))})")
        label = os.path.basename(os.path.dirname(entry)) or entry
        groups.append(dict(label=label, residual=runs[0]['residual'], runs=runs, summary=summarize(runs)))
    os.makedirs(cfg['out'], exist_ok=True)
    plots = plot(groups, cfg['out'])
    with open(os.path.join(cfg['out'], 'analysis.json'), 'w') as f:
        json.dump(dict(groups=groups, plots=plots), f, indent=1)
    print_tables(groups)
    print(f"wrote {os.path.join(cfg['out'], 'analysis.json')}"
          + (f" and {', '.join(plots)}" if plots else " (pip install matplotlib for plots)"))

if __name__ == '__main__':
    main(sys.argv[1:])
