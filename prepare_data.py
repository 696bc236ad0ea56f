"""
Prepare a dataset as nanoGPT does: uint16 token files train.bin / val.bin in data/<name>/.

  python prepare_data.py                      # shakespeare_char: 65 characters, meta.pkl
  python prepare_data.py shakespeare          # GPT-2 BPE through tiktoken
  python prepare_data.py --input=my.txt       # any UTF-8 text instead of the download

Large corpora become shards data/<name>/{val,train}_NNNNNN.bin of --shard_tokens tokens,
GPT-2 BPE with <|endoftext|> before every document, tokenised by --num_proc processes:

  python prepare_data.py fineweb_edu          # HuggingFaceFW/fineweb-edu sample-10BT (pip install datasets)
  python prepare_data.py openwebtext          # Skylion007/openwebtext (pip install datasets)
  python prepare_data.py docs --input=my.jsonl  # local JSON lines, one document per line in "text"

Offline, pass the text with --input and the GPT-2 vocabulary folder (vocab.bpe +
encoder.json) with --gpt2_dir or the DAR_GPT2_DIR environment variable. open_split and get_batch
below read the files back (train.py, analyze.py).
"""
import os
import sys
import glob
import json
import pickle
import hashlib
import argparse
import urllib.request
import multiprocessing as mp

import numpy as np
import torch
from tqdm import tqdm

SHAKESPEARE_URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
SHAKESPEARE_SHA256 = '86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed'
# the hashes tiktoken pins for the files of its 'gpt2' encoding
GPT2_FILES_SHA256 = {
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
}
CHUNK = 1 << 20 # characters tokenised per tqdm step

def fail(message):
    """Stop with one line on stderr, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)

def sha256(data):
    return hashlib.sha256(data).hexdigest()

def read_text(path):
    """The corpus: the --input file, else tiny Shakespeare downloaded and checked."""
    if path:
        try:
            with open(path, 'rb') as f:
                raw = f.read()
        except OSError as e:
            fail(f"--input {path}: {e.strerror}")
    else:
        try:
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
                raw = r.read()
        except OSError as e:
            fail(f"could not download {SHAKESPEARE_URL} ({e}); offline, pass the text with --input=FILE")
        if sha256(raw) != SHAKESPEARE_SHA256:
            fail(f"{SHAKESPEARE_URL} has sha256 {sha256(raw)}, expected {SHAKESPEARE_SHA256}")
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        fail(f"--input {path} is not UTF-8 text ({e.reason} at byte {e.start})")

def gpt2_encoding(folder=None):
    """tiktoken's 'gpt2' encoding. From a local folder holding vocab.bpe and encoder.json
    (checked against the sha256 that tiktoken pins) when one is given, by argument or by the
    DAR_GPT2_DIR environment variable; else tiktoken.get_encoding('gpt2'), which downloads
    the files once and caches them."""
    import tiktoken
    folder = folder or os.environ.get('DAR_GPT2_DIR')
    if not folder:
        try:
            return tiktoken.get_encoding('gpt2')
        except Exception as e:
            fail(f"tiktoken could not load 'gpt2' ({type(e).__name__}); offline, pass --gpt2_dir=DIR "
                 "or set DAR_GPT2_DIR to a folder with vocab.bpe and encoder.json")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str, ENDOFTEXT
    paths = {}
    for name, expected in GPT2_FILES_SHA256.items():
        path = os.path.join(folder, name)
        try:
            with open(path, 'rb') as f:
                digest = sha256(f.read())
        except OSError as e:
            fail(f"GPT-2 vocab folder {folder}: {name}: {e.strerror}")
        if digest != expected:
            fail(f"{path} has sha256 {digest}, expected {expected} (the file tiktoken pins)")
        paths[name] = path
    ranks = data_gym_to_mergeable_bpe_ranks(paths['vocab.bpe'], paths['encoder.json'],
                                            GPT2_FILES_SHA256['vocab.bpe'], GPT2_FILES_SHA256['encoder.json'])
    return tiktoken.Encoding(name='gpt2', pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)

def write_tokens(path, ids):
    """ids as uint16 at path, through a temp file and a rename: never a half-written file."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and ids.max() >= 2**16:
        fail(f"token id {ids.max()} does not fit in uint16; {path} not written")
    tmp = path + '.tmp'
    ids.astype(np.uint16).tofile(tmp)
    os.replace(tmp, path)

