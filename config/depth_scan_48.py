# The depth scan at 48 layers, after config/depth_scan.py: 2.40M non-embedding parameters, 6 blocks
n_layer = 48
n_head = 2
n_embd = 64
depth_block = 16
