# The depth scan at 24 layers, after config/depth_scan.py: 2.36M non-embedding parameters, 6 blocks
n_layer = 24
n_head = 3
n_embd = 90
depth_block = 8
