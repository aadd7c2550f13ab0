"""ONNX Runtime's session options and logging in one place, for training's Module
and Optimizer, for the graph builder, and the inference sessions of build_artifacts'
smoke step, export and quantize (`inference_session`)."""

from __future__ import annotations

import functools
from pathlib import Path

from . import external_data

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


def inference_session(path: Path, threads: int | None = None, also: tuple[str, ...] = (), prepacked: bool = True):
    """An ONNX Runtime CPU session; `threads` pins the intra-op pool (1 for latency figures).
    `also` names tensors inside the graph to return besides its outputs (the logits of a
    model that ends in a Softmax, model.json `outputs`), for `session.run` to ask for.
    `prepacked=False` holds the weights once, for what checks or measures values, not speed:
    by default ONNX Runtime keeps its MatMul and Gemm weights a second time, packed for
    MLAS (a 554M GPT's session: 4.5 GiB, 2.4 without)."""
    import onnxruntime as ort

    options = session_options(threads)
    if not prepacked:
        options.add_session_config_entry("session.disable_prepacking", "1")

    def session(model):
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    if not also:
        return session(str(path))
    # Only here onnx: a generation folder's decoder runs where ONNX Runtime alone is installed (a serving venv).
    import tempfile

    import onnx

    proto = external_data.load_model(path, load_data=False)  # weights in external data stay in their file
    outputs = {o.name for o in proto.graph.output}
    extra = [name for name in also if name not in outputs]
    if not extra:
        return session(str(path))
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in extra)
    if not external_data.uses_external_data(proto):
        return session(proto.SerializeToString())
    # ONNX Runtime finds external data beside the model file it loads: the changed graph goes beside the original.
    with tempfile.NamedTemporaryFile(dir=Path(path).parent, suffix=".onnx") as changed:
        onnx.save(proto, changed.name)
        return session(changed.name)


def training_options(threads: int | None = None, recompute: bool = False):
    """`session_options` for a training Module (its training and eval graphs), without ONNX
    Runtime's memory pattern: with a dynamic sequence dimension beside the batch, 1.19.2's
    planner corrupts its arena on the first step (a BERT by task at batch 16 aborted with
    `BFCArena::ChunkFromHandle h < chunks_.size() was false`; the same step runs without
    the pattern, with the same loss). The pattern only pre-plans allocations for shapes
    seen before; no step time changed measurably without it (1.2-1.6 against 1.7-2.5 ms on
    that BERT, a shared 2-core AMD EPYC).

    With `recompute` (a graph that train.recompute rewrote), no memory reuse and
    PRIORITY_BASED execution order, which runs the recomputed blocks late and does not
    hand a block's freed buffers to tensors that live long. bench/bench_recompute.py, one
    rank of 4 sequences of 128 tokens, peak RSS in MiB, ORT's defaults / mem_reuse off /
    PRIORITY_BASED / both: BERT-base 2294 / 2240 / 2290 / 2240, GPT-2 124M 3109 / 3155 /
    3084 / 3152 (a 4-layer GPT-2 of width 256 at 8 x 256: 541 / - / 516 / 496); the
    losses are the same bit for bit. Without recompute ORT's defaults stay: the other
    settings changed BERT-base's peak by at most 16 MiB (2531 with the defaults), took
    153 MiB off GPT-2 124M's (3371) with mem_reuse off but made its step and BERT's 8 to
    40% longer, and added 15 MiB on the 4-layer GPT-2 (docs/benchmarks.md, "Activation
    recomputation")."""
    import onnxruntime as ort

    options = session_options(threads)
    options.enable_mem_pattern = False
    if recompute:
        options.enable_mem_reuse = False
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return options


@functools.cache
def _register_shared_cpu_arena() -> None:
    """ONNX Runtime's process-wide CPU arena, registered once: a second registration is an error."""
    import onnxruntime as ort

    ort.create_and_register_allocator(
        ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT), None)


def share_cpu_arena(options) -> None:
    """Sessions opened with `options` take their CPU memory from one arena of the process
    instead of an arena each. A rank keeps its training, eval and optimizer sessions open for
    the whole run, and an arena never gives back what it once took: with an arena a session,
    an evaluation grew the rank by its whole working set on top of what the training graph's
    arena kept from the step. GPT-2 124M at bf16, 2 ranks, its final evaluation (AMD EPYC): peak
    RSS a rank 4,731 MiB before, 3,921 with one arena, the same step time; without any arena
    lower still, but each step 1.20x longer (docs/benchmarks.md, "One CPU arena for a rank's
    sessions")."""
    _register_shared_cpu_arena()
    options.add_session_config_entry("session.use_env_allocators", "1")
