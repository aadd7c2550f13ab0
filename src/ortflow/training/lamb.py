"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning: Training
BERT in 76 minutes", Algorithm 2), `train.optimizer.name: lamb`: Adam's update
direction, rescaled per tensor by a trust ratio, as ONNX Runtime's TrainingRunner
computed it (its LambOptimizer operator).

For each parameter tensor x with gradient g, at the 1-based update count t:

    m = beta1 m + (1 - beta1) g                   v = beta2 v + (1 - beta2) g^2
    r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
    d = r + weight_decay x
    x = x - lr ||x|| / ||d|| d                      (ratio 1 if ||x|| or ||d|| is 0)

- Bias correction: always, as Algorithm 2 and the operator's default
  (`do_bias_correction` 1).
- The trust ratio's phi is the identity: ORT's `ratio_min` and `ratio_max` default
  to -inf and +inf, and ortflow sets no bound.
- Zero norms: a tensor whose weights are all 0 (a bias initialised to zero) or whose
  direction is all 0 takes the plain step lr * d, as the operator does (the paper
  leaves 0/0 undefined).
- Gradient clipping: the operator's `max_norm_clip` scales the gradients down to a
  global norm; ortflow already does that after the all-reduce (train.clip_grad_norm,
  gradients.py), so this step takes the clipped gradients.
- eps: the TrainingRunner's 1e-6 by default (config/rules.py resolves train.optimizer.eps).
- The operator leaves an element whose direction is not finite unchanged; here, as in
  ortflow's AdamW, a non-finite gradient propagates.

Weight decay: LAMB's decay is the paper's `r + lambda x`, inside the trust ratio, so
it cannot be applied to the weights beforehand as AdamW's is (weight_decay.py). Each
tensor gets its own lambda (`weight_decays`): train.optimizer.weight_decay for the
decayed group, 0 for the parameters train.optimizer.no_decay picks out, as the
TrainingRunner's BERT recipes gave LAMB two groups (`lambda` 0.01 and 0.0);
WeightDecay.per_tensor gives them and leaves its own `apply` to AdamW and SGD.

Why not ORT's kernel: LambOptimizer has a CUDA kernel only. An InferenceSession of
onnxruntime-training 1.19.2 on the CPU refuses it (NOT_IMPLEMENTED: "Could not find an
implementation for LambOptimizer(1) node"), so ortflow computes it with the array
module of the parameters (`xp`: numpy, or cupy on a GPU), in place: the parameters
and both moments are updated in the arrays passed in, with one scratch array the size
of the current tensor. The step needs each whole tensor (its norms); it cannot run on
the slices of tensors that ZeRO-1 gives a rank (config/rules.py refuses train.zero: 1 with lamb).
"""

from __future__ import annotations



class Lamb:
    """LAMB's step over lists of whole tensors, in place."""

    def __init__(self, betas: tuple[float, float], eps: float, weight_decays: list[float], xp):
        """`weight_decays`: each parameter tensor's lambda, in the order `step` gets the
        tensors (0 for the no_decay group); `xp`: the arrays' module."""
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decays, self.xp = eps, weight_decays, xp

    def step(self, lr: float, step: int, params: list, grads: list, m1: list, m2: list) -> None:
        """One update of `params` and the moments `m1`, `m2` (updated in place) from
        `grads`; `step` is the 1-based count of this update (the `t` of bias correction,
        as ORT's AdamW graph takes it)."""
        if not len(params) == len(grads) == len(m1) == len(m2) == len(self.weight_decays):
            raise ValueError(f"LAMB got {len(params)} parameters, {len(grads)} gradients, {len(m1)} and "
                             f"{len(m2)} moments for {len(self.weight_decays)} weight decays")
        # In double, as the bias corrections of ORT's kernels; each divide rounds to the arrays' dtype.
        corrections = 1.0 - self.beta1 ** step, 1.0 - self.beta2 ** step
        for tensors in zip(params, grads, m1, m2, self.weight_decays):
            self._update(lr, corrections, *tensors)

    def _update(self, lr: float, corrections: tuple[float, float], x, g, m, v, weight_decay: float) -> None:
        """One tensor's update; `scratch` holds in turn (1-beta1) g, (1-beta2) g^2, and the direction d."""
        xp = self.xp
        scratch = xp.multiply(g, 1.0 - self.beta1)
        m *= self.beta1
        m += scratch
        xp.multiply(g, g, out=scratch)
        scratch *= 1.0 - self.beta2
        v *= self.beta2
        v += scratch
        xp.divide(v, corrections[1], out=scratch)
        xp.sqrt(scratch, out=scratch)
        scratch += self.eps
        xp.divide(m, scratch, out=scratch)
        scratch /= corrections[0]
        if weight_decay:
            scratch += weight_decay * x
        x_norm, d_norm = float(xp.linalg.norm(x)), float(xp.linalg.norm(scratch))
        trust_ratio = x_norm / d_norm if x_norm > 0 and d_norm > 0 else 1.0
        scratch *= lr * trust_ratio
        x -= scratch
