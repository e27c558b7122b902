#!/usr/bin/python3
"""Data-parallel training on Fashion-MNIST with PyTorch DDP, on gradsync's c10d backend or gloo.

An ordinary DDP script: a PyTorch user who switches to gradsync changes two lines,
`import gradsync.torch` (registers the "gradsync" backend) and
`dist.init_process_group("gradsync")`. Everything else is stock torch (1.13 and later),
numpy and the standard library, so the same script with --backend gloo is the comparison.

The models match gradsync-train's (examples/train): `mlp` 784-2048x4-10 with ReLU (14.2 M
parameters; --width/--depth change it) and `cnn`, a small LeNet-style network (215 k).

Rank and world size come from init_process_group's env:// rendezvous: torchrun and
gradsync-run both set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (started by hand, the
script is one process of one rank).

  /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
      --redirects 1 --tee 1 --log_dir /tmp/torchrun-logs examples/torch/train.py --backend gloo
  build/tools/gradsync-run -n 4 -- /usr/bin/python3 examples/torch/train.py --model cnn

Run with --help for the flags; examples/torch/README.md has more.
"""

import argparse
import contextlib
import gc
import gzip
import importlib
import json
import math
import os
import signal
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PROG = os.path.basename(sys.argv[0]) or "train.py"  # also when imported by bench/torch
CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = "gradsync-examples-torch-train/1"
TORCH_HOOKS = "none, fp16, bf16, powersgd[:rank=R[,start=S]]"


