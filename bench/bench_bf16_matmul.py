"""One GPT-2-sized matrix multiply and its backward pair in bfloat16 through ortflow's custom
operator `ortflow.BF16MatMul` (src/ortflow/kernels/operators.cc) inside an ONNX Runtime
InferenceSession, against the same products in float32 on ONNX Runtime's MLAS kernels and
against torch in bfloat16: the measurement issue 44 asks for before bf16 training is built.

GPT-2 small at context 128 and 4 sequences a rank (M = 512 rows), width 768: the attention
output projection (768 x 768) and the MLP's up-projection (768 x 3072). For each weight W
[K, N] and activation X [M, K], three products: the forward Y = X W, and the backward pair
dX = dY W^T and dW = X^T dY. The contenders, all at one thread:

- ORT MLAS fp32: a MatMul node for the forward; for the backward pair FusedMatMul (transB,
  transA), the node ONNX Runtime's gradient graph uses, so no Transpose is timed.
- ORT BF16MatMul: the custom operator with the same transposes; float32 in and out, rounded to
  bfloat16 inside (the weights stay float32, as autocast keeps them).
- torch bf16: torch.matmul on tensors already in bfloat16 (the kernel alone).
- torch autocast bf16: torch.matmul on the float32 tensors under
  torch.autocast("cpu", dtype=torch.bfloat16), its casts included.
- torch fp32: torch.matmul in float32, for reference.

Rounds alternate the contenders (the order rotates each round); in a round each runs once to
warm up and is then timed `--calls` times, the fastest kept (the least disturbed by whatever
else the machine runs); the tables have the median over rounds, and each ratio is the median of
the rounds' ratios. Two tables: by the wall clock, and by the CPU time of the calling thread
(every contender runs on it at one thread), which a busy machine disturbs less. Before timing,
BF16MatMul's output is checked against float64 numpy and against torch's bf16 matmul (relative
to the largest entry; bfloat16 keeps 8 bits, so ~1e-2).

    python bench/bench_bf16_matmul.py [--rounds 9] [--calls 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

# One thread for ATen's OpenMP pool too (torch, and the operator's ATen in ONNX Runtime's process),
# set before torch loads.
os.environ["OMP_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench_quantize import cpu_model  # noqa: E402  (this script's folder is on sys.path)

ROWS = 4 * 128  # 4 sequences of 128 tokens
WEIGHTS = {"attention projection": (768, 768), "MLP up-projection": (768, 3072)}
# product -> (transA, transB, first operand, second operand) over X [M,K], W [K,N], dY [M,N]
PRODUCTS = {"forward Y = X W": (0, 0, "X", "W"), "dX = dY W^T": (0, 1, "dY", "W"), "dW = X^T dY": (1, 0, "X", "dY")}
CONTENDERS = ["ORT MLAS fp32", "ORT BF16MatMul", "torch bf16", "torch autocast bf16", "torch fp32"]


def cpu_flags() -> str:
    """The instructions bfloat16 products can use, from /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"]
            return " ".join(f"{flag}{'' if flag in flags else ' (no)'}" for flag in wanted)
    return "unknown"


