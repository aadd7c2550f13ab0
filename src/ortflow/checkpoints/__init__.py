"""Sharded checkpoints of a training run: the format (layout), writing it (writer),
reading it (reader, verify), the best one (best), pruning (retention), which one a
run resumes from (resume), the checks of what is read (checks), ONNX Runtime's own
checkpoint file (ort_format), and the tools of `ortflow checkpoint`: a checkpoint
merged into the files export reads (merge), rewritten as other shards (reshard),
summarized (summary)."""