def fail(message):
    """Ends the process with a one-line reason (every rank prints its own)."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---------------------------------------------------------------------------------------
# Flags


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog=PROG, description="PyTorch DDP on Fashion-MNIST (gradsync's c10d backend or gloo).")
    p.add_argument("--backend", default="gradsync", choices=["gradsync", "gloo"],
                   help="c10d backend (default gradsync; gloo is torch's own)")
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    p.add_argument("--width", type=int, default=2048, help="mlp: hidden layer width (2048)")
    p.add_argument("--depth", type=int, default=4, help="mlp: hidden layers (4)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per micro-batch")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                   help="sgd (momentum 0.9; none when the hook's codec has momentum=M) "
                        "or adamw (weight decay 0.01)")
    p.add_argument("--lr", type=float, default=None, help="default 0.05 sgd, 0.001 adamw")
    p.add_argument("--seed", type=int, default=1, help="weights and data order")
    p.add_argument("--hook", default="none", metavar="SPEC",
                   help=f"DDP communication hook: torch's {TORCH_HOOKS}; any other SPEC "
                        "is a gradsync codec, gradsync.torch.hooks.codec(SPEC), e.g. "
                        "topk:ratio=0.01")
    p.add_argument("--step-ahead", action="store_true",
                   help="with a gradsync codec hook: forward and backward at value - lr x what "
                        "error feedback holds back (hook.step_ahead; top-k needs it)")
    p.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="K micro-batches per optimizer step; the first K-1 under no_sync()")
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"],
                   help="CPU autocast dtype; fp16 adds a dynamic loss scaler")
    p.add_argument("--loss-scale", type=float, default=2.0 ** 16,
                   help="fp16: the loss scaler's first scale (65536)")
    p.add_argument("--scale-growth-interval", type=int, default=2000,
                   help="fp16: double the scale after this many steps without inf/NaN")
    p.add_argument("--zero", action="store_true",
                   help="shard the optimizer state (torch's ZeroRedundancyOptimizer)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size (torch's default 25; see powersgd in the README)")
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--find-unused-parameters", action="store_true")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="rank 0 saves DIR/checkpoint.pt (atomically) after every epoch")
    p.add_argument("--resume", action="store_true",
                   help="continue from DIR/checkpoint.pt if there is one (else start)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after N optimizer steps in all (0: no limit)")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the run's results to FILE")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                   help="directory of the four *-idx?-ubyte.gz files")
    p.add_argument("--train-limit", type=int, default=0,
                   help="use only the first N training samples (0: all 60000)")
    p.add_argument("--test-limit", type=int, default=0,
                   help="use only the first N test samples (0: all 10000)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fail-once-after-epoch", type=int, default=None, metavar="E",
                   help="testing --resume: the last rank kills itself (SIGKILL) after epoch E "
                        "is saved, on a job's first attempt only (TORCHELASTIC_RESTART_COUNT "
                        "unset or 0)")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p, args):
    """Refuses flags that cannot work, before any rank waits for the others."""
    positive = {"--width": args.width, "--depth": args.depth, "--epochs": args.epochs,
                "--batch": args.batch, "--accumulate": args.accumulate,
                "--scale-growth-interval": args.scale_growth_interval}
    for flag, value in positive.items():
        if value < 1:
            p.error(f"{flag} must be at least 1, not {value}")
    for flag, value in {"--max-steps": args.max_steps, "--train-limit": args.train_limit,
                        "--test-limit": args.test_limit}.items():
        if value < 0:
            p.error(f"{flag} must be 0 or more, not {value}")
    if args.lr is None:
        args.lr = 0.05 if args.optimizer == "sgd" else 1e-3
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr must be a positive number, not {args.lr}")
    if not (args.loss_scale > 0 and math.isfinite(args.loss_scale)):
        p.error(f"--loss-scale must be a positive number, not {args.loss_scale}")
    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        p.error(f"--bucket-cap-mb must be positive, not {args.bucket_cap_mb}")
    if args.optimizer != "sgd" and codec_momentum(args.hook):
        p.error(f"--hook {args.hook}: a codec with momentum= takes the place of SGD's momentum: "
                "use --optimizer sgd")
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint DIR")
    if args.fail_once_after_epoch is not None and not args.checkpoint:
        p.error("--fail-once-after-epoch tests --resume: it needs --checkpoint DIR")


# ---------------------------------------------------------------------------------------
# Communication hooks: torch's own by name, anything else a gradsync codec. Shared with
# bench/torch/ddp_step.py, so the benchmark times exactly what this script trains with.


def parse_params(spec, text, allowed):
    """'rank=4,start=2' -> {'rank': 4, 'start': 2}: whole numbers, only the names allowed."""
    params = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            fail(f"--hook {spec}: '{item}' is not one of {', '.join(k + '=N' for k in allowed)}")
        try:
            params[key] = int(value)
        except ValueError:
            fail(f"--hook {spec}: {key}={value} is not a whole number")
    return params


def parse_hook(spec):
    """Checks --hook SPEC now and returns make(), which after init_process_group gives the
    (state, hook) pair to register, or None for no hook."""
    name, _, text = spec.partition(":")
    if spec == "none":
        return lambda: None
    if name == "gradsync":  # gradsync's codec even where torch has a hook of that name
        return gradsync_codec_hook(text)
    if spec in ("fp16", "bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hook = getattr(default_hooks, f"{spec}_compress_hook", None)
        if hook is None:
            fail(f"--hook {spec}: torch {torch.__version__} has no {spec}_compress_hook")
        if spec == "bf16":
            return lambda: (None, bf16_compress(hook))
        return lambda: (None, hook)  # state None: the default process group
    if name == "powersgd":
        params = parse_params(spec, text, ("rank", "start"))
        rank, start = params.get("rank", 4), params.get("start", 2)
        if rank < 1 or start < 2:
            # PowerSGDState refuses start < 2 with error feedback (its default) on.
            fail(f"--hook {spec}: needs rank >= 1 and start >= 2")
        return lambda: powersgd_hook(rank, start)
    return gradsync_codec_hook(spec)


def bf16_compress(hook):
    """torch's bf16_compress_hook under another name. DDP (1.13 at least) refuses a hook
    of that name unless torch was built with CUDA 11+ and NCCL 2.10+, a guard for NCCL;
    the hook itself only all-reduces a bfloat16 copy of each bucket, which needs nothing
    but a backend that sums bfloat16: checked here, once, on every rank."""
    probe = torch.zeros(1, dtype=torch.bfloat16)
    try:
        dist.all_reduce(probe)
    except RuntimeError as e:  # gloo 1.13: "Invalid scalar type", on every rank alike
        fail(f"--hook bf16: the {dist.get_backend()} backend cannot all-reduce bfloat16 "
             f"({str(e).strip()})")

    def bf16_compress_any_backend(state, bucket):
        return hook(state, bucket)
    return bf16_compress_any_backend


def powersgd_hook(rank, start):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    # start: torch's default (1000 plain all-reduces first) would leave short runs
    # uncompressed; 2 is the earliest its error feedback allows.
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=start)
    return state, powersgd.powerSGD_hook


def gradsync_codec_hook(spec):
    """A gradsync codec as a DDP hook. gradsync.torch.hooks.codec(SPEC) may return the hook
    itself or a (state, hook) pair; both are accepted."""
    try:
        hooks = importlib.import_module("gradsync.torch.hooks")
    except ImportError as e:
        fail(f"--hook {spec}: not one of torch's hooks ({TORCH_HOOKS}), so it names a gradsync "
             f"codec, and that needs the gradsync Python module, which does not import here "
             f"({e}). Put it on PYTHONPATH, or use one of torch's hooks.")

    def make():
        try:
            made = hooks.codec(spec)
        except (ValueError, TypeError, RuntimeError) as e:
            fail(f"--hook {spec}: {e}")
        return tuple(made) if isinstance(made, (tuple, list)) else (None, made)
    return make


def codec_momentum(spec):
    """The momentum=M of a gradsync codec's SPEC, 0 without. Such a codec applies momentum
    itself (momentum correction, on what it sends and what it holds back), in place of SGD's,
    as gradsync-train does: both at once would compound them."""
    text = spec[len("gradsync:"):] if spec.startswith("gradsync:") else spec
    for item in text.partition(":")[2].split(","):
        key, _, value = item.partition("=")
        if key == "momentum":
            try:
                return float(value)
            except ValueError:
                return 0.0  # the codec itself names the bad value
    return 0.0


def bucket_cap_mb(args):
    """--bucket-cap-mb, or for powersgd over gloo one bucket for the whole model: torch
    1.13's PowerSGD hook over gloo aborts ("op.preamble.length <= op.nbytes") when two
    buckets' hooks run their all-reduces at once on one process group."""
    if args.bucket_cap_mb is not None:
        return args.bucket_cap_mb
    if args.hook.startswith("powersgd") and args.backend == "gloo":
        return 100000.0
    return 25.0


