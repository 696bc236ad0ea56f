"""
Train a dar-gpt model. The defaults below train Block DAR on shakespeare_char, sized for a
laptop CPU. Override them with config files (python that sets the same names) and --key=value:

$ python train.py
$ python train.py config/shakespeare_char.py --residual=attnres --depth_block=4

To run with DDP on 8 GPUs of one node (gradient_accumulation_steps counts the micro-batches of
all ranks together, so it must be a multiple of the number of processes):
$ torchrun --standalone --nproc_per_node=8 train.py config/shakespeare_char.py --gradient_accumulation_steps=8

python train.py --help lists every key with its default.
"""

import os
import ast
import sys
import glob
import math
import time
import pickle
import signal
import difflib
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
    get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from tqdm import tqdm

from model import GPTConfig, GPT
from prepare_data import fail

# -----------------------------------------------------------------------------
# default config values: Block DAR on shakespeare_char, small enough for 2 CPU cores
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 20 # batches per split in an eval
eval_only = False # if True, script exits right after the first eval
always_save_checkpoint = True # if True, always save a checkpoint after each eval
init_from = 'scratch' # 'scratch' or 'resume' (from out_dir/ckpt.pt)
overwrite = False # a scratch run may replace an existing out_dir/ckpt.pt
seed = 1337
# data
dataset = 'shakespeare_char'
data_dir = 'data' # token files are read from data_dir/dataset/{train,val}.bin
gradient_accumulation_steps = 1 # micro-batches per step, summed over all DDP ranks
batch_size = 12 # micro-batch size per rank
block_size = 64
# model
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0 # for pretraining 0 is good, for finetuning try 0.1+
bias = False # do we use bias inside LayerNorm and Linear layers?
residual = 'dar' # standard | attnres | mhc | dar
depth_block = 2 # attnres, dar: sublayers per depth block (1 = Full); 2 gives 4 blocks at n_layer=4; other paths: 1
include_partial = True # attnres, dar: the partial block is a read candidate
dar_routing = 'cross' # dar: cross | self | crossv | fixed | sepv
mhc_streams = 2 # mhc: number of streams
n_expert = 0 # MoE: routed experts per MoE layer; 0 = dense MLP
n_expert_active = 2 # MoE: top-k experts per token
n_shared_expert = 0 # MoE: always-on experts per MoE layer
expert_hidden = 0 # MoE: hidden width of one expert; 0 = 4*n_embd
moe_aux_loss_coef = 0.01 # MoE: load-balancing loss weight
moe_z_loss_coef = 0.001 # MoE: router z-loss weight
moe_every = 1 # MoE: every n-th layer is MoE, the others dense
# adamw optimizer
learning_rate = 1e-3 # max learning rate
max_iters = 2000 # total number of optimizer steps
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0 # clip gradients at this value, or disable if == 0.0
# learning rate decay settings
decay_lr = True # whether to decay the learning rate
warmup_iters = 100 # how many steps to warm up for
lr_decay_iters = 0 # steps of cosine decay; 0 means max_iters
min_lr = 1e-4 # minimum learning rate, ~= learning_rate/10 per Chinchilla
# system
device = 'auto' # 'auto' (cuda, then mps, then cpu), or 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = 'auto' # 'auto' (bfloat16 on CUDA where supported, else float16; float32 elsewhere), or explicit
compile = None # use PyTorch 2.0 to compile the model; None: on for CUDA, off elsewhere
backend = 'auto' # DDP backend: 'auto' (nccl on CUDA, gloo on CPU), 'nccl', 'gloo'
fsdp = False # under torchrun: shard parameters, gradients and optimizer state with FSDP2 instead of DDP
activation_checkpointing = False # recompute each attention / MLP branch in the backward pass to save memory
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))}
REPEAT_S = 2.0 # a stop signal repeated within this many seconds is the same request
MODEL_KEYS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size', 'dropout', 'residual',
              'depth_block', 'include_partial', 'dar_routing', 'mhc_streams', 'n_expert',
              'n_expert_active', 'n_shared_expert', 'expert_hidden', 'moe_aux_loss_coef', 'moe_z_loss_coef', 'moe_every')

