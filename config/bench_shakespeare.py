# bench.py at nanoGPT's shakespeare_char model size (config/shakespeare_char.py): 6 layers, 384 wide,
# context 256, depth blocks of 4 sublayers; a CPU-sized batch.
# python bench.py config/bench_shakespeare.py
n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
batch_size = 4
vocab_size = 65
depth_block = 4
decode_tokens = 16
