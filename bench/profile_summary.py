"""Where a traced training step's time goes inside ONNX Runtime, by operator
type, from the profiler traces that `train.profile_steps` writes (one `-train_`
and one `-optimizer_` trace per rank, under results/<run>/train/profile/).

Node events (`cat: Node`, `dur` in microseconds) are summed by class: matrix
multiplies (MatMul, Gemm, FusedMatMul, FusedGemm), Softmax and the loss,
normalisation, data movement, elementwise and the rest; plus the optimizer
session's runs. Shares are of the two sessions' run time. What ortflow does
outside ONNX Runtime (the gradient all-reduce, scaling, the batch) is not in the
traces: compare with an untraced step's wall time (the last `train` entry of
metrics.json's history, when train.profile_steps ends before the last step). The
first traced step also pays for reopening the sessions with the profiler on.

    python bench/profile_summary.py results/<run>/train [--rank 1]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

CLASSES = {
    "matmul": ("MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger", "Conv", "ConvGrad", "GemmGrad"),
    "softmax": ("Softmax", "SoftmaxGrad", "SoftmaxGrad_13", "SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad",
                "LogSoftmax", "LogSoftmaxGrad", "LogSoftmaxGrad_13"),
    "normalisation": ("LayerNormalization", "LayerNormalizationGrad", "SimplifiedLayerNormalization",
                      "SkipLayerNormalization", "InvertibleLayerNormalizationGrad"),
    "data movement": ("Transpose", "Reshape", "Concat", "Split", "Slice", "SliceGrad", "Gather", "GatherGrad",
                      "GatherElements", "Expand", "Squeeze", "Unsqueeze", "Cast", "Shape", "Identity", "Where",
                      "GatherND", "ScatterND", "Tile", "SplitTraining", "ConcatTraining"),
}


def op_class(op: str) -> str:
    return next((name for name, ops in CLASSES.items() if op in ops), "elementwise and other")


def summarize(trace: Path) -> tuple[dict[str, float], dict[str, float], float, int]:
    """(seconds by class, seconds by operator, seconds of the session's runs, runs) of one trace."""
    by_class, by_op, seconds, runs = defaultdict(float), defaultdict(float), 0.0, 0
    for event in json.loads(trace.read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            by_class[op_class(op)] += event["dur"] / 1e6
            by_op[op] += event["dur"] / 1e6
        elif event.get("cat") == "Session" and event["name"] == "model_run":
            seconds += event["dur"] / 1e6
            runs += 1
    return by_class, by_op, seconds, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", type=Path, help="the training folder (results/<run>/train)")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    profile = args.train / "profile"
    # The optimizer session runs once a step: its runs count the traced steps (a trace spans train.profile_steps).
    optimizer, steps = (sum(values) for values in zip(
        *(summarize(t)[2:] for t in profile.glob(f"rank{args.rank}-step*-optimizer_*.json"))))
    optimizer /= steps
    by_class, by_op, train_run = defaultdict(float), defaultdict(float), 0.0
    for trace in sorted(profile.glob(f"rank{args.rank}-step*-train_*.json")):
        classes, ops, seconds, _ = summarize(trace)
        for name, value in classes.items():
            by_class[name] += value / steps
        for name, value in ops.items():
            by_op[name] += value / steps
        train_run += seconds / steps
    total = train_run + optimizer
    print(f"rank {args.rank}, {steps} traced step(s): {total:.3f} s a step in ONNX Runtime's two sessions")
    print("| part | s per step | share |\n| --- | ---: | ---: |")
    rows = sorted(by_class.items(), key=lambda item: -item[1])
    rows += [("(training session, outside its kernels)", train_run - sum(by_class.values())),
             ("optimizer session (AdamW)", optimizer)]
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / total:.2f} |")
    print("top operators: " + ", ".join(f"{op} {s:.3f} s" for op, s in sorted(by_op.items(), key=lambda i: -i[1])[:8]))


if __name__ == "__main__":
    main()