def usage(defaults):
    """The running script's docstring, then every key with its default and the comment of its line."""
    main = sys.modules['__main__']
    lines = [(main.__doc__ or '').strip(), '', 'keys (--key=value, or set in a config file):']
    comments = {}
    with open(main.__file__) as f:
        for line in f:
            key, _, rest = line.partition(' = ')
            if key in defaults and key not in comments:
                comments[key] = rest.partition(' # ')[2].strip()
    for key, value in defaults.items():
        lines.append(f"  --{key}={value!r}" + (f"  # {comments[key]}" if comments.get(key) else ''))
    return '\n'.join(lines)

def configure(defaults, argv, nullable=()):
    """Config from defaults, then config files and --key=value overrides in the order given; the
    keys in nullable may also be None. Returns the config dict and the set of keys that were set
    explicitly. --help prints the keys."""
    if '--help' in argv or '-h' in argv:
        print(usage(defaults))
        sys.exit(0)
    config, given = dict(defaults), set()
    for arg in argv:
        if not arg.startswith('--'):
            # a config file: python that assigns some of the keys
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                fail(f"config file {arg}: {e.strerror}")
            scope = {}
            exec(source, {}, scope)
            items = {k: v for k, v in scope.items() if not k.startswith('_')}
        elif '=' not in arg:
            fail(f"{arg}: overrides take the form --key=value")
        else:
            key, value = arg[2:].split('=', 1)
            try:
                value = ast.literal_eval(value) # 3 -> int, 1e-3 -> float, False -> bool
            except (ValueError, SyntaxError):
                pass # a plain string
            items = {key: value}
        for key, value in items.items():
            if key not in defaults:
                close = difflib.get_close_matches(key, defaults, n=1)
                fail(f"unknown config key '{key}' (from {arg})" + (f"; did you mean '{close[0]}'?" if close else ""))
            default = defaults[key]
            if type(default) is float and type(value) is int:
                value = float(value)
            if default is not None and type(value) is not type(default) and not (value is None and key in nullable):
                fail(f"{key}={value!r} (from {arg}) should be of type {type(default).__name__}, not {type(value).__name__}")
            config[key] = value
            given.add(key)
    return config, given

def check(cfg, rules):
    """One line naming the first value out of its range; rules: (key, ok(value), allowed range)."""
    for key, ok, allowed in rules:
        if not ok(cfg[key]):
            fail(f"{key}={cfg[key]!r} is out of range: {allowed}")

def count(key, least=1):
    """The rule for a count: an integer >= least."""
    return key, lambda v: v >= least, f'an integer >= {least}'

TRAIN_RULES = [count(k) for k in ('eval_interval', 'log_interval', 'eval_iters', 'gradient_accumulation_steps',
                                  'batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd')] + [
    count('max_iters', 0),
    count('warmup_iters', 0),
    ('lr_decay_iters', lambda v: v >= 0, 'an integer >= 0 (0: max_iters)'),
    ('dropout', lambda v: 0 <= v < 1, '0 <= dropout < 1'),
    ('learning_rate', lambda v: v > 0, 'a number > 0'),
    ('min_lr', lambda v: v >= 0, 'a number >= 0'),
    ('weight_decay', lambda v: v >= 0, 'a number >= 0'),
    ('beta1', lambda v: 0 <= v < 1, '0 <= beta1 < 1'),
    ('beta2', lambda v: 0 <= v < 1, '0 <= beta2 < 1'),
    ('grad_clip', lambda v: v >= 0, 'a number >= 0 (0: no clipping)'),
    ('init_from', lambda v: v in ('scratch', 'resume'), 'scratch or resume'),
]