def write_pickle(path, obj):
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)

def open_split(data_dir, split, block_size):
    """The uint16 token files of a split: data_dir/split.bin, or the shards data_dir/split_*.bin
    of a large corpus. Returns [(path, number of windows of block_size + 1 tokens)]."""
    path = os.path.join(data_dir, f'{split}.bin')
    paths = [path] if os.path.exists(path) else sorted(glob.glob(os.path.join(data_dir, f'{split}_*.bin')))
    if not paths:
        fail(f"no {path}: prepare the data first (python prepare_data.py), or set --data_dir / --dataset")
    n = [os.path.getsize(p) // 2 for p in paths]
    if max(n) <= block_size:
        fail(f"{paths[0]} has {max(n)} tokens, fewer than block_size+1 = {block_size + 1}")
    return [(p, k - block_size) for p, k in zip(paths, n) if k > block_size]

def get_batch(shards, ix, block_size, device):
    """Inputs and targets of the windows ix, indices into all windows of all shards in turn."""
    ix, ends = ix.numpy(), np.cumsum([w for _, w in shards])
    shard = np.searchsorted(ends, ix, side='right') # the shard of each window
    start = ix - np.concatenate(([0], ends))[shard] # and where it starts there
    xy = np.empty((len(ix), block_size + 1), dtype=np.int64)
    for s in np.unique(shard):
        # recreate np.memmap every batch to avoid a memory leak, as per
        # https://stackoverflow.com/questions/45132940/numpy-memmap-memory-usage-want-to-iterate-once/61472122#61472122
        data = np.memmap(shards[s][0], dtype=np.uint16, mode='r')
        rows = shard == s
        xy[rows] = data[start[rows, None] + np.arange(block_size + 1)] # (rows, block_size + 1)
    x, y = torch.from_numpy(xy[:, :-1].copy()), torch.from_numpy(xy[:, 1:].copy())
    if 'cuda' in device:
        # pin arrays x,y, which allows us to move them to GPU asynchronously (non_blocking=True)
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)

def pieces(text):
    """The text in pieces of about CHUNK characters, with a tqdm bar when it is large. Each cut
    falls after a newline between two non-spaces, where GPT-2's BPE never merges across (its
    whitespace runs would: '\n\n' is one token), so the pieces' tokens are the whole text's."""
    cuts = [0]
    while cuts[-1] < len(text):
        cut = text.find('\n', cuts[-1] + CHUNK)
        while cut != -1 and (text[cut + 1:cut + 2].isspace() or text[cut - 1:cut].isspace()):
            cut = text.find('\n', cut + 1)
        cuts.append(len(text) if cut == -1 else cut + 1)
    bar = tqdm(total=len(text), desc='tokenising', unit='char', unit_scale=True, disable=len(cuts) < 5)
    for start, end in zip(cuts, cuts[1:]):
        yield text[start:end]
        bar.update(end - start)
    bar.close()

def prepare_char(text):
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    ids = [stoi[c] for piece in pieces(text) for c in piece]
    return ids, dict(vocab_size=len(chars), stoi=stoi, itos=itos)

def prepare_bpe(text, enc):
    return [i for piece in pieces(text) for i in enc.encode_ordinary(piece)]

HF_CORPORA = { # name: (Hugging Face dataset, configuration)
    'fineweb_edu': ('HuggingFaceFW/fineweb-edu', 'sample-10BT'),
    'openwebtext': ('Skylion007/openwebtext', None),
}

class BadInput(Exception):
    """Bad input met while the pool's task thread reads the documents (there fail() would end only
    that thread, and the run would hang): the pool raises it again in the main process."""

def documents(name, path):
    """The documents of a large corpus, one string each, streamed."""
    if name == 'docs':
        try:
            with open(path, encoding='utf-8') as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)['text']
                        except (ValueError, KeyError, TypeError):
                            raise BadInput(f"--input {path}, line {n}: not a JSON object with a \"text\" field")
        except OSError as e:
            raise BadInput(f"--input {path}: {e.strerror}")
        return
    try:
        import datasets
    except ImportError:
        raise BadInput(f"{name} needs Hugging Face datasets: pip install datasets")
    repo, config = HF_CORPORA[name]
    for doc in datasets.load_dataset(repo, name=config, split='train', streaming=True):
        yield doc['text']

ENCODING = None # the GPT-2 encoding of each tokeniser process

