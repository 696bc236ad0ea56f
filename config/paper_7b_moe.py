# Sparse MoE preset at the paper's ~7B-total scale (ours: 24 layers, 2048 wide, 64 experts of
# width 1024 with top-6 plus 2 shared, ~1.3B active; the DAR paper's config is not public).
# torchrun --nnodes=4 --nproc_per_node=8 ... train.py config/paper_7b_moe.py --fsdp=True
out_dir = 'out-7b-moe'
dataset = 'fineweb_edu'
eval_interval = 1000
eval_iters = 100
log_interval = 10
n_layer = 24
n_head = 16
n_embd = 2048
block_size = 2048
batch_size = 4
gradient_accumulation_steps = 64 # x 4 x 2048 = 0.5M tokens per step
bias = False
dropout = 0.0
depth_block = 6 # 8 blocks
n_expert = 64
n_expert_active = 6
n_shared_expert = 2
expert_hidden = 1024
moe_aux_loss_coef = 0.01
moe_z_loss_coef = 0.001
learning_rate = 4e-4
min_lr = 4e-5
weight_decay = 0.1
beta2 = 0.95
warmup_iters = 2000
max_iters = 40000
activation_checkpointing = True
