# nanoGPT's shakespeare_char model size, for one GPU: 6 layers, 384 wide, context 256.
# python train.py config/shakespeare_char.py [--residual=standard --depth_block=1]
out_dir = 'out-shakespeare-char'
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False # the model overfits; keep the best val
dataset = 'shakespeare_char'
batch_size = 64
block_size = 256
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
depth_block = 4 # 12 sublayers in 3 blocks
learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100
