"""
Train a dar-gpt model. The defaults below train Block DAR on shakespeare_char, sized for a
laptop CPU. Override them with config files (python that sets the same names) and --key=value:

$ python train.py
$ python train.py config/shakespeare_char.py --residual=attnres --depth_block=4

DDP on 8 GPUs of one node (gradient_accumulation_steps counts the micro-batches of all ranks):
$ torchrun --standalone --nproc_per_node=8 train.py config/shakespeare_char.py --gradient_accumulation_steps=8
python train.py --help lists every key with its default.
"""

import os
import sys
import math
import time
import pickle
import signal
from contextlib import nullcontext
from dataclasses import fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
    get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from tqdm import tqdm

from model import GPTConfig, GPT
from configurator import autocast, check, configure, count, keep_freed_memory, load_checkpoint, resolve_device
from prepare_data import fail, open_split, get_batch

# -----------------------------------------------------------------------------
# default config values: Block DAR on shakespeare_char, small enough for 2 CPU cores
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 20 # batches per split in an eval
eval_only = False # if True, script exits right after the first eval
always_save_checkpoint = True # if True, always save a checkpoint after each eval
init_from = 'scratch' # 'scratch', 'resume' (from out_dir/ckpt.pt), or a checkpoint file to start a run from
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
MODEL_KEYS = [f.name for f in fields(GPTConfig)] # vocab_size: from the data

