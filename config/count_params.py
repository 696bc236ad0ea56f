"""
Parameter counts of every preset under every residual path, built on the meta device (no memory).

$ python config/count_params.py
"""
import os
import sys
import glob
import contextlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import GPT, GPTConfig
from train import DEFAULTS, MODEL_KEYS, configure

PATHS = {'standard': dict(residual='standard', depth_block=1), 'attnres-block': dict(residual='attnres'),
         'attnres-full': dict(residual='attnres', depth_block=1), 'mhc-2': dict(residual='mhc', depth_block=1),
         'dar-block': dict(residual='dar'), 'dar-full': dict(residual='dar', depth_block=1)}

print('| preset | ' + ' | '.join(PATHS) + ' | active (MoE) |')
print('|---' * (len(PATHS) + 2) + '|')
for preset in sorted(glob.glob(os.path.join(ROOT, 'config', 'paper_*.py'))):
    cfg, _ = configure(DEFAULTS, [preset])
    args = {k: cfg[k] for k in MODEL_KEYS if k != 'vocab_size'}
    counts = []
    for path in PATHS.values():
        with torch.device('meta'), contextlib.redirect_stdout(None):
            model = GPT(GPTConfig(**dict(args, vocab_size=50304, **path)))
        counts.append(model.get_num_params())
    active = model.get_num_params(active=True) if cfg['n_expert'] else None
    print(f"| {os.path.basename(preset)[:-3]} | " + ' | '.join(f"{c / 1e6:,.1f}M" for c in counts)
          + f" | {f'{active / 1e6:,.1f}M (dar-full)' if active else '-'} |")