# ---------------------------------------------------------------------------------------
# Process group


def init_distributed(backend):
    """Joins the job through env:// and returns (rank, world). Started without a launcher,
    the process is the whole job: rank 0 of 1."""
    if backend == "gradsync":
        try:
            import gradsync.torch  # noqa: F401  registers the "gradsync" c10d backend
        except ImportError as e:
            fail(f"--backend gradsync: the gradsync Python module does not import ({e}); "
                 "put it on PYTHONPATH, or run with --backend gloo")
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend=backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# Data: the IDX files as gzip, read with numpy (no torchvision)


def read_idx(path, magic, dims):
    """An IDX file's uint8 array, its header checked: the format's magic (2051 images, 2049
    labels), then `dims` big-endian sizes."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw, dtype=">u4", count=1 + dims)
    if header[0] != magic:
        raise ValueError(f"{path}: magic {header[0]}, expected {magic}: not an IDX file")
    shape = tuple(int(d) for d in header[1:])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 * (1 + dims))
    if data.size != math.prod(shape):
        raise ValueError(f"{path}: {data.size} bytes of data for shape {shape}")
    return data.reshape(shape)


def load_split(data_dir, prefix, limit):
    """Images as float32 N x 1 x 28 x 28 in [0, 1] (x / 255, as gradsync-train), labels
    int64; only the first `limit` samples when limit > 0."""
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), 2051, 3)
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), 2049, 1)
    if len(images) != len(labels):
        raise ValueError(f"{data_dir}: {len(images)} {prefix} images but {len(labels)} labels")
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return TensorDataset(x, y)


# ---------------------------------------------------------------------------------------
# Models, the same shapes as gradsync-train's (examples/train/model.h)


def mlp(width=2048, depth=4):
    """784 -> width x depth -> 10, ReLU between; 14,217,226 parameters as default."""
    widths = [784] + [width] * depth + [10]
    layers = [nn.Flatten()]
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < depth:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def cnn():
    """LeNet-style: conv 5x5 1->16, pool, conv 5x5 16->32, pool, fc 1568->128->10 (215,370)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 14 x 14
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 7 x 7
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def build_model(args):
    torch.manual_seed(args.seed)  # the same weights on every rank (DDP broadcasts rank 0's)
    return mlp(args.width, args.depth) if args.model == "mlp" else cnn()


