"""
The setup every dar-gpt script shares. The config, nanoGPT's configurator as functions: a script's
defaults, then config files (python that sets some of the same names) and --key=value overrides,
in the order given; a wrong key or type fails with one line that names it. Then the device, the
dtype with its autocast context, and a checkpoint read safely.
"""

import os
import ast
import sys
import ctypes
import difflib
import platform
from contextlib import nullcontext

import torch

from prepare_data import fail

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
            # as nanoGPT's: the file sees the config so far (max_iters = 2 * max_iters) and may import
            scope = dict(config)
            try:
                tree = ast.parse(source, arg)
                exec(compile(tree, arg, 'exec'), scope)
            except Exception as e:
                fail(f"config file {arg}: {type(e).__name__}: {e}")
            items = {k: scope[k] for k in assigned(tree) if not k.startswith('_')}
        elif '=' not in arg:
            fail(f"{arg}: overrides take the form --key=value")
        else:
            key, text = arg[2:].split('=', 1)
            try:
                value = ast.literal_eval(text) # 3 -> int, 1e-3 -> float, False -> bool
            except (ValueError, SyntaxError):
                value = text # a plain string
            if isinstance(defaults.get(key), str) and not isinstance(value, str): # --start=123: text
                value = text
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

def assigned(node):
    """The names a config file assigns at its top level: not an import's, nor those inside a function,
    a class or a comprehension."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp,
                         ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return set()
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    return set().union(*[assigned(child) for child in ast.iter_child_nodes(node)])

def check(cfg, rules):
    """One line naming the first value out of its range; rules: (key, ok(value), allowed range)."""
    for key, ok, allowed in rules:
        if not ok(cfg[key]):
            fail(f"{key}={cfg[key]!r} is out of range: {allowed}")

def count(key, least=1):
    """The rule for a count: an integer >= least."""
    return key, lambda v: v >= least, f'an integer >= {least}'

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

def keep_freed_memory():
    """On glibc, keep freed blocks up to 32 MB in the process, for reuse, rather than give them back to
    the OS: torch has no caching allocator on CPU, so each step's fresh buffers (the depth reads'
    gradients) would page-fault again (docs/bench.md). True where glibc took both settings."""
    if platform.libc_ver()[0] != 'glibc': # elsewhere (macOS, Windows, musl) these settings do not exist
        return False
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3 # glibc's malloc.h
    # blocks up to 32 MB (Full DAR's gradient buffers at 6 x 384: 18 MB) from the heap, never trimmed
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))

def autocast(device_type, dtype):
    """The dtype and its autocast context. 'auto': bfloat16 on CUDA where supported, else float16
    (with a GradScaler in train.py); float32 elsewhere."""
    if dtype == 'auto':
        dtype = 'float32' if device_type != 'cuda' else ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16')
    if dtype not in ('float32', 'bfloat16', 'float16'):
        fail(f"dtype={dtype} is not one of auto, float32, bfloat16, float16")
    return dtype, nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))
