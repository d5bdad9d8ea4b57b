"""step_in_chunks: a torch optimizer's step on one large flat parameter, a chunk at a time
(step_in_segments: the same over given segments, each with a gradient of its own).

DeepSpeed's ZeRO-3 optimizer hands the torch optimizer one flat fp32 tensor per sub-group (by
default one for the whole rank: sub_group_size 1e9). An elementwise optimizer's step allocates
temporaries the size of the tensor it updates (AdamW's single-tensor path on CPU: the square root
of exp_avg_sq and the denominator, 8 bytes per parameter), so on a flat partition they are the
size of the whole rank's shard, where the same optimizer on per-parameter tensors (our own
runtime, FSDP2) holds them one parameter at a time. Stepping the flat tensor as chunk views, each
with its slice of every parameter-shaped state tensor, bounds them by the chunk, and changes no
value: every element sees the same arithmetic.

Only for optimizers whose update is elementwise over the parameter (SGD, Adam, AdamW, and the
like): a state tensor of the parameter's shape is sliced with it, anything else (a step count)
is copied per chunk and the first chunk's copy written back, since every chunk advanced it the
same way. An optimizer with no state yet for the tensor (its first step creates it) is stepped
whole.

A segment's gradient need not be a slice of one flat gradient: the takeover steps each
parameter's slice of the flat partition with that parameter's own gradient, so no flat gradient
(4 more bytes per parameter, next to the per-parameter gradients the backward produced) is ever
built.
"""
from __future__ import annotations

import torch

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def step_in_chunks(optimizer: torch.optim.Optimizer, group_index: int, flat: torch.Tensor,
                   chunk: int) -> bool:
    """optimizer.step() on param group `group_index` holding only `flat` (a 1-D tensor with its
    .grad set), in views of at most `chunk` elements. Returns False, stepping nothing, where
    chunking does not apply (an optimizer not known to be elementwise, no state yet for `flat`,
    a tensor of at most one chunk): the caller steps it whole."""
    if flat.grad is None or flat.numel() <= chunk:
        return False
    grad = flat.grad
    return step_in_segments(optimizer, group_index, flat,
                            [(start, grad.narrow(0, start, min(chunk, flat.numel() - start)))
                             for start in range(0, flat.numel(), chunk)])


def step_in_segments(optimizer: torch.optim.Optimizer, group_index: int, flat: torch.Tensor,
                     segments: list) -> bool:
    """optimizer.step() on param group `group_index` holding only `flat`, as one view per
    segment: (start, gradient) steps flat[start:start + gradient.numel()] with that gradient
    (any tensor of the view's dtype: a slice of flat.grad, or a parameter's own gradient where
    no flat gradient exists). The segments must tile `flat`. Returns False, stepping nothing,
    where this does not apply (an optimizer not known to be elementwise, no state yet for
    `flat`): the caller steps it whole."""
    state = optimizer.state.get(flat)
    if type(optimizer) not in ELEMENTWISE or not state or flat.dim() != 1:
        return False
    views, states, expected = [], [], 0
    for start, grad in segments:
        if start != expected or grad.dim() != 1 or grad.dtype != flat.dtype:
            raise ValueError(f"step_in_segments: segment at {start} (expected {expected}), "
                             f"gradient {tuple(grad.shape)} {grad.dtype} against a "
                             f"{flat.dtype} flat tensor: segments must tile it in order")
        length = grad.numel()
        view = flat.detach().narrow(0, start, length)
        view.grad = grad
        views.append(view)
        states.append({k: (v.narrow(0, start, length)
                           if torch.is_tensor(v) and v.shape == flat.shape
                           else (v.clone() if torch.is_tensor(v) else v))
                       for k, v in state.items()})
        expected = start + length
    if expected != flat.numel():
        raise ValueError(f"step_in_segments: segments cover {expected} of {flat.numel()} "
                         "elements")
    group = optimizer.param_groups[group_index]
    params = group["params"]
    group["params"] = views
    del optimizer.state[flat]
    try:
        for view, view_state in zip(views, states):
            optimizer.state[view] = view_state
        optimizer.step()
    finally:
        for view in views:
            optimizer.state.pop(view, None)
        optimizer.state[flat] = state
        group["params"] = params
    for k, v in states[0].items():  # what is not a slice (the step count): the same in each
        if not (torch.is_tensor(state[k]) and state[k].shape == flat.shape):
            if torch.is_tensor(v):
                state[k].copy_(v)
            else:
                state[k] = v
    return True