def get_lr(it, cfg):
    """Linear warmup (never 0, not even at step 0), then cosine decay to min_lr."""
    if not cfg['decay_lr']:
        return cfg['learning_rate']
    decay_iters = cfg['lr_decay_iters'] or cfg['max_iters']
    if it < cfg['warmup_iters']:
        return cfg['learning_rate'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it > decay_iters:
        return cfg['min_lr']
    ratio = (it - cfg['warmup_iters']) / max(1, decay_iters - cfg['warmup_iters'])
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) # coeff ranges 0..1
    return cfg['min_lr'] + coeff * (cfg['learning_rate'] - cfg['min_lr'])

def load_checkpoint(path):
    """A checkpoint read safely (weights_only), or one clear line."""
    if not os.path.exists(path):
        fail(f"no checkpoint at {path} (check --out_dir)")
    if os.path.getsize(path) == 0:
        fail(f"{path} is empty (0 bytes): not a checkpoint")
    try:
        checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e: # torch's message would suggest weights_only=False: never for a file we did not write
        fail(f"{path} is not a readable checkpoint: truncated, damaged or another format ({type(e).__name__})")
    if not isinstance(checkpoint, dict) or not {'model', 'model_args'} <= set(checkpoint):
        fail(f"{path} is not a dar-gpt or nanoGPT checkpoint (no model and model_args in it)")
    return checkpoint

def save_checkpoint(checkpoint, path):
    """Write to a temp name, then rename: a crash never leaves a half-written ckpt.pt."""
    tmp = path + '.tmp'
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)

def resolve_device(device):
    if not (device in ('auto', 'cpu', 'mps', 'cuda') or (device.startswith('cuda:') and device[5:].isdigit())):
        fail(f"device={device!r} is out of range: auto, cpu, mps, cuda or cuda:N")
    if device == 'auto':
        if torch.cuda.is_available():
            return 'cuda'
        return 'mps' if torch.backends.mps.is_available() else 'cpu'
    if device.startswith('cuda') and not torch.cuda.is_available():
        fail(f"device={device} but CUDA is not available here (use --device=cpu or --device=auto)")
    if device == 'mps' and not torch.backends.mps.is_available():
        fail("device=mps but MPS is not available here (use --device=cpu or --device=auto)")
    return device

def autocast(device_type, dtype):
    """The dtype and its autocast context. 'auto': bfloat16 on CUDA where supported, else float16
    (with a GradScaler in train.py); float32 elsewhere."""
    if dtype == 'auto':
        dtype = 'float32' if device_type != 'cuda' else ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16')
    if dtype not in ('float32', 'bfloat16', 'float16'):
        fail(f"dtype={dtype} is not one of auto, float32, bfloat16, float16")
    return dtype, nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))

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

