# The depth scan: 12, 24 and 48 layers at about equal non-embedding parameters (standard: 2.38M,
# 2.36M, 2.40M), head size 30-32, 6 depth blocks at every depth (depth_block = 2 n_layer / 6),
# every run 1600 steps x 12 x 64 = 1.23M tokens, the same batches for every variant of a seed.
# This file is the 12-layer preset; depth_scan_24.py and depth_scan_48.py change the shape after it.
# python sweep.py --config=config/depth_scan.py --out=out-depth-12 --jobs=2 --variants=standard,attnres-block,dar-block,dar-self
# python sweep.py --config=config/depth_scan.py,config/depth_scan_24.py --out=out-depth-24 --jobs=2 --variants=...
# python sweep.py --config=config/depth_scan.py,config/depth_scan_48.py --out=out-depth-48 --jobs=2 --variants=...
# python sweep.py --scan=out-depth-12,out-depth-24,out-depth-48 --out=assets/depth
n_layer = 12
n_head = 4
n_embd = 128
depth_block = 4 # 6 blocks of 2 layers
block_size = 64
batch_size = 12
max_iters = 1600
warmup_iters = 100
eval_interval = 200 # the val-loss curve: 9 points, the last quarter from step 1200
eval_iters = 20 # the same 20 batches at every eval
log_interval = 50
device = 'cpu'
compile = False # eager, as in the deep preset: a whole-model compile's time grows with depth (#21)
