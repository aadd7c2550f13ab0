"""Loss blocks of ortflow's own, where ONNX Runtime's overflow.

ORT's BCEWithLogitsLoss computes log(sigmoid(x)): sigmoid rounds to 0 or 1 in
float32 beyond |x| ~ 17 and 88, and the log of 0 is -inf, so a model whose
logits start large (unscaled features) has an infinite loss at step 1.
"""

from __future__ import annotations


def stable_bce_with_logits():
    """mean(max(x, 0) - x*y + log(1 + exp(-|x|))), torch's BCEWithLogitsLoss.
    Exp only sees -|x| <= 0, so nothing overflows. Written with Relu (-|x| is
    x - 2 relu(x)) so that every operator has a gradient in ONNX Runtime."""
    import onnx
    from onnxruntime.training import onnxblock

    from .. import ort_private

    class StableBCEWithLogitsLoss(onnxblock.Block):
        def build(self, logits: str, target: str) -> str:
            graph = self.base.graph
            name = ort_private.new_node_name

            def node(op: str, *inputs: str, **attributes) -> str:
                output = name(f"bce.{op.lower()}")
                graph.node.append(onnx.helper.make_node(op, list(inputs), [output], name=output, **attributes))
                return output

            def constant(value: float) -> str:
                const = name("bce.const")
                graph.initializer.append(onnx.helper.make_tensor(const, onnx.TensorProto.FLOAT, [], [value]))
                return const

            positive = node("Relu", logits)  # max(x, 0)
            minus_abs = node("Sub", logits, node("Mul", positive, constant(2.0)))  # -|x|
            softplus = node("Log", node("Add", node("Exp", minus_abs), constant(1.0)))  # log(1 + exp(-|x|))
            elements = node("Add", node("Sub", positive, node("Mul", logits, target)), softplus)
            return node("ReduceMean", elements, keepdims=0)

    return StableBCEWithLogitsLoss()