def main(argv):
    cfg, given = configure(DEFAULTS, argv)
    check(cfg, TRAIN_RULES)
    # the default depth_block (train.py's 2, or a preset file's) belongs to the depth paths: a path
    # without depth blocks takes none, unless --depth_block was asked for (then GPTConfig says why it cannot be)
    flags = {a[2:].split('=', 1)[0] for a in argv if a.startswith('--')}
    if cfg['residual'] not in ('attnres', 'dar') and 'depth_block' not in flags:
        cfg['depth_block'] = 1

    # various inits, derived attributes, I/O setup
    ddp = int(os.environ.get('RANK', -1)) != -1 # is this a ddp run?
    device = resolve_device(cfg['device'])
    if ddp:
        rank, local_rank, world_size = int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), int(os.environ['WORLD_SIZE'])
        if device.startswith('cuda'):
            device = f'cuda:{local_rank}'
            torch.cuda.set_device(device)
        backend = cfg['backend'] if cfg['backend'] != 'auto' else ('nccl' if device.startswith('cuda') else 'gloo')
        dist.init_process_group(backend=backend)
    else:
        rank, local_rank, world_size = 0, 0, 1
    master_process = rank == 0 # this process will do logging, checkpointing etc.
    accum = cfg['gradient_accumulation_steps']
    if accum % world_size != 0:
        fail(f"gradient_accumulation_steps={accum} is not divisible by the {world_size} DDP processes")
    tokens_per_iter = accum * cfg['batch_size'] * cfg['block_size']
    ckpt_path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    if cfg['init_from'] == 'scratch' and os.path.exists(ckpt_path) and not cfg['overwrite']:
        fail(f"{ckpt_path} exists: continue it with --init_from=resume, replace it with --overwrite=True, or set another --out_dir")
    if master_process:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
        try:
            os.makedirs(cfg['out_dir'], exist_ok=True)
        except OSError as e:
            fail(f"--out_dir={cfg['out_dir']}: {e.strerror}")
        if not os.access(cfg['out_dir'], os.W_OK):
            fail(f"--out_dir={cfg['out_dir']} is not writable")
    device_type = 'cuda' if 'cuda' in device else device # for later use in torch.autocast
    dtype, ctx = autocast(device_type, cfg['dtype'])
    # compile=None: on where it was measured faster end to end, compile time included (docs/bench.md):
    # on CUDA; on CPU every path runs faster eager, its depth reads one operation (depth_op.py)
    use_compile = cfg['compile'] if cfg['compile'] is not None else device_type == 'cuda'
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True # allow tf32 on matmul
        torch.backends.cudnn.allow_tf32 = True # allow tf32 on cudnn

    # data: every rank draws the same global batch from the same generator and takes its own
    # micro-batches, so the data stream does not depend on the number of processes
    data_dir = os.path.join(cfg['data_dir'], cfg['dataset'])
    train_shards = open_split(data_dir, 'train', cfg['block_size'])
    val_shards = open_split(data_dir, 'val', cfg['block_size'])
    n_train = sum(w for _, w in train_shards) # windows to sample from
    data_gen = torch.Generator().manual_seed(cfg['seed'])
    meta_path = os.path.join(data_dir, 'meta.pkl')
    meta_vocab_size = None
    if os.path.exists(meta_path):
        with open(meta_path, 'rb') as f:
            meta_vocab_size = pickle.load(f)['vocab_size']
        print(f"found vocab_size = {meta_vocab_size} (inside {meta_path})")

    # model init
    torch.manual_seed(cfg['seed'])
    iter_num, best_val_loss, checkpoint = 0, 1e9, None
    curve = [] # (iter, train loss, val loss) of every eval, kept in the checkpoint
    if cfg['init_from'] == 'scratch':
        model_args = {k: cfg[k] for k in MODEL_KEYS if k != 'vocab_size'}
        model_args['vocab_size'] = meta_vocab_size if meta_vocab_size is not None else 50304
        try:
            gptconf = GPTConfig(**model_args)
        except ValueError as e:
            fail(str(e))
        model = GPT(gptconf)
    elif cfg['init_from'] == 'resume':
        print(f"Resuming training from {cfg['out_dir']}")
        checkpoint = load_checkpoint(ckpt_path)
        model_args = checkpoint['model_args']
        # the architecture comes from the checkpoint; asking for another one is an error
        for k in sorted(given & set(model_args)):
            if cfg[k] != model_args[k]:
                fail(f"{ckpt_path} was trained with {k}={model_args[k]!r}; it cannot resume as {k}={cfg[k]!r}")
        if meta_vocab_size is not None and meta_vocab_size != model_args['vocab_size']:
            fail(f"{meta_path} has vocab_size {meta_vocab_size} but {ckpt_path} has {model_args['vocab_size']}: another dataset?")
        if meta_vocab_size is None and model_args['vocab_size'] < 50257:
            fail(f"{data_dir} holds GPT-2 BPE tokens (no meta.pkl) but {ckpt_path} has a vocabulary of {model_args['vocab_size']}: another dataset?")
        model = GPT.from_checkpoint(checkpoint)
        iter_num = checkpoint['iter_num']
        best_val_loss = checkpoint['best_val_loss']
        curve = checkpoint.get('curve', [])
    else:
        fail(f"init_from={cfg['init_from']} is not one of scratch, resume")
    model.to(device)
    if cfg['activation_checkpointing']:
        branches = {m for block in model.transformer.h for m in (block.attn, block.mlp)}
        apply_activation_checkpointing(model, check_fn=lambda m: m in branches)
    if cfg['fsdp']:
        if not ddp:
            fail("fsdp=True needs a distributed launch: torchrun --nproc_per_node=N train.py ...")
        # one FSDP unit per branch (the GPT calls the branches, not the Blocks), the rest in the root
        for block in model.transformer.h:
            fully_shard(block.attn)
            fully_shard(block.mlp)
        fully_shard(model)
    # checkpoints hold full, unsharded state dicts, whatever the parallelism that wrote them
    full_state = StateDictOptions(full_state_dict=True, cpu_offload=True)

    # initialize a GradScaler. If enabled=False scaler is a no-op
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
    optimizer = model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'], (cfg['beta1'], cfg['beta2']), device_type)
    if checkpoint is not None:
        set_optimizer_state_dict(model, optimizer, checkpoint['optimizer'], options=StateDictOptions(full_state_dict=True))
        scaler.load_state_dict(checkpoint['scaler'])
        rng = checkpoint['rng']
        data_gen.set_state(rng['data'])
        states = rng['torch'] if len(rng['torch']) == world_size else rng['torch'][:1] * world_size
        torch.set_rng_state(states[rank][0])
        if device_type == 'cuda' and states[rank][1] is not None:
            torch.cuda.set_rng_state(states[rank][1])
    else:
        torch.manual_seed(cfg['seed'] + rank) # dropout differs per rank, weights came out the same
    checkpoint = None # free up memory

    raw_model = model
    if use_compile:
        print("compiling the model... (takes a ~minute)")
        model = torch.compile(model)
    # without dropout, train and eval mode are the same function: a compiled model evaluates
    # through its training graph (grad on), where eval mode or no_grad would compile a second graph
    # (docs/bench.md). The eager model evaluates, in eval mode: with dropout; with eval_only (no
    # training to share the graph with); under DDP / FSDP, whose first compile must be their own
    # (DDP's graph is split at its gradient buckets)
    eval_graph = use_compile and cfg['dropout'] == 0 and not cfg['eval_only'] and not ddp
    eval_model = model if eval_graph else raw_model
    if ddp and not cfg['fsdp']:
        model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)

    def estimate_loss():
        """Mean LM loss of each split over eval_iters batches, the same batches at every eval;
        with MoE also the mean router losses and expert load on val."""
        out = {}
        if not eval_graph:
            raw_model.eval()
        for split, shards in (('train', train_shards), ('val', val_shards)):
            gen = torch.Generator().manual_seed(cfg['seed'] + 1)
            ix = torch.randint(sum(w for _, w in shards), (cfg['eval_iters'], cfg['batch_size']), generator=gen)
            losses, router = [], []
            for k in range(cfg['eval_iters']):
                X, Y = get_batch(shards, ix[k], cfg['block_size'], device)
                with ctx, torch.set_grad_enabled(eval_graph):
                    loss = eval_model(X, Y)[1].detach() # with grad on, no graph outlives its batch
                if raw_model.moe_stats is not None:
                    loss = raw_model.moe_stats['lm']
                    router.append(raw_model.moe_stats)
                losses.append(loss.item())
            out[split] = sum(losses) / len(losses)
            if router:
                out['router'] = {key: torch.stack([r[key] for r in router]).mean(0) for key in router[0]}
        raw_model.train()
        return out

    def rng_states():
        """Dropout RNG of every rank (gathered), and the shared data generator."""
        mine = (torch.get_rng_state(), torch.cuda.get_rng_state() if device_type == 'cuda' else None)
        states = [mine]
        if ddp:
            states = [None] * world_size
            dist.all_gather_object(states, (mine[0], mine[1].cpu() if mine[1] is not None else None))
        return dict(torch=states, data=data_gen.get_state())

    def checkpoint_now():
        return { # the state dicts are collectives under FSDP: every rank calls this
            'model': get_model_state_dict(raw_model, options=full_state),
            'optimizer': get_optimizer_state_dict(raw_model, optimizer, options=full_state),
            'scaler': scaler.state_dict(),
            'model_args': model_args,
            'iter_num': iter_num,
            'best_val_loss': best_val_loss,
            'curve': list(curve),
            'config': cfg,
            'rng': rng_states(),
        }

    # training loop
    max_iters = cfg['max_iters']
    # the bar only on a terminal: redirected to a log it would write a carriage return per update
    bar = tqdm(total=max_iters, initial=iter_num, disable=not master_process or not sys.stderr.isatty(), dynamic_ncols=True, leave=False)
    t0 = t_start = time.time()
    local_iter_num = 0 # number of iterations in the lifetime of this process
    running_mfu = -1.0
    # SIGINT / SIGTERM: finish the step, save a checkpoint, exit with 128 + the signal's number.
    # Repeats within REPEAT_S of the first are the same request: timeout(1) sends SIGTERM twice,
    # and Ctrl-C under torchrun reaches a rank from the terminal and from torchrun. A later one
    # exits at once (checkpoints are written to a temp name and renamed: the last one stays whole).
    first_signal = [] # (signal number, time) of the stop request
    def on_signal(signum, frame):
        name, now = signal.Signals(signum).name, time.monotonic()
        if not first_signal: # os.write: a print here could re-enter a print that the signal interrupted
            first_signal.append((signum, now))
            os.write(2, f"{name}: stopping at the end of this step; send it again to exit at once\n".encode())
        elif now - first_signal[0][1] > REPEAT_S:
            os.write(2, f"second {name}: exiting now; {ckpt_path} keeps the last saved checkpoint\n".encode())
            os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    def stop_requested():
        """The number of the signal that asked for a stop (0: none), the same on every rank, so
        that all ranks stop at the same iteration."""
        signum = first_signal[0][0] if first_signal else 0
        if not ddp:
            return signum
        flag = torch.tensor(signum, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item()
    while True:
        # evaluate the loss on train/val sets and write checkpoints
        last = iter_num >= max_iters
        stopping = stop_requested()
        if iter_num % cfg['eval_interval'] == 0 or last or stopping or cfg['eval_only']:
            # only a process that trained writes: eval_only, or resuming a finished run, leaves ckpt.pt as it is
            checkpoint = checkpoint_now() if local_iter_num > 0 else None # every rank joins the RNG gather
            if master_process and stopping:
                if checkpoint is not None:
                    save_checkpoint(checkpoint, ckpt_path)
                tqdm.write(f"stopped by {signal.Signals(stopping).name} at iteration {iter_num}"
                           + (f"; saved checkpoint to {ckpt_path}" if checkpoint is not None else ""))
            elif not stopping:
                losses = estimate_loss() # on every rank: under FSDP a forward is a collective
            if master_process and not stopping:
                line = f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                if 'router' in losses:
                    r = losses['router']
                    load = ' | '.join(' '.join(f"{100 * f:.0f}" for f in layer) for layer in r['load'].tolist())
                    line += f", val balance {r['balance']:.4f}, val z {r['z']:.4f}\n  expert load (% of slots, per MoE layer): {load}"
                tqdm.write(line)
                if not curve or curve[-1][0] < iter_num: # a resumed run re-evaluates its last step
                    curve.append((iter_num, losses['train'], losses['val']))
                if checkpoint is not None and (losses['val'] < best_val_loss or cfg['always_save_checkpoint']):
                    best_val_loss = min(best_val_loss, losses['val'])
                    checkpoint['best_val_loss'] = best_val_loss
                    checkpoint['curve'] = list(curve)
                    tqdm.write(f"saving checkpoint to {cfg['out_dir']}")
                    save_checkpoint(checkpoint, ckpt_path)
            checkpoint = None
        if last or stopping or cfg['eval_only']:
            break

        # determine and set the learning rate for this iteration
        lr = get_lr(iter_num, cfg)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr

        # forward backward update, with optional gradient accumulation to simulate larger batch size.
        # This rank's micro-batches of the global batch; DDP / FSDP sync gradients only on the last one.
        ix = torch.randint(n_train, (accum, cfg['batch_size']), generator=data_gen)[rank::world_size]
        train_loss = torch.zeros((), device=device)
        for micro_step, ix_micro in enumerate(ix):
            X, Y = get_batch(train_shards, ix_micro, cfg['block_size'], device)
            last_micro = micro_step == len(ix) - 1
            if cfg['fsdp']:
                raw_model.set_requires_gradient_sync(last_micro)
            sync = nullcontext() if not ddp or cfg['fsdp'] or last_micro else model.no_sync()
            with sync:
                with ctx:
                    logits, loss = model(X, Y)
                    loss = loss / len(ix) # scale the loss to account for gradient accumulation
                # backward pass, with gradient scaling if training in fp16
                scaler.scale(loss).backward()
            train_loss += loss.detach()
        # clip the gradient
        if cfg['grad_clip'] != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        # step the optimizer and scaler if training in fp16
        scaler.step(optimizer)
        scaler.update()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(train_loss.item()): # nothing of this step is saved
            bar.close()
            fail(f"loss is {train_loss.item()} at iter {iter_num + 1}: stopping; {ckpt_path} keeps the last good checkpoint")

        # timing and logging
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        iter_num += 1
        local_iter_num += 1
        if iter_num % cfg['log_interval'] == 0:
            if ddp: # the mean loss over all ranks' micro-batches
                dist.all_reduce(train_loss, op=dist.ReduceOp.AVG)
            if master_process:
                lossf = train_loss.item()
                line = f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, time {dt*1000:.2f}ms, {tokens_per_iter / dt:,.0f} tok/s"
                if raw_model.moe_stats is not None: # of the last micro-batch
                    r = raw_model.moe_stats
                    line += f", lm {r['lm']:.4f}, balance {r['balance']:.4f}, z {r['z']:.4f}"
                mfu = raw_model.estimate_mfu(cfg['batch_size'] * len(ix), dt) if local_iter_num >= 5 else None
                if mfu is not None:
                    running_mfu = mfu if running_mfu == -1.0 else 0.9*running_mfu + 0.1*mfu
                    line += f", mfu {running_mfu*100:.2f}%"
                tqdm.write(line)
                bar.set_postfix(loss=f"{lossf:.4f}", tok_s=f"{tokens_per_iter / dt:,.0f}")
        bar.update(1)
    bar.close()
    if master_process and local_iter_num > 0 and not stopping:
        saved = f"best val loss {best_val_loss:.4f} in {ckpt_path}; sample it with: python sample.py --out_dir={cfg['out_dir']}" \
            if os.path.exists(ckpt_path) else "no checkpoint saved"
        print(f"done: {iter_num} iterations, {local_iter_num} in this run in {time.time() - t_start:.0f} s; {saved}")
    if ddp:
        dist.destroy_process_group()
    return 128 + stopping if stopping else 0 # after a stop: a script sees the run did not finish

def exit_now(status):
    """Leave without Python's shutdown. In the shutdown Python's signal handlers are gone: a
    repeated signal would kill a saved run with a bare -15. Under DDP a gloo worker thread may
    still be releasing a finished collective, whose tensors need the GIL; CPython ends a thread
    that takes the GIL during finalization, and ending it inside a C++ destructor calls
    std::terminate (SIGABRT). Nothing is left unwritten: flush, exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

if __name__ == '__main__':
    exit_now(main(sys.argv[1:]))
