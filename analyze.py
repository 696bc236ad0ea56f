"""
Look inside a trained checkpoint: where each sublayer reads from over depth, how different the
two streams are, and whether both streams carry the model (the paper's two analyses).

$ python analyze.py --ckpt=out/ckpt.pt --out=analysis

Writes analysis/analysis.json with every number, and PNG plots when matplotlib is installed
(pip install matplotlib); without it the same numbers are printed as text tables.
  depth weights  mean softmax weight of every sublayer over its candidates, averaged over val
                 tokens (per stream for DAR; for mHC the pre weights over the streams)
  CKA            linear CKA of the two streams' histories, paired depths and depth x depth
  rescue         val loss clean, with stream j's read ablated (zeros), with both ablated
"""
import os
import sys
import json

import numpy as np
import torch

from model import GPT
from prepare_data import fail
from train import check, configure, count, load_checkpoint, open_split, get_batch

# -----------------------------------------------------------------------------
ckpt = 'out/ckpt.pt'
data_dir = '' # '' = the data_dir/dataset the checkpoint was trained on
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
    shards = open_split(cfg['data_dir'] or os.path.join(config['data_dir'], config['dataset']), 'val', block_size)
    g = torch.Generator().manual_seed(cfg['seed'])
    ix = torch.randint(sum(w for _, w in shards), (cfg['batches'], cfg['batch_size']), generator=g)
    return [get_batch(shards, i, block_size, 'cpu') for i in ix]

@torch.no_grad()
def val_loss(model, batches, ablate=None):
    return float(np.mean([model(X, Y, ablate_stream=ablate)[1].item() for X, Y in batches]))

@torch.no_grad()
def depth_weights(model, batches):
    """Per stream, a (sublayers + final read) x (max candidates) matrix of mean read weights;
    None where a sublayer has fewer candidates."""
    sums = None
    for X, _ in batches:
        _, _, depth = model(X, return_depth=True)
        w = [a.mean(dim=(-2, -1)) for a in depth['weights']] # each (R,) or (streams, R)
        sums = w if sums is None else [s + x for s, x in zip(sums, w)]
    means = [(s / len(batches)).reshape(-1, s.size(-1)) for s in sums] # (streams, R)
    R = max(m.size(-1) for m in means)
    grid = torch.full((means[0].size(0), len(means), R), float('nan'))
    for l, m in enumerate(means):
        grid[:, l, :m.size(-1)] = m
    return [[[None if np.isnan(x) else x for x in row] for row in g] for g in grid.tolist()]

@torch.no_grad()
def stream_cka(model, batches):
    """Linear CKA between the two streams' history entries H^0_r and H^1_r over the val tokens."""
    H = None
    for X, _ in batches:
        _, _, depth = model(X, return_depth=True)
        h = [[e.reshape(-1, e.size(-1)) for e in stream] for stream in depth['H'][:2]]
        H = h if H is None else [[torch.cat([a, b]) for a, b in zip(sa, sb)] for sa, sb in zip(H, h)]
    n = len(H[0])
    matrix = [[cka(H[0][r], H[1][q]) for q in range(n)] for r in range(n)]
    return dict(paired=[matrix[r][r] for r in range(n)], matrix=matrix)

@torch.no_grad()
def rescue(model, batches):
    """Clean loss, each stream's read ablated, both ablated; the loss increase per stream and the
    fraction of the damage of ablating both that keeping one stream alone recovers."""
    if model.config.residual not in ('dar', 'mhc'):
        raise ValueError(f"the rescue analysis needs two streams (residual=dar or mhc), this checkpoint has residual={model.config.residual}")
    L0 = val_loss(model, batches)
    abl = [val_loss(model, batches, ablate=j) for j in (0, 1)]
    both = val_loss(model, batches, ablate=(0, 1))
    return dict(clean=L0, ablate=abl, ablate_both=both, increase=[a - L0 for a in abl],
                keep_recovers=[(both - abl[1 - j]) / (both - L0) for j in (0, 1)],
                balance=min(abl[0] - L0, abl[1] - L0) / max(abl[0] - L0, abl[1] - L0))