def node_model(op: str, domain: str, trans_a: int, trans_b: int) -> bytes:
    """A one-node model Y = op(A, B) with the transposes as attributes (a plain MatMul has none)."""
    from onnx import TensorProto, helper

    attributes = {} if op == "MatMul" else {"transA": trans_a, "transB": trans_b}
    node = helper.make_node(op, ["A", "B"], ["Y"], domain=domain, **attributes)
    graph = helper.make_graph(
        [node], "product", [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("A", "B")],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)] if domain else [helper.make_opsetid("", 17)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def sessions(library: Path) -> dict:
    """(contender, product) -> an InferenceSession at one intra-op thread."""
    import onnxruntime as ort

    out = {}
    for product, (trans_a, trans_b, _, _) in PRODUCTS.items():
        for contender in ("ORT MLAS fp32", "ORT BF16MatMul"):
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
            if contender == "ORT BF16MatMul":
                options.register_custom_ops_library(str(library))
                model = node_model("BF16MatMul", "ortflow", trans_a, trans_b)
            elif trans_a or trans_b:
                model = node_model("FusedMatMul", "com.microsoft", trans_a, trans_b)
            else:
                model = node_model("MatMul", "", 0, 0)
            out[contender, product] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return out


def calls(sessions_: dict, arrays: dict, product: str) -> dict:
    """contender -> a no-argument call that computes `product` once."""
    import torch

    trans_a, trans_b, first, second = PRODUCTS[product]
    feeds = {"A": arrays[first], "B": arrays[second]}
    fp32 = {name: torch.from_numpy(a) for name, a in arrays.items()}
    bf16 = {name: t.to(torch.bfloat16) for name, t in fp32.items()}

    def torch_product(tensors):
        a, b = tensors[first], tensors[second]
        return torch.matmul(a.mT if trans_a else a, b.mT if trans_b else b)

    def autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch_product(fp32)

    return {
        "ORT MLAS fp32": lambda: sessions_["ORT MLAS fp32", product].run(None, feeds),
        "ORT BF16MatMul": lambda: sessions_["ORT BF16MatMul", product].run(None, feeds),
        "torch bf16": lambda: torch_product(bf16),
        "torch autocast bf16": autocast,
        "torch fp32": lambda: torch_product(fp32),
    }


def check(sessions_: dict, arrays: dict) -> bool:
    """BF16MatMul against float64 numpy and against torch's bf16 matmul, per product; True when all pass."""
    import torch

    ok = True
    print("check | product | max |op - float64| / max |float64| | max |op - torch bf16| / max |float64|")
    for shape, (k, n) in WEIGHTS.items():
        for product, (trans_a, trans_b, first, second) in PRODUCTS.items():
            a, b = arrays[shape][first], arrays[shape][second]
            y = sessions_["ORT BF16MatMul", product].run(None, {"A": a, "B": b})[0]
            exact = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
            ta, tb = torch.from_numpy(a).bfloat16(), torch.from_numpy(b).bfloat16()
            reference = torch.matmul(ta.mT if trans_a else ta, tb.mT if trans_b else tb).float().numpy()
            scale = np.abs(exact).max()
            to_exact, to_torch = np.abs(y - exact).max() / scale, np.abs(y - reference).max() / scale
            passed = to_exact < 1e-2 and y.shape == exact.shape
            ok &= passed
            print(f"{'ok' if passed else 'FAIL'} | {shape} {product} | {to_exact:.1e} | {to_torch:.1e}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds over all contenders, alternated")
    parser.add_argument("--calls", type=int, default=5, help="timed calls of a contender in a round (fastest kept)")
    args = parser.parse_args()

    import onnxruntime
    import torch

    from ortflow import kernels
    from ortflow.sessions import quiet_logging

    torch.set_num_threads(1)
    quiet_logging()
    library = kernels.library()
    rng = np.random.default_rng(0)
    arrays = {shape: {"X": rng.standard_normal((ROWS, k), dtype=np.float32),
                      "W": rng.standard_normal((k, n), dtype=np.float32) * 0.02,
                      "dY": rng.standard_normal((ROWS, n), dtype=np.float32) * 1e-3}
              for shape, (k, n) in WEIGHTS.items()}
    sessions_ = sessions(library)
    onednn = re.search(r"MKL-DNN (v[\d.]+)", torch.__config__.show())
    print(f"{cpu_model()} ({platform.machine()}; {cpu_flags()}), 1 thread; onnxruntime {onnxruntime.__version__}, "
          f"torch {torch.__version__} (oneDNN {onednn.group(1) if onednn else 'unknown'})")
    if not check(sessions_, arrays):
        sys.exit("BF16MatMul's output is off by more than bfloat16's rounding: not timed")

    cases = [(shape, product) for shape in WEIGHTS for product in PRODUCTS]
    runs = {case: calls(sessions_, arrays[case[0]], case[1]) for case in cases}
    # ms, one per round, by clock: the wall clock, and the calling thread's CPU time, which leaves out the time
    # the scheduler gives to other processes (everything runs on the calling thread at one thread).
    clocks = {"wall clock": time.perf_counter, "CPU time of the calling thread": time.thread_time}
    times = {(clock, case, c): [] for clock in clocks for case in cases for c in CONTENDERS}
    for round_ in range(args.rounds):
        order = CONTENDERS[round_ % len(CONTENDERS):] + CONTENDERS[:round_ % len(CONTENDERS)]
        for case in cases:
            for contender in order:
                call = runs[case][contender]
                call()
                best = dict.fromkeys(clocks, float("inf"))
                for _ in range(args.calls):
                    start = {clock: read() for clock, read in clocks.items()}
                    call()
                    for clock, read in clocks.items():
                        best[clock] = min(best[clock], read() - start[clock])
                for clock in clocks:
                    times[clock, case, contender].append(best[clock] * 1e3)

    for clock in clocks:
        def ratio(case, slower, faster):
            return statistics.median(s / f for s, f in zip(times[clock, case, slower], times[clock, case, faster]))

        print(f"\n{clock}, ms: median of {args.rounds} rounds (fastest of {args.calls} calls each); M = {ROWS}")
        print("weight [K, N] | product | " + " | ".join(CONTENDERS)
              + " | MLAS / BF16MatMul | MLAS / torch bf16 | MLAS / autocast")
        for shape, product in cases:
            case = (shape, product)
            k, n = WEIGHTS[shape]
            cells = " | ".join(f"{statistics.median(times[clock, case, c]):.2f}" for c in CONTENDERS)
            print(f"{shape} [{k}, {n}] | {product} | {cells} | "
                  f"{ratio(case, 'ORT MLAS fp32', 'ORT BF16MatMul'):.2f}x | "
                  f"{ratio(case, 'ORT MLAS fp32', 'torch bf16'):.2f}x | "
                  f"{ratio(case, 'ORT MLAS fp32', 'torch autocast bf16'):.2f}x")
        # The six products together, the share of a GPT-2 block's matrix work they stand for.
        total = {c: [sum(t) for t in zip(*(times[clock, case, c] for case in cases))] for c in CONTENDERS}
        cells = " | ".join(f"{statistics.median(total[c]):.2f}" for c in CONTENDERS)
        ratios = [statistics.median(s / f for s, f in zip(total["ORT MLAS fp32"], total[c]))
                  for c in ("ORT BF16MatMul", "torch bf16", "torch autocast bf16")]
        print(f"all six | sum | {cells} | " + " | ".join(f"{r:.2f}x" for r in ratios))

if __name__ == "__main__":
    main()
