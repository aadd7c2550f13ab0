"""LAMB (training/lamb.py) step for step against a reference written from the paper,
its two weight-decay groups, its config (eps by optimizer) and its refusal of ZeRO-1."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ortflow.stages import build_artifacts
from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.data.shards import ShardReader
from ortflow.errors import ConfigError
from ortflow.training import engine, gradients, weight_decay
from ortflow.config import check_lamb_sharding
from ortflow.training.lamb import Lamb
from ortflow.training.optimizer import Optimizer, Piece
from ortflow.training.weight_decay import WeightDecay
import test_weight_decay
from test_weight_decay import settings

# test_weight_decay's module-scoped fixture, found by pytest under this module-level name.
train_dir = test_weight_decay.train_dir


def lamb_optimizer(**changes):
    """train.optimizer with LAMB at WEIGHT_DECAY, and `changes`."""
    return config_mod.load(overrides={"train": {"optimizer": {"name": "lamb", "weight_decay": WEIGHT_DECAY,
                                                              **changes}}}).train.optimizer

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-6, 0.01
RATES = [0.05, 0.03, 0.02, 0.01, 0.005, 0.001]  # a changing learning rate, as a schedule gives


def reference_lamb(x, g, m, v, t: int, lr: float, weight_decay: float, betas=BETAS, eps=EPS):
    """One layer's update of LAMB as Algorithm 2 of You et al. (2019) writes it, in float64:
    bias correction of both moments, phi the identity (no bounds on the trust ratio),
    no gradient clipping (ortflow clips globally before the optimizer). The paper leaves
    the trust ratio of a zero norm open; this takes 1 (the plain step), as ONNX Runtime's
    LambOptimizer and NVIDIA's implementations do. Returns (x, m, v)."""
    beta1, beta2 = betas
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** t)
    v_hat = v / (1 - beta2 ** t)
    r = m_hat / (np.sqrt(v_hat) + eps)
    u = r + weight_decay * x
    x_norm, u_norm = np.linalg.norm(x), np.linalg.norm(u)
    trust_ratio = x_norm / u_norm if x_norm > 0 and u_norm > 0 else 1.0
    return x - lr * trust_ratio * u, m, v


def tensors(rng) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]]]:
    """Initial weights, and each step's gradients: a decayed 2-D weight, a 1-D bias and a
    LayerNorm scale (no_decay), a bias initialised to zero (trust ratio 1 while its norm
    is 0), and a weight whose gradient is 0 (a direction of 0 but its decay)."""
    weights = {
        "fc.weight": rng.normal(0, 0.5, (6, 5)),
        "fc.bias": rng.normal(0, 0.1, 6),
        "ln.weight": np.ones(5),
        "head.bias": np.zeros(3),
        "unused.weight": rng.normal(0, 0.2, (3, 4)),
    }
    grads = {name: [rng.normal(0, 0.3, w.shape) * (name != "unused.weight") for _ in RATES]
             for name, w in weights.items()}
    return weights, grads


def test_lamb_matches_the_paper_step_for_step():
    weights, grads = tensors(np.random.default_rng(0))
    names = list(weights)
    decay = WeightDecay({n: w.shape for n, w in weights.items()}, [],
                        lamb_optimizer(no_decay=["<1d>"]))
    decays = decay.per_tensor(names)
    assert decays == [WEIGHT_DECAY, 0.0, 0.0, 0.0, WEIGHT_DECAY]

    lamb = Lamb(BETAS, EPS, decays, np)
    params = [weights[n].astype(np.float32) for n in names]
    m1, m2 = [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params]
    buffers = [id(a) for a in params + m1 + m2]
    expected = {n: (weights[n], np.zeros_like(weights[n]), np.zeros_like(weights[n])) for n in names}
    worst = 0.0
    for t, lr in enumerate(RATES, start=1):
        lamb.step(lr, t, params, [grads[n][t - 1].astype(np.float32) for n in names], m1, m2)
        for i, name in enumerate(names):
            expected[name] = reference_lamb(*expected[name][:1], grads[name][t - 1], *expected[name][1:], t, lr,
                                            decays[i])
            for got, want in zip((params[i], m1[i], m2[i]), expected[name]):
                worst = max(worst, float(np.abs(got - want).max()))
        if t == 1:  # the zero bias's trust ratio is 1: Adam's first step, -lr g / (|g| + eps)
            first = grads["head.bias"][0]
            assert np.allclose(params[3], -lr * first / (np.abs(first) + EPS), rtol=0, atol=1e-7)
    assert worst < 1e-6
    assert [id(a) for a in params + m1 + m2] == buffers and all(a.dtype == np.float32 for a in params)
    # Without a gradient the direction is the decay alone, whose trust ratio is 1 / weight_decay:
    # each step scales the weight by 1 - lr, whatever the decay.
    assert np.allclose(params[4], weights["unused.weight"] * np.prod([1 - lr for lr in RATES]), rtol=0, atol=1e-6)


