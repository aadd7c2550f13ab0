"""What export and quantize share of the inference model (ortflow.inference): the
training loss of its logits, as torch computes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ortflow.inference import loss_of


@pytest.mark.parametrize("loss, reference", [
    ("cross_entropy", torch.nn.functional.cross_entropy),
    ("mse", torch.nn.functional.mse_loss),
    ("l1", torch.nn.functional.l1_loss),
    ("bce_with_logits", torch.nn.functional.binary_cross_entropy_with_logits),
])
def test_losses_of_logits_equal_torchs(loss, reference):
    rng = np.random.default_rng(0)
    if loss == "cross_entropy":  # [batch, classes, positions], as a language model's logits
        logits, labels = rng.standard_normal((4, 5, 3)) * 3, rng.integers(0, 5, (4, 3))
        expected = reference(torch.from_numpy(logits), torch.from_numpy(labels))
    else:
        logits, labels = rng.standard_normal((6, 2)) * 3, rng.random((6, 2)).round()
        expected = reference(torch.from_numpy(logits), torch.from_numpy(labels))
    assert loss_of(logits.astype(np.float32), labels, loss) == pytest.approx(float(expected), rel=1e-6)


def test_an_unknown_loss_is_refused():
    from ortflow.errors import ModelError

    with pytest.raises(ModelError, match="model.json: loss 'hinge' is not one ortflow trains with"):
        loss_of(np.zeros((1, 2)), np.zeros((1, 2)), "hinge")
