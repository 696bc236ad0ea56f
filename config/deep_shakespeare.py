# A deep, narrow model on shakespeare_char for the depth paths: 12 layers (24 sublayers, so a Full
# depth read has up to 25 candidates and a Block read 7), 128 wide, sized for 2 CPU cores.
# python train.py config/deep_shakespeare.py [--residual=attnres]
# python sweep.py --config=config/deep_shakespeare.py --out=out-sweep-deep
n_layer = 12
n_head = 4
n_embd = 128
block_size = 64
batch_size = 12
depth_block = 4 # sublayers per depth block: 6 blocks of 2 layers (paths without depth blocks: 1)
max_iters = 800 # 614k tokens
warmup_iters = 50
eval_interval = 100 # the val-loss curve: 9 points
eval_iters = 20 # the same 20 batches at every eval
log_interval = 50
device = 'cpu'
compile = False # eager: one Block DAR run, 2 CPU cores: 232 s eager, 293 s compiled from a cold cache, 132 s warm
