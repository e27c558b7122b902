"""gradsync's gradient codecs as DDP communication hooks.

    hook = gradsync.torch.hooks.codec("topk:ratio=0.01", model)
    ddp.register_comm_hook(None, hook)      # state: None (the default group) or a group
    ...
    checkpoint["hook"] = hook.state_dict()  # error feedback's residuals, per parameter
    hook.load_state_dict(checkpoint["hook"])

    with hook.step_ahead(lr):               # optional: step-ahead error feedback
        loss_fn(ddp(x), y).backward()
    optimizer.step()

Every codec spec gradsync knows works ("fp16", "bf16", "int8", "topk:ratio=0.01",
"powersgd:rank=4", ...; gradsync.torch.hooks.codec_names() lists them). fp16 and bf16 travel
half-size and are added in float32 at every hop. Error feedback and PowerSGD keep their
state per parameter, so DDP's rebuild of its buckets after the first iteration loses
nothing. The bucket is averaged over the group, as DDP's default all-reduce does.
"""
import contextlib

import torch
import torch.distributed as dist

from ._backend import BucketCompressor, ProcessGroupGradsync, codec_names  # noqa: F401


def _group(state):
    group = state if state is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, ProcessGroupGradsync):
        raise TypeError(
            "gradsync's comm hooks run on the gradsync backend: init_process_group(\"gradsync\") "
            f"(or pass a gradsync group as the hook's state); this group is {type(group).__name__}")
    return group


def codec(spec, model=None, skip_non_finite=False):
    """A DDP comm hook compressing each bucket with the codec `spec`.

    model: the module (or the DDP wrapper) whose parameters the hook sees; its parameter
    names key the per-parameter state, so a state_dict means the same in another run.
    Without it, parameters are numbered in the order the hook first sees them (the same on
    every rank and in every run of the same model).
    skip_non_finite: NaN or Inf in any rank's bucket makes every rank's bucket NaN (a loss
    scaler then skips the step everywhere) instead of raising gradsync.Error.
    """
    compressor = BucketCompressor(spec)
    names = {}
    if model is not None:
        inner = getattr(model, "module", model)
        names = {id(p): name for name, p in inner.named_parameters()}
    seen = {}  # name -> parameter, for step_ahead

    def gradsync_codec_hook(state, bucket):
        group = _group(state)
        params = bucket.parameters()
        keys = [names.setdefault(id(p), f"param{len(names)}") for p in params]
        if len(seen) < len(names):
            seen.update(zip(keys, params))
        counts = [p.numel() for p in params]
        rows = [p.shape[0] if p.dim() >= 2 else 0 for p in params]
        work = group._compressed_allreduce(compressor, bucket.buffer(), keys, counts, rows,
                                           skip_non_finite)
        # DDP takes from a Python hook a future whose value is a Python object: the bucket.
        return work.get_future().then(lambda fut: fut.value()[0])

    def state_dict():
        return {"spec": compressor.spec, "state": compressor.save_state()}

    def load_state_dict(saved):
        compressor.load_state(saved["state"])

    @contextlib.contextmanager
    def step_ahead(lr):
        """Step-ahead error feedback (Xu et al., AAAI 2021), as gradsync-train's --step-ahead:
        inside, each parameter stands at value - lr * what error feedback holds back for it,
        gradient the model will still move by once the wire carries it, so forward and
        backward see where the model is headed; on leaving, the values are restored, for the
        optimizer to step from. Top-k at 1% needs it to train as well as no compression.
        Costs a copy of the parameters that hold something back."""
        shifted = []
        with torch.no_grad():
            for name, p in seen.items():
                held = compressor.held_back(name)
                if held is not None:
                    shifted.append((p, p.detach().clone()))
                    p.sub_(held.view_as(p), alpha=lr)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in shifted:
                    p.copy_(value)

    gradsync_codec_hook.spec = compressor.spec
    gradsync_codec_hook.step_ahead = step_ahead
    gradsync_codec_hook.held_back = compressor.held_back  # (name) -> flat float32 copy or None
    gradsync_codec_hook.state_dict = state_dict
    gradsync_codec_hook.load_state_dict = load_state_dict
    return gradsync_codec_hook
