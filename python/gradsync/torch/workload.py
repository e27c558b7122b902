"""A PyTorch model as the advisor's workload: its parameter tensors layer by layer, in the order
backward makes their gradients, with each layer's FLOPs and its measured forward and backward
time, written as the JSON layer list gradsync-advise reads (--layers FILE).

    import gradsync.torch
    gradsync.torch.save_workload("model.json", model, example_batch)
    # gradsync-advise --layers model.json --profile cluster.json --ranks 8 --hosts 2

A layer is a module that holds parameters itself. Its time runs from the previous layer's end
to its own, in forward and in backward alike, so the modules without parameters (activations,
pooling) count with the layer after them. Backward times are read where it matters to the
Reducer: when each layer's last gradient is ready. The model runs as it is, on this process's
threads; where several ranks will share a host's cores, time it as they will run (or give
the advisor FLOPs alone, timed=False, and the profile's compute speed).
"""
import json
import statistics
import time

import torch


def _flops_per_sample(module, output, batch):
    """Forward FLOPs of one sample through `module` (a multiply-add is two); backward is
    counted as twice that (the input's gradient and the weights')."""
    if not isinstance(output, torch.Tensor):
        return 0.0
    per_sample = output.numel() / max(batch, 1)
    if isinstance(module, torch.nn.Linear):
        return 2.0 * module.in_features * per_sample
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = module.weight[0].numel()  # in_channels / groups x the kernel's extent
        return 2.0 * kernel * per_sample
    # Normalisation, embeddings and the like: a few operations per output element.
    return 4.0 * per_sample


def workload(model, example_input, *, loss=None, batch=None, optimizer="sgd", name=None,
             repeats=3, timed=True):
    """The advisor's workload of `model` on `example_input` (a tensor, or a tuple of the
    model's arguments) as a dict (save_workload writes it). loss(output) makes the scalar
    that backward starts from (default: the output's sum); batch: samples in example_input
    (default: its first dimension); times are medians over `repeats` runs after one warm-up."""
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    if batch is None:
        batch = int(inputs[0].shape[0])
    if loss is None:
        loss = lambda output: output.float().sum()  # noqa: E731
    layers = [m for m in model.modules()
              if any(p.requires_grad for p in m.parameters(recurse=False))]
    if not layers:
        raise ValueError("the model has no parameters that need a gradient")
    index = {id(m): i for i, m in enumerate(layers)}
    owner = {id(p): index[id(m)] for m in layers for p in m.parameters(recurse=False)
             if p.requires_grad}

    run = {}  # this run's events

    def forward_done(module, _inputs, output):
        i = index[id(module)]
        run["forward"].setdefault(i, time.perf_counter())
        run["flops"].setdefault(i, _flops_per_sample(module, output, batch))

    def gradient_ready(param):
        def hook(grad):
            run["ready"].append((time.perf_counter(), id(param)))
            return grad
        return hook

    handles = [m.register_forward_hook(forward_done) for m in layers]
    handles += [p.register_hook(gradient_ready(p)) for m in layers
                for p in m.parameters(recurse=False) if p.requires_grad]
    runs = []
    try:
        for _ in range(repeats + 1):
            run.clear()
            run.update(forward={}, flops={}, ready=[])
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            output = model(*inputs)
            forward_end = time.perf_counter()
            value = loss(output)
            backward_start = time.perf_counter()
            value.backward()
            runs.append((start, forward_end, backward_start, dict(run["forward"]),
                         dict(run["flops"]), list(run["ready"])))
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)

    # Forward order as the model ran it; backward makes the gradients in about the reverse.
    _, _, _, first_forward, flops, _ = runs[-1]
    order = sorted(first_forward, key=first_forward.get)
    forward_ms = {i: [] for i in order}
    backward_ms = {i: [] for i in order}
    for start, forward_end, backward_start, forward, _, ready in runs[1:]:
        previous = start
        for i in order:
            forward_ms[i].append((forward[i] - previous) * 1e3)
            previous = forward[i]
        forward_ms[order[-1]][-1] += (forward_end - previous) * 1e3  # the loss's own forward
        last_ready = {}
        for t, pid in ready:
            last_ready[owner[pid]] = t
        previous = backward_start
        for i in sorted(last_ready, key=last_ready.get):
            backward_ms[i].append((last_ready[i] - previous) * 1e3)
            previous = last_ready[i]

    # Each layer's tensors in the order their gradients became ready.
    ready_order = {pid: k for k, (_, pid) in enumerate(runs[-1][5])}
    out_layers = []
    for i in order:
        module = layers[i]
        params = sorted((p for p in module.parameters(recurse=False) if p.requires_grad),
                        key=lambda p: ready_order.get(id(p), 0))
        entry = {
            "name": next(n for n, m in model.named_modules() if m is module) or "model",
            "tensors": [{"count": p.numel(), "rows": int(p.shape[0]) if p.dim() >= 2 else 0}
                        for p in params],
            "forward_flops": flops[i],
            "backward_flops": 2 * flops[i],
        }
        if timed:
            entry["forward_ms"] = statistics.median(forward_ms[i])
            entry["backward_ms"] = statistics.median(backward_ms[i]) if backward_ms[i] else 0.0
        out_layers.append(entry)
    return {"name": name or type(model).__name__, "batch": batch, "optimizer": optimizer,
            "layers": out_layers}


def save_workload(path, model, example_input, **kwargs):
    """workload(model, example_input, **kwargs), written to `path` as JSON; returns the dict."""
    w = workload(model, example_input, **kwargs)
    with open(path, "w") as f:
        json.dump(w, f, indent=1)
        f.write("\n")
    return w