def plot(results, folder):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    grid = np.array(results['depth_weights'], dtype=float)
    fig, axes = plt.subplots(1, len(grid), figsize=(4.5 * len(grid), 4), squeeze=False)
    for j, (ax, g) in enumerate(zip(axes[0], grid)):
        im = ax.imshow(g, cmap='viridis', vmin=0, vmax=np.nanmax(grid), aspect='auto')
        ax.set_title(f"stream {j}" if len(grid) > 1 else "depth read weights")
        ax.set_xlabel('candidate (0 = embedding)' if results['residual'] != 'mhc' else 'stream')
        ax.set_ylabel('sublayer (last row: final read)')
    fig.colorbar(im, ax=axes[0].tolist())
    files.append(os.path.join(folder, 'depth_weights.png'))
    fig.savefig(files[-1], dpi=80)
    if 'cka' in results:
        fig, ax = plt.subplots(figsize=(4.5, 4))
        im = ax.imshow(np.array(results['cka']['matrix']), cmap='magma', vmin=0, vmax=1)
        ax.set_title('cross-stream linear CKA')
        ax.set_xlabel('stream 1 entry')
        ax.set_ylabel('stream 0 entry')
        fig.colorbar(im)
        files.append(os.path.join(folder, 'cka.png'))
        fig.savefig(files[-1], dpi=80)
    if 'rescue' in results:
        r = results['rescue']
        fig, ax = plt.subplots(figsize=(4.5, 3.5))
        ax.bar(['clean', 'ablate 0', 'ablate 1', 'ablate both'], [r['clean'], *r['ablate'], r['ablate_both']])
        ax.set_ylabel('val loss')
        files.append(os.path.join(folder, 'rescue.png'))
        fig.savefig(files[-1], dpi=80)
    plt.close('all')
    return files

def print_tables(results):
    for j, g in enumerate(results['depth_weights']):
        print(f"depth read weights, stream {j} (rows: sublayers, last = final read; columns: candidates)")
        for row in g:
            print('  ' + ' '.join('  -  ' if x is None else f"{x:.3f}" for x in row))
    if 'cka' in results:
        print("cross-stream CKA, paired depths: " + ' '.join(f"{x:.3f}" for x in results['cka']['paired']))
    if 'rescue' in results:
        r = results['rescue']
        print(f"rescue: clean {r['clean']:.4f}, ablate stream 0 {r['ablate'][0]:.4f}, stream 1 {r['ablate'][1]:.4f}, "
              f"both {r['ablate_both']:.4f}; keeping stream 0 / 1 alone recovers "
              f"{100 * r['keep_recovers'][0]:.1f}% / {100 * r['keep_recovers'][1]:.1f}%; balance {r['balance']:.3f}")

def main(argv):
    cfg, _ = configure(DEFAULTS, argv)
    check(cfg, [count('batches'), count('batch_size')])
    checkpoint = load_checkpoint(cfg['ckpt'])
    model = GPT.from_checkpoint(checkpoint)
    model.eval()
    batches = val_batches(cfg, checkpoint['config'], model.config.block_size)
    results = dict(ckpt=cfg['ckpt'], residual=model.config.residual, iter_num=checkpoint['iter_num'],
                   val_loss=val_loss(model, batches))
    if model.config.residual != 'standard':
        results['depth_weights'] = depth_weights(model, batches)
    if model.config.residual in ('dar', 'mhc'):
        results['cka'] = stream_cka(model, batches)
        results['rescue'] = rescue(model, batches)
    os.makedirs(cfg['out'], exist_ok=True)
    results['plots'] = plot(results, cfg['out']) if 'depth_weights' in results else []
    with open(os.path.join(cfg['out'], 'analysis.json'), 'w') as f:
        json.dump(results, f, indent=1)
    if 'depth_weights' in results:
        print_tables(results)
    print(f"val loss {results['val_loss']:.4f}; wrote {os.path.join(cfg['out'], 'analysis.json')}"
          + (f" and {', '.join(results['plots'])}" if results['plots'] else " (pip install matplotlib for plots)"))

if __name__ == '__main__':
    main(sys.argv[1:])
