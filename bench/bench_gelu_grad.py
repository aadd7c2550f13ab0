"""The gradient of GELU's tanh approximation (GPT-2's "gelu_new"): ONNX Runtime's
com.microsoft.FastGeluGrad against ortflow.FastGeluGrad (kernels/operators.cc: ATen's
gelu_backward), which train.precision: bf16 puts in its place, each a one-node session on the
same arrays, one thread. The shape is GPT-2 124M's MLP at 4 sequences of 128 tokens, [512, 3072],
of which a step computes 12. Rounds alternate the two; in a round each keeps the fastest of
`--calls` calls; the table has the medians over rounds and the median of the rounds' ratios.

    python bench/bench_gelu_grad.py [--rounds 9] [--calls 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_precision import cpu_name

SHAPE = (512, 3072)
DOMAINS = ("com.microsoft", "ortflow")


def session(domain: str, library: str):
    import onnx.parser
    import onnxruntime as ort

    model = onnx.parser.parse_model(f"""
        <ir_version: 9, opset_import: ["" : 17, "{domain}" : 1]>
        gelu_grad (float[512, 3072] dY, float[512, 3072] X) => (float[512, 3072] dX) {{
            dX = {domain}.FastGeluGrad(dY, X)
        }}""")
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
    sessions = {domain: session(domain, str(kernels.library())) for domain in DOMAINS}
    rng = np.random.default_rng(0)
    feeds = {"dY": rng.standard_normal(SHAPE, dtype=np.float32), "X": rng.standard_normal(SHAPE, dtype=np.float32)}
    outputs = {domain: s.run(None, feeds)[0] for domain, s in sessions.items()}
    difference = np.abs(outputs["ortflow"] - outputs["com.microsoft"]).max()
    ms = {domain: [] for domain in DOMAINS}
    for round_ in range(args.rounds):
        for domain in DOMAINS if round_ % 2 == 0 else DOMAINS[::-1]:
            calls = []
            for _ in range(args.calls):
                start = time.perf_counter()
                sessions[domain].run(None, feeds)
                calls.append(time.perf_counter() - start)
            ms[domain].append(min(calls) * 1e3)
    ratios = [theirs / ours for theirs, ours in zip(ms["com.microsoft"], ms["ortflow"])]
    print(f"CPU: {cpu_name()}; [512, 3072], one thread, {args.rounds} rounds; largest difference {difference:.2e}")
    print("| com.microsoft.FastGeluGrad ms | ortflow.FastGeluGrad ms | ratio |")
    print("| ---: | ---: | ---: |")
    print(f"| {statistics.median(ms['com.microsoft']):.2f} | {statistics.median(ms['ortflow']):.2f} | "
          f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f} to {max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
