"""The gradient of GELU's tanh approximation (GPT-2's "gelu_new"): ONNX Runtime's
com.microsoft.FastGeluGrad against what ortflow puts in its place, ONNX's element-wise operators
at fp32 (graphs/gelu_grad.py) and ortflow.FastGeluGrad at bf16 (kernels/operators.cc: ATen's
gelu_backward), each a session on the same arrays, one thread. The shape is GPT-2 124M's MLP at 4
sequences of 128 tokens, [512, 3072], of which a step computes 12. Rounds rotate the three; in a
round each keeps the fastest of `--calls` calls; the table has the medians over rounds and the
median of the rounds' ratios to ONNX Runtime's kernel.

    python bench/bench_gelu_grad.py [--rounds 9] [--calls 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_precision import cpu_name

SHAPE = (512, 3072)
KERNEL = "com.microsoft.FastGeluGrad"
CONTENDERS = (KERNEL, "ONNX operators (fp32)", "ortflow.FastGeluGrad (bf16)")


def session(contender: str, library: str):
    import onnx.parser
    import onnxruntime as ort

    from ortflow.graphs import gelu_grad

    domain = "ortflow" if contender.startswith("ortflow") else "com.microsoft"
    model = onnx.parser.parse_model(f"""
        <ir_version: 9, opset_import: ["" : 17, "{domain}" : 1]>
        gelu_grad (float[512, 3072] dY, float[512, 3072] X) => (float[512, 3072] dX) {{
            dX = {domain}.FastGeluGrad(dY, X)
        }}""")
    if contender.startswith("ONNX"):
        gelu_grad.decompose(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    import torch

    from ortflow import kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # ATen's pool computes ortflow's operator
    sessions = {contender: session(contender, str(kernels.library())) for contender in CONTENDERS}
    rng = np.random.default_rng(0)
    feeds = {"dY": rng.standard_normal(SHAPE, dtype=np.float32), "X": rng.standard_normal(SHAPE, dtype=np.float32)}
    outputs = {contender: s.run(None, feeds)[0] for contender, s in sessions.items()}
    ms = {contender: [] for contender in CONTENDERS}
    for round_ in range(args.rounds):
        for contender in CONTENDERS[round_ % 3:] + CONTENDERS[:round_ % 3]:
            calls = []
            for _ in range(args.calls):
                start = time.perf_counter()
                sessions[contender].run(None, feeds)
                calls.append(time.perf_counter() - start)
            ms[contender].append(min(calls) * 1e3)
    print(f"CPU: {cpu_name()}; [512, 3072], one thread, {args.rounds} rounds")
    print(f"| contender | ms | {KERNEL} / this | largest difference to {KERNEL} |")
    print("| --- | ---: | ---: | ---: |")
    for contender in CONTENDERS:
        ratios = [theirs / ours for theirs, ours in zip(ms[KERNEL], ms[contender])]
        difference = np.abs(outputs[contender] - outputs[KERNEL]).max()
        print(f"| {contender} | {statistics.median(ms[contender]):.2f} | {statistics.median(ratios):.2f}x "
              f"(rounds {min(ratios):.2f} to {max(ratios):.2f}) | {difference:.2e} |")

if __name__ == "__main__":
    main()
