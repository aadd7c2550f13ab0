"""The parts of building ONNX Runtime's training graphs of a model, in the order the
build_artifacts stage (stages/build_artifacts.py) runs them: the forward model, the
loss, the parameters that train, the generated graphs, the model's description
(model.json) with its cost, and a smoke step."""
