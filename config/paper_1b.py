# Dense preset at the paper's 1b scale (GPT-2 style, BPE vocab; sizes are ours, the DAR paper's are not public).
# torchrun --standalone --nproc_per_node=8 train.py config/paper_1b.py [--residual=attnres]
# Parameter counts per path: python config/count_params.py
out_dir = 'out-1b'
dataset = 'fineweb_edu' # python prepare_data.py fineweb_edu
eval_interval = 1000
eval_iters = 100
log_interval = 10
n_layer = 32
n_head = 24
n_embd = 1536
block_size = 1024
batch_size = 16
gradient_accumulation_steps = 32 # x 16 x 1024 = 0.5M tokens per step
bias = False
dropout = 0.0
depth_block = 8 # sublayers per depth block: 8 blocks
learning_rate = 6e-4
min_lr = 6e-5
weight_decay = 0.1
beta2 = 0.95
warmup_iters = 2000
max_iters = 20000 # 10B tokens
