"""Sharded checkpoints of a training run: the format (store), resume, the checks of
what is read (checks), and ONNX Runtime's own checkpoint file (ort_format)."""