def test_lamb_on_the_gradients_onnx_runtime_computes_for_a_tiny_gpt(train_dir, tmp_path):
    """Artifacts built for lamb, ORT's Module's gradients, and LAMB on ORT's live buffers
    (what the next forward reads), against the paper's step from the same gradients;
    the groups are the real model's (biases, LayerNorms and embeddings undecayed)."""
    config = settings("lamb")
    optimizer = config.train.optimizer
    artifacts = Artifacts(tmp_path / "artifacts")
    description = build_artifacts.build(config, train_dir, artifacts.folder)
    state = engine.initial_state(artifacts)
    names = engine.trainable(state)
    module, step = engine.open_sessions(artifacts, state, "cpu", 1, optimizer, np)
    module.train()
    decay = weight_decay.for_run(state, names, description, optimizer, np)
    decays = decay.per_tensor(names)
    assert sum(d > 0 for d in decays) == 4 and len(decays) == 16
    # The Trainer's optimizer over every whole tensor (train.zero 0), with LAMB's step.
    ours = Optimizer(state, [Piece(n, 0, p.size) for n, p in zip(names, gradients.parameters(state, names, np))],
                     optimizer, np)
    reference = {n: (p.astype(np.float64), np.zeros(p.shape), np.zeros(p.shape))
                 for n, p in zip(names, gradients.parameters(state, names, np))}
    reader, worst = ShardReader(train_dir), 0.0
    for t, lr in enumerate(RATES[:4], start=1):
        batch = reader.gather(np.arange(8 * t, 8 * t + 8))
        module(batch["x"], batch["y"])
        grads = gradients.gradients(state, names, np)
        for name, g, rate in zip(names, grads, decays):
            x, m, v = reference[name]
            reference[name] = reference_lamb(x, g.astype(np.float64), m, v, t, lr, rate, optimizer.betas,
                                             optimizer.eps)
        ours.step(lr, step, decay)
        module.lazy_reset_grad()
        for name in names:
            worst = max(worst, float(np.abs(state.parameters[name].data - reference[name][0]).max()))
    assert worst < 1e-6


def test_lamb_leaves_weight_decay_to_its_update():
    """WeightDecay.apply decays AdamW's and SGD's parameters before their step; LAMB's not."""
    optimizer = lamb_optimizer(no_decay=["bias"])
    decay = WeightDecay({"fc.weight": (2, 2), "fc.bias": (2,)}, [], optimizer)
    weight = np.ones((2, 2), np.float32)
    decay.apply(0.1, ["fc.weight"], [weight])
    assert (weight == 1).all()
    assert decay.per_tensor(["fc.bias", "fc.weight"]) == [0.0, WEIGHT_DECAY]
    assert decay.describe().startswith(f"weight decay {WEIGHT_DECAY} (inside LAMB's update) on 1 parameter tensors")


def test_lamb_refuses_mismatched_lists():
    lamb = Lamb(BETAS, EPS, [0.0], np)
    one = [np.ones(2, np.float32)]
    with pytest.raises(ValueError, match="LAMB got 1 parameters, 1 gradients, 1 and 0 moments for 1 weight decays"):
        lamb.step(0.1, 1, one, one, one, [])


@pytest.mark.parametrize("name, eps", [("adamw", 1e-8), ("sgd", 1e-8), ("lamb", 1e-6)])
def test_eps_defaults_to_the_optimizers_own(name, eps):
    assert config_mod.load(overrides={"train": {"optimizer": {"name": name}}}).train.optimizer.eps == eps
    given = config_mod.load(overrides={"train": {"optimizer": {"name": name, "eps": 1e-7}}})
    assert given.train.optimizer.eps == 1e-7


def test_lamb_refuses_zero_1():
    """ZeRO-1 (train.zero, h-zero's key) gives ranks slices of tensors; LAMB needs whole ones."""
    train = config_mod.load(overrides={"train": {"optimizer": {"name": "lamb"}}}).train
    with pytest.raises(ConfigError) as error:
        check_lamb_sharding(replace(train, zero=1))
    assert str(error.value) == (
        "config key 'train.zero': 1 gives each rank slices of the optimizer's tensors, but LAMB's trust ratio "
        "needs the norm of each whole tensor; set train.zero: 0 with lamb, or use train.optimizer.name: adamw "
        "with ZeRO")
    check_lamb_sharding(replace(train, zero=0))
    check_lamb_sharding(train)
    check_lamb_sharding(replace(train, optimizer=replace(train.optimizer, name="adamw"), zero=1))