def make_optimizer(params, args):
    if args.optimizer == "sgd":
        momentum = 0.0 if codec_momentum(args.hook) else 0.9
        cls, options = torch.optim.SGD, dict(lr=args.lr, momentum=momentum)
    else:
        cls, options = torch.optim.AdamW, dict(lr=args.lr, weight_decay=0.01)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **options)
    return cls(params, **options)


# ---------------------------------------------------------------------------------------
# Mixed precision


def cpu_autocast_supports(dtype):
    """Whether this torch autocasts to `dtype` on the CPU (1.13 does bfloat16 only)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast("cpu", dtype=dtype):
                pass
        return True
    except RuntimeError:
        return False


def autocast_factory(amp, rank):
    """A function giving the forward pass's autocast context for --amp."""
    if amp == "none":
        return contextlib.nullcontext, False
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    if not cpu_autocast_supports(dtype):
        if rank == 0:
            print(f"{PROG}: warning: torch {torch.__version__} cannot autocast to {amp} on the "
                  "CPU; the forward pass stays float32 (the loss scaler still runs)",
                  file=sys.stderr, flush=True)
        return contextlib.nullcontext, False
    return (lambda: torch.autocast("cpu", dtype=dtype)), True


class DynamicLossScaler:
    """fp16's loss scaling, as torch.cuda.amp.GradScaler does it (which is CUDA-only):
    the loss is multiplied by `scale` so small fp16 gradients do not flush to zero; the
    gradients are divided by it again before the optimizer sees them. A step whose
    gradients hold an inf or NaN is skipped on every rank and the scale halved; after
    `growth_interval` good steps in a row the scale doubles."""

    def __init__(self, scale, growth_interval):
        self.scale = float(scale)
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def scale_loss(self, loss):
        return loss * self.scale

    def unscale_and_check(self, params):
        """Divides the gradients by the scale; True when every rank's are finite.
        DDP's averaged gradients are the same on every rank, so the ranks would mostly agree
        anyway; the 4-byte all-reduce makes sure they do (a codec that decodes differently
        per rank, ZeRO's shards), because a rank that steps while another skips diverges."""
        inv = 1.0 / self.scale
        finite = True
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)
                finite = finite and bool(torch.isfinite(p.grad).all())
        found_inf = torch.tensor([0.0 if finite else 1.0])
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return found_inf.item() == 0.0

    def update(self, stepped):
        if not stepped:
            self.scale *= 0.5
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self):
        return dict(scale=self.scale, good_steps=self.good_steps, skipped=self.skipped)

    def load_state_dict(self, state):
        self.scale, self.good_steps, self.skipped = (
            state["scale"], state["good_steps"], state["skipped"])


# ---------------------------------------------------------------------------------------
# Checkpoints: rank 0 writes one file, replaced atomically; every rank reads it


