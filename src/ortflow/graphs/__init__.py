"""The parts of building ONNX Runtime's training graphs of a model, in the order the
build_artifacts stage (stages/build_artifacts.py) runs them: the forward model, the
loss, the parameters that train, the generated graphs, a smoke step and the cost."""
