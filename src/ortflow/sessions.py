"""ONNX Runtime's session options and logging in one place, for training's Module
and Optimizer, for the inference sessions of export and quantize (inference.py),
and for the graph builder."""

from __future__ import annotations

# ONNX Runtime's logger prints warnings a user has nothing to do about (initializers
# it removes while optimizing, nodes it places on the CPU); errors still print.
LOG_SEVERITY_ERROR = 3


def quiet_logging() -> None:
    """ONNX Runtime's default logger, for every session created after this call, at errors only."""
    import onnxruntime as ort

    ort.set_default_logger_severity(LOG_SEVERITY_ERROR)


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


def training_options(threads: int | None = None):
    """`session_options` for a training Module (its training and eval graphs), without ONNX
    Runtime's memory pattern: with a dynamic sequence dimension beside the batch, 1.19.2's
    planner corrupts its arena on the first step (a BERT by task at batch 16 aborted with
    `BFCArena::ChunkFromHandle h < chunks_.size() was false`; the same step runs without
    the pattern, with the same loss). The pattern only pre-plans allocations for shapes
    seen before; no step time changed measurably without it (1.2-1.6 against 1.7-2.5 ms on
    that BERT, a shared 2-core AMD EPYC)."""
    options = session_options(threads)
    options.enable_mem_pattern = False
    return options
