"""What a step does with the gradients between backward and the optimizer, written
once against the array module `xp` (numpy on the CPU, cupy on CUDA), so that the
CPU tests run every line that a GPU runs:

  1. view ORT's live gradient buffers as `xp` arrays, without a copy;
  2. sum them across ranks in place, packed into buckets (the transport, MPI or
     NCCL, is the communicator's one call on a flat buffer);
  3. scale the sum to the mean, measure the global norm and clip to it;
  4. the parameters, copied to the host, for the histograms.

The optimizer reads the same buffers, so what step 3 leaves in them is what it applies.
"""

from __future__ import annotations

import math

import numpy

from .. import ort_private

# Gradients are packed into buckets of about this size, so that a step makes a
# few large all-reduce calls rather than one per tensor (PyTorch DDP uses 25 MB).
BUCKET_BYTES = 25 * 1024 * 1024


def live_arrays(values: list, xp) -> list:
    """ORT's OrtValues as writable `xp` arrays on the same memory. On CUDA that is
    DLPack (`cupy.from_dlpack`). On the CPU, numpy.from_dlpack gives a read-only
    view of ORT's buffer (its DLPack capsule carries no read-only flag, so numpy
    assumes one), while `OrtValue.numpy()` gives a writable one on the same memory."""
    if xp is numpy:
        return [value.numpy() for value in values]
    return [xp.from_dlpack(value) for value in values]


def gradients(state, names: list[str], xp) -> list:
    """The live gradient buffers of the parameters `names` (an in-place change is what Optimizer.step() applies)."""
    return live_arrays([ort_private.parameter(state, name).grad for name in names], xp)


def parameters(state, names: list[str], xp) -> list:
    """The live value buffers of the parameters `names` (an in-place change is what the next forward reads)."""
    return live_arrays([ort_private.parameter(state, name).data for name in names], xp)


def on_host(array, xp) -> numpy.ndarray:
    """`array` as a numpy array: copied from the device where it lives there (CuPy), else as it is."""
    return getattr(xp, "asnumpy", numpy.asarray)(array)


def parameters_on_host(state, names: list[str], xp) -> dict[str, numpy.ndarray]:
    """{name: parameter values} as numpy arrays, copied from the device where they live there."""
    arrays = parameters(state, names, xp)
    return {name: on_host(array, xp) for name, array in zip(names, arrays)}


def buckets(grads: list):
    """`grads` in order, grouped so that each group holds about BUCKET_BYTES (a larger tensor goes alone)."""
    group, size = [], 0
    for g in grads:
        if group and size + g.nbytes > BUCKET_BYTES:
            yield group
            group, size = [], 0
        group.append(g)
        size += g.nbytes
    if group:
        yield group


def allreduce_in_buckets(grads: list, xp, reduce_flat, buffers: dict) -> None:
    """Sum `grads` across ranks in place: a tensor alone in its bucket is reduced
    where it is; the others are packed into one flat buffer per bucket (kept in
    `buffers` for the next step), reduced by `reduce_flat(flat)` and copied back."""
    for index, group in enumerate(buckets(grads)):
        if len(group) == 1:
            reduce_flat(group[0].reshape(-1))
            continue
        size = sum(g.size for g in group)
        if index not in buffers or buffers[index].size < size:
            buffers[index] = xp.empty(size, dtype=group[0].dtype)
        flat = buffers[index][:size]
        offset = 0
        for g in group:
            flat[offset:offset + g.size] = g.reshape(-1)
            offset += g.size
        reduce_flat(flat)
        offset = 0
        for g in group:
            g.reshape(-1)[:] = flat[offset:offset + g.size]
            offset += g.size


def sum_of_squares(grads: list, xp) -> float:
    """The squared L2 norm of all of `grads` together (torch.nn.utils.clip_grad_norm_'s total_norm, squared)."""
    return sum(float(xp.vdot(g.reshape(-1), g.reshape(-1))) for g in grads)


def global_norm(grads: list, xp) -> float:
    """The L2 norm of all gradients together (torch.nn.utils.clip_grad_norm_'s total_norm)."""
    return math.sqrt(sum_of_squares(grads, xp))


def average_and_clip(comm, grads: list, scale_to_mean: float, clip: float | None) -> float:
    """Sum the gradients across ranks in place, scale the sum to the mean over
    every micro-batch of every rank, and clip it to the global norm `clip` as
    torch.nn.utils.clip_grad_norm_ does. Returns the norm before clipping. After
    the sum every rank holds the same gradients, so every rank takes the same
    clipping decision."""
    comm.allreduce_gradients(grads)
    norm = global_norm(grads, comm.xp) * scale_to_mean
    scale_and_clip(grads, norm, scale_to_mean, clip)
    return norm


def scale_and_clip(grads: list, norm: float, scale_to_mean: float, clip: float | None) -> None:
    """Scale summed gradients to their mean, and clip them to the global norm `clip` given
    their mean's global `norm`, in place."""
    factor = scale_to_mean
    if clip is not None:
        factor *= min(1.0, clip / (norm + 1e-6))  # the epsilon of torch.nn.utils.clip_grad_norm_
    for g in grads:
        g *= factor