def init_worker(gpt2_dir):
    global ENCODING
    ENCODING = gpt2_encoding(gpt2_dir)

def tokenize_document(text):
    # <|endoftext|> first: it separates this document from the one before
    return np.array([ENCODING.eot_token] + ENCODING.encode_ordinary(text), dtype=np.uint16)

def write_shards(docs, out, gpt2_dir, shard_tokens, num_proc):
    """Tokenise docs in num_proc processes into shards of shard_tokens tokens: the first is val,
    the rest train. Returns the number of tokens written."""
    remove_shards(out) # an earlier run's: not of this corpus
    shard, fill, index, total = np.empty(shard_tokens, dtype=np.uint16), 0, 0, 0
    def flush(n):
        nonlocal index
        write_tokens(os.path.join(out, f"{'val' if index == 0 else 'train'}_{index:06d}.bin"), shard[:n])
        index += 1
    with mp.Pool(num_proc, initializer=init_worker, initargs=(gpt2_dir,)) as pool:
        for tokens in tqdm(pool.imap(tokenize_document, docs, chunksize=16), desc='tokenising', unit='docs'):
            total += len(tokens)
            while len(tokens):
                take = min(shard_tokens - fill, len(tokens))
                shard[fill:fill + take] = tokens[:take]
                fill, tokens = fill + take, tokens[take:]
                if fill == shard_tokens:
                    flush(fill)
                    fill = 0
    if fill:
        flush(fill)
    if index < 2:
        fail(f"only {total:,} tokens: less than one val shard plus one train shard of --shard_tokens={shard_tokens:,}")
    return total

def remove_shards(out):
    for path in glob.glob(os.path.join(out, '*.bin')):
        os.remove(path)

def split_text(text):
    n = len(text)
    return text[:int(n * 0.9)], text[int(n * 0.9):]

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('dataset', nargs='?', default='shakespeare_char',
                        choices=['shakespeare_char', 'shakespeare', 'docs', *HF_CORPORA])
    parser.add_argument('--input', help='UTF-8 text file to use instead of downloading tiny Shakespeare')
    parser.add_argument('--gpt2_dir', help='folder with GPT-2 vocab.bpe + encoder.json (or env DAR_GPT2_DIR)')
    parser.add_argument('--data_dir', default='data', help='parent folder of the output folder data/<dataset>')
    parser.add_argument('--shard_tokens', type=int, default=100_000_000, help='tokens per shard of a large corpus')
    parser.add_argument('--num_proc', type=int, default=max(1, os.cpu_count() // 2), help='tokeniser processes')
    args = parser.parse_args(argv)

    if args.dataset in ('docs', *HF_CORPORA):
        if args.dataset == 'docs' and not args.input:
            fail("docs needs --input=FILE: JSON lines with one document per line in \"text\"")
        out = os.path.join(args.data_dir, args.dataset)
        os.makedirs(out, exist_ok=True)
        gpt2_encoding(args.gpt2_dir) # fail here, once, if the vocabulary is missing
        try:
            total = write_shards(documents(args.dataset, args.input), out, args.gpt2_dir, args.shard_tokens, args.num_proc)
        except BadInput as e:
            remove_shards(out) # a corpus cut short: none of it is kept
            fail(str(e))
        print(f"wrote {total:,} tokens to {out}/{{val,train}}_*.bin")
        return

    text = read_text(args.input)
    print(f"length of dataset in characters: {len(text):,}")
    train_text, val_text = split_text(text)
    out = os.path.join(args.data_dir, args.dataset)
    os.makedirs(out, exist_ok=True)
    if args.dataset == 'shakespeare_char':
        ids, meta = prepare_char(text)
        n = len(train_text)
        train_ids, val_ids = ids[:n], ids[n:]
        print(f"vocab size: {meta['vocab_size']}")
        write_pickle(os.path.join(out, 'meta.pkl'), meta)
    else:
        enc = gpt2_encoding(args.gpt2_dir)
        train_ids, val_ids = prepare_bpe(train_text, enc), prepare_bpe(val_text, enc)
    print(f"train has {len(train_ids):,} tokens")
    print(f"val has {len(val_ids):,} tokens")
    write_tokens(os.path.join(out, 'train.bin'), train_ids)
    write_tokens(os.path.join(out, 'val.bin'), val_ids)
    print(f"wrote {out}/train.bin, {out}/val.bin")

if __name__ == '__main__':
    main()
