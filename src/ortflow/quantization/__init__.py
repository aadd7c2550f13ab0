"""The int8 model that the quantize_model stage writes, and its report, one job a module:

- `preprocess.py`: ONNX Runtime's quantization pre-processing (`quant_pre_process`), step
  by step with the weights left in their external data, and without the steps that
  cannot run on a model;
- `quantizer.py`: the method (`export.quantize`) and the quantization itself, dynamic or static
  (QDQ, calibrated on eval batches), in rounds that keep fp32 each operator ONNX Runtime
  cannot load in int8;
- `measure.py`: each model evaluated on the eval split and timed on one thread, and the
  table of fp32 against int8;
- `gate.py`: the quality gate (`export.max_accuracy_drop`) with the settings that may
  bring int8 within it, and the warning for an int8 model no smaller than fp32;
- `int4.py`: int4 weight-only quantization of a causal LM's generation folder (MatMulNBits);
- `int4_measure.py`: export.int4's step: that folder written, compared with fp32 and gated.
"""
