"""
Sample from a trained model.

$ python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --max_new_tokens=200
$ python sample.py --help   # every key with its default
"""
import os
import sys
import pickle

import torch

from model import GPT
from prepare_data import fail, gpt2_encoding
from configurator import autocast, check, configure, count, load_checkpoint, resolve_device

# -----------------------------------------------------------------------------
out_dir = 'out' # the checkpoint is out_dir/ckpt.pt
start = "\n" # or "<|endoftext|>" or etc. Can also specify a file, use as: "FILE:prompt.txt"
num_samples = 10 # number of samples to draw
max_new_tokens = 500 # number of tokens generated in each sample
temperature = 0.8 # 1.0 = no change, < 1.0 = less random, > 1.0 = more random, in predictions
top_k = 200 # retain only the top_k most likely tokens, clamp others to have 0 probability; 0 or None: all
seed = 1337
device = 'auto' # 'auto', 'cpu', 'cuda', 'cuda:0', 'mps'
dtype = 'auto' # 'auto' (bfloat16 on CUDA where supported, else float16; float32 elsewhere), or explicit
compile = False # compile the prefill and the one-token decode step (static KV cache: each compiled once; CUDA graphs on CUDA)
gpt2_dir = '' # folder with GPT-2 vocab.bpe + encoder.json, for BPE datasets offline (or env DAR_GPT2_DIR)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))}

def compile_for_generation(model):
    """torch.compile of the model for generate(forward=...), static shapes. A one-token step is a
    long chain of tiny kernels whose cost is the calls between them: on CUDA, CUDA graphs replay
    the whole step (mode='reduce-overhead'); on CPU, inductor's C++ wrapper calls the kernels in
    place of its Python one (cpp_wrapper); elsewhere (mps) the plain compile."""
    device = model.lm_head.weight.device.type
    if device == 'cuda':
        return torch.compile(model, dynamic=False, mode='reduce-overhead')
    if device == 'cpu':
        return torch.compile(model, dynamic=False, options={'cpp_wrapper': True})
    return torch.compile(model, dynamic=False)

def codec(checkpoint, gpt2_dir):
    """encode / decode for the checkpoint's dataset: its meta.pkl when it has one, else GPT-2 BPE."""
    config = checkpoint['config']
    meta_path = os.path.join(config['data_dir'], config['dataset'], 'meta.pkl')
    if os.path.exists(meta_path):
        print(f"Loading meta from {meta_path}...")
        with open(meta_path, 'rb') as f:
            meta = pickle.load(f)
        stoi, itos = meta['stoi'], meta['itos']
        def encode(s):
            unknown = sorted(set(c for c in s if c not in stoi))
            if unknown:
                fail(f"the prompt has characters outside the vocabulary of {meta_path}: {''.join(unknown)!r}")
            return [stoi[c] for c in s]
        return encode, lambda l: ''.join([itos[i] for i in l])
    vocab_size = checkpoint['model_args']['vocab_size']
    if vocab_size < 50257: # a character-level model: its meta.pkl is relative to where train.py ran
        fail(f"no {meta_path} for this model's vocabulary of {vocab_size}: run sample.py where train.py ran")
    print("No meta.pkl found, assuming GPT-2 encodings...")
    enc = gpt2_encoding(gpt2_dir or None)
    # ids from 50257 up to vocab_size pad the vocabulary (50304): no tokens, dropped if sampled
    return lambda s: enc.encode(s, allowed_special={"<|endoftext|>"}), lambda l: enc.decode([i for i in l if i < enc.n_vocab])

def main(argv):
    cfg, _ = configure(DEFAULTS, argv, nullable=('top_k',))
    check(cfg, [count('num_samples'), count('max_new_tokens', 0),
                ('temperature', lambda v: v > 0, 'a number > 0 (smaller is greedier)'),
                ('top_k', lambda v: v is None or v >= 0, 'an integer >= 0, or None (0 and None: no top-k)')])
    torch.manual_seed(cfg['seed'])
    device = resolve_device(cfg['device'])
    _, ctx = autocast('cuda' if 'cuda' in device else device, cfg['dtype'])

    checkpoint = load_checkpoint(os.path.join(cfg['out_dir'], 'ckpt.pt'))
    model = GPT.from_checkpoint(checkpoint)
    model.eval()
    model.to(device)
    # compiling the module and calling its generate() would run the uncompiled forward, so the
    # compiled forward is handed to generate; static shapes, so nothing recompiles while decoding
    forward = compile_for_generation(model) if cfg['compile'] else model
    encode, decode = codec(checkpoint, cfg['gpt2_dir'])

    # encode the beginning of the prompt
    start = cfg['start']
    if start.startswith('FILE:'):
        try:
            with open(start[5:], 'r', encoding='utf-8') as f:
                start = f.read()
        except OSError as e:
            fail(f"--start={start}: {e.strerror}")
    if not start:
        fail("--start is empty: give a prompt, or FILE:prompt.txt with some text in it")
    start_ids = encode(start)
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]

    # run generation
    with torch.no_grad():
        with ctx:
            for k in range(cfg['num_samples']):
                y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'], top_k=cfg['top_k'] or None, forward=forward)
                print(decode(y[0].tolist()))
                print('---------------')

if __name__ == '__main__':
    main(sys.argv[1:])