def save_checkpoint(directory, rank, model, optimizer, state):
    """Called on every rank: ZeroRedundancyOptimizer must first gather its shards on rank 0
    (a collective). A crash mid-write leaves the previous checkpoint whole: the new one is
    written beside it, synced, then renamed over it."""
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
    if rank != 0:
        return
    state = dict(state, format=CHECKPOINT_FORMAT, model=model.state_dict(),
                 optimizer=optimizer.state_dict())
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CHECKPOINT_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)  # the rename itself survives a power cut
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(directory, args):
    """The checkpoint in `directory`, or None when there is none yet (a job's first start
    with --resume, as torchrun --max_restarts repeats the same command line)."""
    path = os.path.join(directory, CHECKPOINT_FILE)
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu")
    if state.get("format") != CHECKPOINT_FORMAT:
        fail(f"{path}: not a checkpoint of this script")
    saved = state["shape"]
    if saved != model_shape(args):
        fail(f"{path}: holds a {saved} model, not the {model_shape(args)} the flags ask for")
    return state


def model_shape(args):
    return f"mlp {args.width}x{args.depth}" if args.model == "mlp" else "cnn"


# ---------------------------------------------------------------------------------------
# Progress and results


class Progress:
    """One line on rank 0, rewritten in place with \\r, at most 5 times a second."""

    def __init__(self, enabled, epoch, epochs, total):
        self.enabled, self.epoch, self.epochs, self.total = enabled, epoch, epochs, total
        self.start = self.last = time.perf_counter()
        self.width = 0

    def update(self, done, loss, force=False):
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < 0.2):
            return
        self.last = now
        filled = 20 * done // max(self.total, 1)
        rate = done / max(now - self.start, 1e-9)
        line = (f"epoch {self.epoch + 1}/{self.epochs} [{'#' * filled}{'.' * (20 - filled)}] "
                f"{done}/{self.total} loss {loss:.4f} {rate:.1f} steps/s")
        self.width = max(self.width, len(line))
        sys.stdout.write("\r" + line.ljust(self.width))
        sys.stdout.flush()

    def finish(self, done, loss):
        self.update(done, loss, force=True)
        if self.enabled:
            sys.stdout.write("\n")


def write_json(path, report):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Training


def evaluate(model, test_set, rank, world, train_loss_sum, train_steps):
    """Test loss and accuracy over the whole test set, each rank scoring every world-th
    sample, and the training loss averaged over every rank's steps: one all-reduce."""
    x, y = (t[rank::world] for t in test_set.tensors)
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            logits = model(x[i:i + 1000])
            loss_sum += nn.functional.cross_entropy(logits, y[i:i + 1000], reduction="sum").item()
            correct += int((logits.argmax(1) == y[i:i + 1000]).sum())
    model.train()
    totals = torch.tensor([loss_sum, correct, len(x), train_loss_sum, train_steps],
                          dtype=torch.float32)
    dist.all_reduce(totals)
    test_loss = totals[0].item() / max(totals[2].item(), 1)
    accuracy = totals[1].item() / max(totals[2].item(), 1)
    train_loss = totals[3].item() / max(totals[4].item(), 1)
    return test_loss, accuracy, train_loss


