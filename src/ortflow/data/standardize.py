"""`data.standardize`: each float input scaled by the train split's statistics,
in the shards for training and in front of the exported model for deployment.

prepare_data computes, for each float input and each position of its per-sample
shape (for CSV and Parquet: each column of `x`), the mean and the standard
deviation (numpy's, ddof 0) over the TRAIN split only, accumulated in float64.
Both splits' manifests keep them under `standardize` ({input: {"mean", "std"}}),
and the shards hold (x - mean) / std. export_model puts the same Sub and Div in
front of the inference model (`prepend`), so the deployed model takes the raw
features. Shards and model compute it alike, in float32 with the statistics
rounded to float32, so the model is trained on exactly what it computes itself
from the same raw float32 values.

A constant column has std 0: it is divided by 1 instead, so it passes through
as x - mean (0 on the train split) rather than as NaN. Integer inputs (token
ids) are indices, not measurements, and are never standardized.
"""

from __future__ import annotations

import numpy as np

PREFIX = "ortflow.standardize"  # the names of the nodes and initializers that `prepend` adds
# Float features whose largest magnitudes are further apart than this are unscaled:
# per-tensor int8 quantization of the input gives them one step size, which rounds
# the small ones away, and training is slower on them too. `data.standardize` fixes both.
UNSCALED_RATIO = 100.0


def statistics(features: dict[str, np.ndarray], rows: np.ndarray) -> dict:
    """{input: {"mean": ..., "std": ...}} over `rows` (the train split), as nested lists for the manifest."""
    stats = {}
    for name, array in features.items():
        if not np.issubdtype(array.dtype, np.floating):
            continue
        train = array[rows]
        std = train.std(axis=0, dtype=np.float64)
        # Zero in float32 is what the division would see: a constant column.
        std = np.where(std.astype(np.float32) == 0, 1.0, std)
        stats[name] = {"mean": train.mean(axis=0, dtype=np.float64).tolist(), "std": std.tolist()}
    return stats


def unscaled(batches, columns: list[str]) -> str | None:
    """Where the float features of `batches` (raw, as the model takes them) are
    unscaled, said in a few words; None where no input is. A feature's magnitude
    is its largest |value|; `columns` names the positions of a one-input table
    (CSV, Parquet: data.features)."""
    peaks: dict[str, np.ndarray] = {}
    for batch in batches:
        for name, array in batch.items():
            if np.issubdtype(array.dtype, np.floating) and array.ndim > 1:
                peak = np.abs(array.reshape(len(array), -1)).max(axis=0)
                peaks[name] = np.maximum(peaks[name], peak) if name in peaks else peak
    for name, peak in peaks.items():
        present = np.flatnonzero(peak)
        if not present.size:
            continue
        high, low = present[peak[present].argmax()], present[peak[present].argmin()]
        if peak[high] > UNSCALED_RATIO * peak[low]:
            def where(i):
                return f"column {columns[i]}" if len(columns) == len(peak) else f"{name}[{i}]"

            return (f"the features are unscaled: {where(high)} reaches {peak[high]:.4g} and {where(low)} at most "
                    f"{peak[low]:.4g}, {peak[high] / peak[low]:.0f}x apart")
    return None


def float32(stats: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The (mean, std) of input `name` as the shards and the exported model use them."""
    return np.asarray(stats[name]["mean"], np.float32), np.asarray(stats[name]["std"], np.float32)


def apply(arrays: dict[str, np.ndarray], stats: dict) -> dict[str, np.ndarray]:
    """`arrays` with each input named in `stats` standardized, as the exported model computes it."""
    out = dict(arrays)
    for name in stats:
        mean, std = float32(stats, name)
        out[name] = (arrays[name].astype(np.float32) - mean) / std
    return out


def invert(arrays: dict[str, np.ndarray], stats: dict) -> dict[str, np.ndarray]:
    """The raw features that `apply` made `arrays` from (to float32 rounding): what the deployed model is fed."""
    out = dict(arrays)
    for name in stats:
        mean, std = np.asarray(stats[name]["mean"]), np.asarray(stats[name]["std"])
        out[name] = (arrays[name] * std + mean).astype(np.float32)
    return out


def prepend(model, stats: dict) -> None:
    """Make `(input - mean) / std` the first nodes of `model` (an ONNX ModelProto)
    for each input named in `stats`: the input keeps its name, and the nodes that
    read it read the standardized values instead."""
    from onnx import helper, numpy_helper

    first = []
    for name in stats:
        mean, std = float32(stats, name)
        prefix = f"{PREFIX}.{name}"
        for node in model.graph.node:
            node.input[:] = [f"{prefix}.standardized" if i == name else i for i in node.input]
        model.graph.initializer.extend(
            [numpy_helper.from_array(mean, f"{prefix}.mean"), numpy_helper.from_array(std, f"{prefix}.std")]
        )
        first += [
            helper.make_node("Sub", [name, f"{prefix}.mean"], [f"{prefix}.centered"], name=f"{prefix}.sub"),
            helper.make_node("Div", [f"{prefix}.centered", f"{prefix}.std"], [f"{prefix}.standardized"],
                             name=f"{prefix}.div"),
        ]
    rest = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(first + rest)
