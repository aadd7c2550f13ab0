"""ONNX Runtime's session options and logging in one place, for training's Module
and Optimizer, for the inference sessions of export and quantize, and for the
graph builder."""

from __future__ import annotations

from pathlib import Path

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


def inference_session(path: Path, threads: int | None = None, also: tuple[str, ...] = ()):
    """An ONNX Runtime CPU session; `threads` pins the intra-op pool (1 for latency figures).
    `also` names tensors inside the graph to return besides its outputs (the logits of a
    model that ends in a Softmax, model.json `outputs`), for `session.run` to ask for."""
    import onnx
    import onnxruntime as ort

    model = str(path)
    if also:
        proto = onnx.load(str(path))
        outputs = {o.name for o in proto.graph.output}
        extra = [name for name in also if name not in outputs]
        if extra:
            proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in extra)
            model = proto.SerializeToString()
    return ort.InferenceSession(model, session_options(threads), providers=["CPUExecutionProvider"])
