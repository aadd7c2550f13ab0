"""int8 against fp32 latency of the default model, timed the way the quantize_model stage times it.

The default config's model (MLP 64 -> 512 -> 512 -> 10 on the digits' 64 features),
exported from torch with random weights (latency does not depend on their values),
quantized as the stage does (`ortflow.quantization.quantizer.quantize_file`: quant_pre_process,
then dynamic int8, per tensor or `--per-channel`), and both models timed by the
stage's own `ortflow.quantization.measure.latencies` (ONE intra-op thread, batch 1 and 64,
p50 and p95 over interleaved rounds) on the digits records.

    python bench/bench_quantize.py [--per-channel] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import numpy as np


class Records:
    """The digits' features, as the stage's timing reads them (`gather`, `len`)."""

    def __init__(self):
        from sklearn.datasets import load_digits

        self.x = load_digits().data.astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def gather(self, indices) -> dict:
        return {"x": self.x[indices]}


def export_mlp(path: Path) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    torch.onnx.export(model, (torch.zeros(2, 64),), str(path), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, opset_version=16, dynamo=False)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-channel", action="store_true", help="int8 weights per output channel")
    parser.add_argument("--repeats", type=int, default=3, help="timing runs, each the stage's whole timing")
    args = parser.parse_args()

    import onnxruntime

    from ortflow import config
    from ortflow.quantization.measure import latencies
    from ortflow.quantization.quantizer import quantize_file
    from ortflow.sessions import quiet_logging

    quiet_logging()
    records = Records()
    export_cfg = config.load(overrides={"export": {"per_channel": args.per_channel}}).export
    with tempfile.TemporaryDirectory() as scratch:
        paths = {"fp32": Path(scratch) / "model.onnx", "int8": Path(scratch) / "model.int8.onnx"}
        export_mlp(paths["fp32"])
        quantize_file(paths["fp32"], paths["int8"], "dynamic", export_cfg, records, 64)
        print(f"{cpu_model()}, onnxruntime {onnxruntime.__version__}, dynamic int8"
              f"{' per channel' if args.per_channel else ' per tensor'}; sizes fp32 "
              f"{paths['fp32'].stat().st_size / 1024:.0f} KiB, int8 {paths['int8'].stat().st_size / 1024:.0f} KiB")
        print("run | fp32 b1 p50 | int8 b1 p50 | b1 speed-up | fp32 b64 p50 | int8 b64 p50 | b64 speed-up (ms, 1 thread)")
        for run in range(1, args.repeats + 1):
            t = latencies(paths, records, (1, 64))
            fp32, int8 = t["fp32"], t["int8"]
            print(f"{run} | {fp32['b1_p50']:.4f} | {int8['b1_p50']:.4f} | {fp32['b1_p50'] / int8['b1_p50']:.2f}x | "
                  f"{fp32['b64_p50']:.3f} | {int8['b64_p50']:.3f} | {fp32['b64_p50'] / int8['b64_p50']:.2f}x")


if __name__ == "__main__":
    main()
