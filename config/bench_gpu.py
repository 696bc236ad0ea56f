# bench.py at GPT-2 small size for one GPU: bf16, compiled and eager rows.
# python bench.py config/bench_gpu.py --json_out=bench_gpu.json
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
batch_size = 8
vocab_size = 50304
depth_block = 6 # 4 blocks
rounds = 20
warmup = 3
decode_tokens = 64
