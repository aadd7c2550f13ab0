"""ONNX Runtime session options in one place, for training's Module and Optimizer
and for the inference sessions of export and quantize."""

from __future__ import annotations

from pathlib import Path


def session_options(threads: int | None = None):
    """With `threads`, an intra-op pool of that many threads whose idle threads sleep:
    ORT's default (a thread per core for each session, spinning while idle) makes two
    ranks on two cores slower than one, and latency figures need a fixed pool.
    Without, ORT's default."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def inference_session(path: Path, threads: int | None = None):
    """An ONNX Runtime CPU session; `threads` pins the intra-op pool (1 for latency figures)."""
    import onnxruntime as ort

    return ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