class Trainer:
    """One rank's training: the DDP model, its optimizer, and the epoch loop."""

    def __init__(self, args, rank, world, make_hook):
        self.args, self.rank, self.world = args, rank, world
        self.train_set = load_split(args.data, "train", args.train_limit)
        self.test_set = load_split(args.data, "t10k", args.test_limit)
        module = build_model(args)
        self.parameters = sum(p.numel() for p in module.parameters())
        self.resumed = load_checkpoint(args.checkpoint, args) if args.resume else None
        if self.resumed:
            module.load_state_dict(self.resumed["model"])
        self.model = DDP(module, bucket_cap_mb=bucket_cap_mb(args),
                         find_unused_parameters=args.find_unused_parameters,
                         gradient_as_bucket_view=args.gradient_as_bucket_view,
                         static_graph=args.static_graph)
        hook = make_hook()
        self.step_ahead = None
        if hook is not None:
            self.model.register_comm_hook(*hook)
            if args.step_ahead:
                self.step_ahead = getattr(hook[1], "step_ahead", None)  # gradsync codecs
        self.optimizer = make_optimizer(self.model.parameters(), args)
        self.autocast, self.autocast_on = autocast_factory(args.amp, rank)
        self.scaler = (DynamicLossScaler(args.loss_scale, args.scale_growth_interval)
                       if args.amp == "fp16" else None)
        self.sampler = DistributedSampler(self.train_set, num_replicas=world, rank=rank,
                                          shuffle=True, seed=args.seed)
        self.loader = DataLoader(self.train_set, batch_size=args.batch, sampler=self.sampler)
        self.step, self.next_epoch, self.history, self.step_times = 0, 0, [], []
        self.steps_here = 0  # optimizer steps of this process (self.step counts resumed ones)
        if self.resumed:
            self.restore(self.resumed)

    def restore(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.next_epoch = state["step"], state["next_epoch"]
        self.history = state["history"]
        if self.rank == 0:
            print(f"{PROG}: resumed from {self.args.checkpoint} at epoch {self.next_epoch + 1}, "
                  f"step {self.step}", flush=True)

    def zero_grad(self):
        # With gradient_as_bucket_view the gradients are views into DDP's buckets; setting
        # them to None would drop the views (and the memory saving) until DDP rebuilds them.
        self.model.zero_grad(set_to_none=not self.args.gradient_as_bucket_view)

    def optimizer_step(self):
        """Steps, or with the fp16 loss scaler skips a step whose gradients overflowed."""
        if self.scaler is None:
            self.optimizer.step()
            return
        stepped = self.scaler.unscale_and_check(self.model.parameters())
        if stepped:
            self.optimizer.step()
        self.scaler.update(stepped)

    def micro_batch(self, x, y, group_size, sync):
        """Forward and backward of one micro-batch; gradients of the first K-1 of a group
        stay local (no_sync) and the last one's backward all-reduces the sum."""
        ahead = (self.step_ahead(self.optimizer.param_groups[0]["lr"]) if self.step_ahead
                 else contextlib.nullcontext())
        with (contextlib.nullcontext() if sync else self.model.no_sync()), ahead:
            with self.autocast():
                loss = nn.functional.cross_entropy(self.model(x), y) / group_size
            (self.scaler.scale_loss(loss) if self.scaler else loss).backward()
        return loss.item()

    def must_sync(self):
        """Whether even the first K-1 micro-batches must all-reduce. With static_graph, torch
        1.13 asserts (expect_autograd_hooks_, reducer.cpp) on a no_sync() backward while DDP
        has seen exactly one syncing forward (pytorch/pytorch#143580: later versions assert
        on a first backward under no_sync()); so this process's first optimizer step syncs every micro-batch. The sum
        of the all-reduced micro-batch gradients is the same average: only slower."""
        return self.args.static_graph and self.steps_here == 0

    def steps_left(self):
        return self.args.max_steps - self.step if self.args.max_steps else math.inf

    def train_epoch(self, epoch):
        """One pass over this rank's shard; returns (loss sum, optimizer steps)."""
        k = self.args.accumulate
        batches = len(self.loader)
        steps = min(math.ceil(batches / k), self.steps_left())
        progress = Progress(self.rank == 0 and not self.args.no_progress, epoch,
                            self.args.epochs, steps)
        self.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss_sum, done, group_loss = 0.0, 0, 0.0
        started = time.perf_counter()
        for i, (x, y) in enumerate(self.loader):
            if done == steps:
                break
            first = i - i % k
            group_size = min(k, batches - first)  # the epoch's last group may be short
            last = i - first + 1 == group_size
            group_loss += self.micro_batch(x, y, group_size, sync=last or self.must_sync())
            if not last:
                continue
            self.optimizer_step()
            self.zero_grad()
            now = time.perf_counter()
            self.step_times.append(now - started)
            started = now
            self.step += 1
            self.steps_here += 1
            done += 1
            loss_sum += group_loss
            progress.update(done, group_loss)  # rank 0's own loss: no collective per step
            group_loss = 0.0
        progress.finish(done, loss_sum / max(done, 1))
        return loss_sum, done

    def run(self):
        args = self.args
        for epoch in range(self.next_epoch, args.epochs):
            if self.steps_left() <= 0:
                break
            skipped_before = self.scaler.skipped if self.scaler else 0
            t0 = time.perf_counter()
            loss_sum, steps = self.train_epoch(epoch)
            seconds = time.perf_counter() - t0
            test_loss, accuracy, train_loss = evaluate(
                self.model.module, self.test_set, self.rank, self.world, loss_sum, steps)
            record = dict(epoch=epoch + 1, time_s=seconds, steps=steps, train_loss=train_loss,
                          test_loss=test_loss, test_accuracy=accuracy,
                          skipped_steps=(self.scaler.skipped if self.scaler else 0) - skipped_before)
            self.history.append(record)
            self.report_epoch(record)
            self.next_epoch = epoch + 1
            if args.checkpoint:
                self.save()
            if epoch + 1 == args.fail_once_after_epoch:
                self.fail_once()

    def report_epoch(self, r):
        if self.rank == 0:
            skipped = f", {r['skipped_steps']} skipped" if self.scaler else ""
            print(f"epoch {r['epoch']}: train loss {r['train_loss']:.4f}, test loss "
                  f"{r['test_loss']:.4f}, test accuracy {100 * r['test_accuracy']:.2f}%, "
                  f"{r['steps']} steps in {r['time_s']:.1f} s{skipped}", flush=True)

    def save(self):
        state = dict(shape=model_shape(self.args), next_epoch=self.next_epoch, step=self.step,
                     history=self.history,
                     scaler=self.scaler.state_dict() if self.scaler else None)
        save_checkpoint(self.args.checkpoint, self.rank, self.model.module, self.optimizer, state)

    def fail_once(self):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        dist.barrier()  # rank 0's checkpoint is on disk before the failure
        if self.rank == self.world - 1:
            print(f"{PROG}: rank {self.rank}: killing itself (SIGKILL) after epoch "
                  f"{self.next_epoch} (--fail-once-after-epoch)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, not an orderly exit

    def release(self):
        """Drops the DDP model, its hook state and the optimizer (see close())."""
        self.model = self.optimizer = None

    def report(self):
        """The final line and --json, on rank 0."""
        if self.rank != 0:
            return
        last = self.history[-1] if self.history else {}
        median = statistics.median(self.step_times) if self.step_times else None
        skipped = self.scaler.skipped if self.scaler else 0
        if last:
            print(f"final: test accuracy {100 * last['test_accuracy']:.2f}%, test loss "
                  f"{last['test_loss']:.4f}, train loss {last['train_loss']:.4f}, "
                  f"{self.step} steps, median step "
                  f"{'-' if median is None else f'{1000 * median:.1f} ms'}, {skipped} skipped",
                  flush=True)
        if self.args.json:
            write_json(self.args.json, dict(
                test_accuracy=last.get("test_accuracy"), test_loss=last.get("test_loss"),
                train_loss=last.get("train_loss"), steps=self.step,
                epoch_times_s=[r["time_s"] for r in self.history],
                step_time_median_s=median, steps_timed=len(self.step_times),
                skipped_steps=skipped, loss_scale=self.scaler.scale if self.scaler else None,
                amp_autocast=self.autocast_on, epochs=self.history, world_size=self.world,
                parameters=self.parameters, torch=torch.__version__, flags=vars(self.args)))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores
    make_hook = parse_hook(args.hook)  # a bad --hook fails before the rendezvous waits
    rank, world = init_distributed(args.backend)
    trainer = Trainer(args, rank, world, make_hook)
    trainer.run()
    trainer.report()
    close(trainer.release)


def close(release):
    """Ends the job in an order that avoids a deadlock. Left to the interpreter's exit, the
    last reference to gloo's process group can go with DDP's reducer: its destructor joins
    gloo's worker threads while holding the GIL, and a worker that is dropping a tensor
    made in Python (the fp16 hook's) waits for the GIL: a hang seen here with torch 1.13.
    So: every rank idle (barrier), the DDP model released while the group still lives,
    then the group."""
    dist.barrier()
    release()  # drops the DDP model (and with it the reducer)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