TRAIN_RULES = [count(k) for k in ('eval_interval', 'log_interval', 'eval_iters', 'gradient_accumulation_steps',
                                  'batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd')] + [
    count('max_iters', 0), count('warmup_iters', 0),
    ('lr_decay_iters', lambda v: v >= 0, 'an integer >= 0 (0: max_iters)'),
    ('dropout', lambda v: 0 <= v < 1, '0 <= dropout < 1'),
    ('learning_rate', lambda v: v > 0, 'a number > 0'),
    *[(k, lambda v: v >= 0, 'a number >= 0') for k in ('min_lr', 'weight_decay')],
    *[(k, lambda v: 0 <= v < 1, f'0 <= {k} < 1') for k in ('beta1', 'beta2')],
    ('grad_clip', lambda v: v >= 0, 'a number >= 0 (0: no clipping)'),
    ('init_from', lambda v: v in ('scratch', 'resume') or v.endswith('.pt'), 'scratch, resume or a checkpoint file, *.pt'),
    ('compile', lambda v: v is None or isinstance(v, bool), 'True, False or None (on for CUDA only)'),
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

def save_checkpoint(checkpoint, path):
    """Write to a temp name, then rename: a crash never leaves a half-written ckpt.pt."""
    torch.save(checkpoint, path + '.tmp')
    os.replace(path + '.tmp', path)

def init_distributed(cfg):
    """(ddp, rank, local_rank, world_size, device): under torchrun, one process per rank."""
    device = resolve_device(cfg['device'])
    if int(os.environ.get('RANK', -1)) == -1: # not a ddp run
        return False, 0, 0, 1, device
    rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    if cfg['gradient_accumulation_steps'] % world_size != 0:
        fail(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} is not divisible by the {world_size} DDP processes")
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    dist.init_process_group(backend=cfg['backend'] if cfg['backend'] != 'auto' else ('nccl' if device.startswith('cuda') else 'gloo'))
    return True, rank, local_rank, world_size, device

def init_model(cfg, given, data_dir, ckpt_path):
    """The model, its args and, resuming, its checkpoint; the vocabulary from data_dir/meta.pkl."""
    meta_path, meta_vocab_size = os.path.join(data_dir, 'meta.pkl'), None
    if os.path.exists(meta_path):
        with open(meta_path, 'rb') as f:
            meta_vocab_size = pickle.load(f)['vocab_size']
        print(f"found vocab_size = {meta_vocab_size} (inside {meta_path})")
    torch.manual_seed(cfg['seed'])
    resume, checkpoint, change = cfg['init_from'] == 'resume', None, {}
    model_args = {**{k: cfg[k] for k in MODEL_KEYS if k != 'vocab_size'}, 'vocab_size': meta_vocab_size or 50304}
    if cfg['init_from'] != 'scratch':
        path = ckpt_path if resume else cfg['init_from']
        print(f"Resuming training from {cfg['out_dir']}" if resume else f"Starting from the weights of {path}")
        checkpoint = load_checkpoint(path)
        model_args = checkpoint['model_args']
        was = lambda k: model_args.get(k, getattr(GPTConfig, k)) # nanoGPT's checkpoints: our defaults
        # the architecture comes from the checkpoint, except a depth path for a new run from a dense
        # standard checkpoint: upcycled, the same first forward; asking for another is an error
        upcycle = not resume and 'residual' in given and cfg['residual'] != was('residual')
        change = {k: cfg[k] for k in ('residual', 'depth_block', 'include_partial', 'dar_routing')} if upcycle else {}
        if not resume and 'dropout' in given: # a run from weights sets its own dropout (nanoGPT's override_args)
            change['dropout'] = cfg['dropout']
        for k in sorted(given & set(MODEL_KEYS) - set(change) - {'vocab_size'}):
            if cfg[k] != was(k):
                fail(f"{path} was trained with {k}={was(k)!r}; it cannot {'resume' if resume else 'start a run'} as {k}={cfg[k]!r}")
        if upcycle and (was('residual') != 'standard' or was('n_expert') or cfg['residual'] not in ('attnres', 'dar')
                       or not cfg['include_partial'] or cfg['dar_routing'] == 'fixed'):
            fail(f"--residual={cfg['residual']}: upcycling takes a dense standard checkpoint to attnres or dar (not dar_routing="
                 f"fixed) with include_partial=True; {path} has residual={was('residual')}, n_expert={was('n_expert')}")
        if meta_vocab_size is not None and meta_vocab_size != model_args['vocab_size']:
            fail(f"{meta_path} has vocab_size {meta_vocab_size} but {path} has {model_args['vocab_size']}: another dataset?")
        if meta_vocab_size is None and model_args['vocab_size'] < 50257:
            fail(f"{data_dir} holds GPT-2 BPE tokens (no meta.pkl) but {path} has a vocabulary of {model_args['vocab_size']}: another dataset?")
    try:
        model = GPT.from_checkpoint(checkpoint, **change) if checkpoint else GPT(GPTConfig(**model_args))
    except ValueError as e:
        fail(str(e))
    cfg.update({k: getattr(model.config, k) for k in MODEL_KEYS if k in cfg}) # a checkpoint's: its block_size too
    return model, {**model_args, **change}, checkpoint if resume else None

def restore(checkpoint, model, optimizer, scaler, data_gen, cfg, rank, world_size, device_type):
    """A resumed run's optimizer, scaler, RNG states (dropout's: this rank's) and progress; else a new run."""
    if checkpoint is None:
        torch.manual_seed(cfg['seed'] + rank) # dropout differs per rank, weights came out the same
        return dict(iter_num=0, best_val_loss=1e9, curve=[]) # curve: (iter, train loss, val loss) of every eval
    set_optimizer_state_dict(model, optimizer, checkpoint['optimizer'], options=StateDictOptions(full_state_dict=True))
    scaler.load_state_dict(checkpoint['scaler'])
    data_gen.set_state(checkpoint['rng']['data'])
    states = checkpoint['rng']['torch'] if len(checkpoint['rng']['torch']) == world_size else checkpoint['rng']['torch'][:1] * world_size
    torch.set_rng_state(states[rank][0])
    if device_type == 'cuda' and states[rank][1] is not None:
        torch.cuda.set_rng_state(states[rank][1])
    return dict(iter_num=checkpoint['iter_num'], best_val_loss=checkpoint['best_val_loss'], curve=checkpoint.get('curve', []))

def rng_states(ddp, world_size, device_type, data_gen):
    """Dropout RNG of every rank (gathered), and the shared data generator."""
    mine = (torch.get_rng_state(), torch.cuda.get_rng_state() if device_type == 'cuda' else None)
    states = [None] * world_size if ddp else [mine]
    if ddp:
        dist.all_gather_object(states, (mine[0], mine[1].cpu() if mine[1] is not None else None))
    return dict(torch=states, data=data_gen.get_state())

def estimate_loss(model, raw_model, splits, cfg, ctx, device, grad):
    """Mean LM loss of each split over eval_iters batches, the same batches at every eval; with
    MoE also the mean router losses and expert load on val. grad: through the training graph."""
    out = {}
    raw_model.train(grad) # eval mode unless evaluating through the training graph
    for split, shards in splits.items():
        gen = torch.Generator().manual_seed(cfg['seed'] + 1)
        ix = torch.randint(sum(w for _, w in shards), (cfg['eval_iters'], cfg['batch_size']), generator=gen)
        losses, router = [], []
        for k in range(cfg['eval_iters']):
            X, Y = get_batch(shards, ix[k], cfg['block_size'], device)
            with ctx, torch.set_grad_enabled(grad):
                loss = model(X, Y)[1].detach() # with grad on, no graph outlives its batch
            if raw_model.moe_stats is not None:
                loss = raw_model.moe_stats['lm']
                router.append(raw_model.moe_stats)
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
        if router:
            out['router'] = {key: torch.stack([r[key] for r in router]).mean(0) for key in router[0]}
    raw_model.train()
    return out

class StopRequest:
    """SIGINT / SIGTERM: finish the step, save a checkpoint, exit with 128 + the signal's number. Repeats within
    REPEAT_S are one request (timeout(1) sends two, torchrun passes Ctrl-C on); a later one exits at once."""

    def __init__(self, ckpt_path):
        self.ckpt_path, self.first = ckpt_path, None # (signal number, time) of the request
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum, frame):
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.first is None: # os.write: a print here could re-enter a print that the signal interrupted
            self.first = (signum, now)
            os.write(2, f"{name}: stopping at the end of this step; send it again to exit at once\n".encode())
        elif now - self.first[1] > REPEAT_S:
            os.write(2, f"second {name}: exiting now; {self.ckpt_path} keeps the last saved checkpoint\n".encode())
            os._exit(1)

    def signum(self, ddp, device):
        """The signal that asked for a stop (0: none), the same on every rank: all stop together."""
        signum = self.first[0] if self.first else 0
        if not ddp:
            return signum
        flag = torch.tensor(signum, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item()

def init_out_dir(cfg, master_process):
    """out_dir made and writable; its ckpt.pt, which a scratch run may replace only with --overwrite."""
    ckpt_path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    if cfg['init_from'] != 'resume' and os.path.exists(ckpt_path) and not cfg['overwrite']:
        fail(f"{ckpt_path} exists: continue it with --init_from=resume, replace it with --overwrite=True, or set another --out_dir")
    if master_process:
        try:
            os.makedirs(cfg['out_dir'], exist_ok=True)
        except OSError as e:
            fail(f"--out_dir={cfg['out_dir']}: {e.strerror}")
        if not os.access(cfg['out_dir'], os.W_OK):
            fail(f"--out_dir={cfg['out_dir']} is not writable")
    return ckpt_path

def shard(model, cfg, ddp):
    """Activation checkpointing of each branch, and FSDP2: one unit per branch, the rest in the root."""
    branches = [m for layer in model.transformer.h for m in (layer.attn, layer.mlp)]
    if cfg['activation_checkpointing']:
        apply_activation_checkpointing(model, check_fn=lambda m: any(m is b for b in branches))
    if cfg['fsdp']:
        if not ddp:
            fail("fsdp=True needs a distributed launch: torchrun --nproc_per_node=N train.py ...")
        for branch in branches + [model]:
            fully_shard(branch)

def train_step(model, raw_model, optimizer, scaler, shards, ix, cfg, ctx, device, ddp):
    """Forward, backward and update over this rank's micro-batches ix of the global batch, with
    gradient accumulation; DDP / FSDP sync gradients only on the last one. Returns the loss."""
    train_loss = torch.zeros((), device=device)
    for micro_step, ix_micro in enumerate(ix):
        X, Y = get_batch(shards, ix_micro, cfg['block_size'], device)
        last_micro = micro_step == len(ix) - 1
        if cfg['fsdp']:
            raw_model.set_requires_gradient_sync(last_micro)
        with nullcontext() if not ddp or cfg['fsdp'] or last_micro else model.no_sync():
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
    return train_loss

def wrap(model, cfg, use_compile, ddp, local_rank, device_type):
    """The model to train (compiled, in DDP), the one to evaluate, and whether evals run through the training
    graph, not a second one (docs/bench.md): not with dropout, eval_only (no training), DDP / FSDP (their own)."""
    if use_compile:
        print("compiling the model... (takes a ~minute)")
    compiled = torch.compile(model) if use_compile else model
    eval_graph = use_compile and cfg['dropout'] == 0 and not cfg['eval_only'] and not ddp
    if ddp and not cfg['fsdp']:
        compiled = DDP(compiled, device_ids=[local_rank] if device_type == 'cuda' else None)
    return compiled, (compiled if eval_graph else model), eval_graph

def evaluated(losses, stopping, run, checkpoint, ckpt_path, cfg):
    """Log an eval, save its checkpoint if best or always_save_checkpoint; stopping: save, say so."""
    if stopping:
        if checkpoint is not None:
            save_checkpoint(checkpoint, ckpt_path)
        tqdm.write(f"stopped by {signal.Signals(stopping).name} at iteration {run['iter_num']}"
                   + (f"; saved checkpoint to {ckpt_path}" if checkpoint is not None else ""))
        return
    line = f"step {run['iter_num']}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
    if 'router' in losses:
        r = losses['router']
        load = ' | '.join(' '.join(f"{100 * f:.0f}" for f in layer) for layer in r['load'].tolist())
        line += f", val balance {r['balance']:.4f}, val z {r['z']:.4f}\n  expert load (% of slots, per MoE layer): {load}"
    tqdm.write(line)
    if not run['curve'] or run['curve'][-1][0] < run['iter_num']: # a resumed run re-evaluates its last step
        run['curve'].append((run['iter_num'], losses['train'], losses['val']))
    if checkpoint is not None and (losses['val'] < run['best_val_loss'] or cfg['always_save_checkpoint']):
        run['best_val_loss'] = min(run['best_val_loss'], losses['val'])
        checkpoint.update(best_val_loss=run['best_val_loss'], curve=list(run['curve']))
        tqdm.write(f"saving checkpoint to {cfg['out_dir']}")
        save_checkpoint(checkpoint, ckpt_path)

def step_line(it, loss, lr, dt, tokens, moe_stats, mfu):
    """The log line of a training step; with MoE the last micro-batch's router losses."""
    line = f"iter {it}: loss {loss:.4f}, lr {lr:.2e}, time {dt*1000:.2f}ms, {tokens / dt:,.0f} tok/s"
    if moe_stats is not None:
        line += f", lm {moe_stats['lm']:.4f}, balance {moe_stats['balance']:.4f}, z {moe_stats['z']:.4f}"
    return line + (f", mfu {mfu*100:.2f}%" if mfu is not None else "")

def main(argv):
    cfg, given = configure(DEFAULTS, argv)
    check(cfg, TRAIN_RULES)
    # the default depth_block is the depth paths'; the others take none unless asked (then GPTConfig says why not)
    if cfg['residual'] not in ('attnres', 'dar') and 'depth_block' not in {a[2:].split('=', 1)[0] for a in argv}:
        cfg['depth_block'] = 1

    # various inits, derived attributes, I/O setup
    ddp, rank, local_rank, world_size, device = init_distributed(cfg)
    master_process = rank == 0 # this process will do logging, checkpointing etc.
    ckpt_path = init_out_dir(cfg, master_process)
    device_type = 'cuda' if 'cuda' in device else device # for later use in torch.autocast
    dtype, ctx = autocast(device_type, cfg['dtype'])
    # compile=None: on CUDA only; on CPU every path ran faster eager end to end (docs/bench.md)
    use_compile = cfg['compile'] if cfg['compile'] is not None else device_type == 'cuda'
    torch.backends.cuda.matmul.allow_tf32 = True # allow tf32 on matmul
    torch.backends.cudnn.allow_tf32 = True # allow tf32 on cudnn
    keep_freed_memory() # on CPU, no page faults on each step's fresh buffers

    # data: every rank draws the same global batch from the same generator and takes its own
    # micro-batches, so the data stream does not depend on the number of processes
    data_dir = os.path.join(cfg['data_dir'], cfg['dataset'])
    data_gen = torch.Generator().manual_seed(cfg['seed'])

    # model, optimizer and, resuming, their state
    raw_model, model_args, checkpoint = init_model(cfg, given, data_dir, ckpt_path)
    splits = {split: open_split(data_dir, split, cfg['block_size']) for split in ('train', 'val')}
    tokens_per_iter = cfg['gradient_accumulation_steps'] * cfg['batch_size'] * cfg['block_size']
    if master_process:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
    raw_model.to(device)
    shard(raw_model, cfg, ddp)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16')) # a no-op unless float16
    optimizer = raw_model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'], (cfg['beta1'], cfg['beta2']), device_type)
    run = restore(checkpoint, raw_model, optimizer, scaler, data_gen, cfg, rank, world_size, device_type)
    checkpoint = None # free up memory
    model, eval_model, eval_graph = wrap(raw_model, cfg, use_compile, ddp, local_rank, device_type)
    # checkpoints hold full, unsharded state dicts, whatever the parallelism that wrote them
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    checkpoint_now = lambda: dict( # the state dicts are collectives under FSDP: every rank calls this
        model=get_model_state_dict(raw_model, options=full), optimizer=get_optimizer_state_dict(raw_model, optimizer, options=full),
        scaler=scaler.state_dict(), model_args=model_args, config=cfg, rng=rng_states(ddp, world_size, device_type, data_gen),
        iter_num=run['iter_num'], best_val_loss=run['best_val_loss'], curve=list(run['curve']))

    # training loop; the bar only on a terminal (in a log it would write a carriage return per update)
    bar = tqdm(total=cfg['max_iters'], initial=run['iter_num'], disable=not master_process or not sys.stderr.isatty(), dynamic_ncols=True, leave=False)
    t0, t_start, stop = time.time(), time.time(), StopRequest(ckpt_path)
    local_iter_num, running_mfu = 0, None # number of iterations in the lifetime of this process
    while True:
        # evaluate the loss on train/val sets and write checkpoints
        iter_num, stopping = run['iter_num'], stop.signum(ddp, device)
        last = iter_num >= cfg['max_iters']
        if iter_num % cfg['eval_interval'] == 0 or last or stopping or cfg['eval_only']:
            # only a process that trained writes: eval_only, or resuming a finished run, leaves ckpt.pt as it is
            checkpoint = checkpoint_now() if local_iter_num > 0 else None # every rank joins the RNG gather
            # on every rank: under FSDP a forward is a collective
            losses = None if stopping else estimate_loss(eval_model, raw_model, splits, cfg, ctx, device, eval_graph)
            if master_process:
                evaluated(losses, stopping, run, checkpoint, ckpt_path, cfg)
            checkpoint = None
        if last or stopping or cfg['eval_only']:
            break

        # determine and set the learning rate for this iteration
        lr = get_lr(iter_num, cfg)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        # this rank's micro-batches of the global batch
        ix = torch.randint(sum(w for _, w in splits['train']), (cfg['gradient_accumulation_steps'], cfg['batch_size']), generator=data_gen)[rank::world_size]
        train_loss = train_step(model, raw_model, optimizer, scaler, splits['train'], ix, cfg, ctx, device, ddp)
        if not math.isfinite(train_loss.item()): # nothing of this step is saved
            bar.close()
            fail(f"loss is {train_loss.item()} at iter {iter_num + 1}: stopping; {ckpt_path} keeps the last good checkpoint")

        # timing and logging
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        run['iter_num'] = iter_num = iter_num + 1
        local_iter_num += 1
        if iter_num % cfg['log_interval'] == 0:
            if ddp: # the mean loss over all ranks' micro-batches
                dist.all_reduce(train_loss, op=dist.ReduceOp.AVG)
            mfu = raw_model.estimate_mfu(cfg['batch_size'] * len(ix), dt) if local_iter_num >= 5 else None
            if mfu is not None:
                running_mfu = mfu if running_mfu is None else 0.9*running_mfu + 0.1*mfu
            if master_process:
                tqdm.write(step_line(iter_num, train_loss.item(), lr, dt, tokens_per_iter, raw_model.moe_stats, running_mfu))
                bar.set_postfix(loss=f"{train_loss.item():.4f}", tok_s=f"{tokens_per_iter / dt:,.0f}")
        bar.update(1)
    bar.close()
    if master_process and local_iter_num > 0 and not stopping:
        saved = f"best val loss {run['best_val_loss']:.4f} in {ckpt_path}; sample it with: python sample.py --out_dir={cfg['out_dir']}" if os.path.exists(ckpt_path) else "no checkpoint saved"
        print(f"done: {iter_num} iterations, {local_iter_num} in this run in {time.time() - t_start:.0f} s; {saved}")
    if ddp: # every rank past its last collective before any tears the group down
        dist.barrier(device_ids=[local_rank] if device_type == 'cuda' else None) # (named: no NCCL warning)
        dist.destroy_process_group()
    return 128 + stopping if stopping else 0 # after a stop: a script sees the run did not finish

def exit_now(status):
    """Flush, then exit without Python's shutdown: there a repeated signal would kill a saved run (bare
    -15), and under DDP a gloo thread that still releases a collective ends in std::terminate."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)

if __name__ == '__main__':
    exit_now(main(sys.argv[1:]))
