"""The inference model that the export_model stage writes, one job a module:

- `writer.py`: the model itself: the inference graph (graphs/inference_model.py) with the
  merged checkpoint's weights (with LoRA, the adapters merged into them), the data's
  standardization in front, its metadata properties;
- `metadata.py`: what the model says of itself and carries beside it: its metadata
  properties (where it came from, what its outputs and inputs mean) and the data's tokenizer;
- `checks.py`: what the model must pass before it is renamed into place: its interface,
  its logits and loss against the eval graph's, ONNX's reference evaluator as a second
  opinion, a dynamic sequence dimension at other lengths;
- `formats.py`: the trained model in its own framework's format (`transformers/`,
  `model.safetensors`, LoRA's `adapter/`), each read back as its users read it and checked
  against the ONNX model;
- `ecosystem.py`: a text classifier's, tagger's or regressor's `optimum/` folder, the model in
  the layout optimum's ORTModelFor<task> loads, checked against transformers' logits.
"""
