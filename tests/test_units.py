"""Fast unit tests (milliseconds) of the arithmetic behind the workflow tests: how a
checkpoint's bytes are split over ranks, which checkpoints are pruned, eval
results from batch totals, the losses of an inference model's logits, and atomic writes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ortflow import atomic
from ortflow.checkpoints import store
from ortflow.export_model import loss_of
from ortflow.checkpoints.ort_format import TrainingState
from ortflow.evaluation import batch_totals, eval_results


def state(sizes: dict[str, int], moments: int = 2) -> TrainingState:
    """Parameters of `sizes` float32 elements, each with `moments` AdamW-like moments."""
    params = {name: np.arange(n, dtype=np.float32) for name, n in sizes.items()}
    return TrainingState(params, {n: True for n in params},
                         {n: {f"momentum{i}": p + i + 1 for i in range(moments)} for n, p in params.items()},
                         {"step": 1}, {})


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_partition_covers_every_element_once_in_nearly_equal_bytes(world_size):
    full = state({"b": 5, "a": 1000, "c": 1, "d": 0, "e": 37})
    parts = store.partition(full, world_size)
    assert len(parts) == world_size
    for name, array in full.parameters.items():
        ranges = sorted(part[name] for part in parts if name in part)
        covered = [i for start, stop in ranges for i in range(start, stop)]
        assert covered == list(range(array.size)), (name, ranges)
    per_rank = [sum((stop - start) * 4 * 3 for start, stop in part.values()) for part in parts]
    total = sum(full.nbytes(n) for n in full.parameters)
    assert sum(per_rank) == total
    assert max(per_rank) - min(per_rank) <= 4 * 3  # at most one element (with its two moments) apart


def test_partition_splits_one_large_parameter_across_ranks():
    parts = store.partition(state({"big": 10, "small": 2}), 3)
    assert [part.get("big") for part in parts] == [(0, 4), (4, 8), (8, 10)]
    assert [part.get("small") for part in parts] == [None, None, (0, 2)]


def _checkpoint(root, step: int, digest: str, complete: bool = True):
    folder = store.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / store.MANIFEST).write_text(json.dumps({"identity_digest": digest}))
    if complete:
        (folder / store.COMPLETE).write_text("")
    return folder


def test_pruning_keeps_the_newest_of_this_identity_and_leaves_others_alone(tmp_path):
    ours = [_checkpoint(tmp_path, s, "ours") for s in (10, 20, 30, 40)]
    other = _checkpoint(tmp_path, 25, "other")
    crashed_old = _checkpoint(tmp_path, 15, "ours", complete=False)
    crashed_new = _checkpoint(tmp_path, 50, "ours", complete=False)
    store._prune(tmp_path, "ours", keep=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(p.name for p in (ours[2], ours[3], other, crashed_new)), left
    assert not crashed_old.exists()


def test_eval_results_of_summed_batch_totals():
    classes = {"task": "classification", "loss": "cross_entropy"}
    logits = np.array([[2.0, 0.1], [0.2, 1.0], [3.0, -1.0]])
    labels = np.array([0, 1, 1])
    totals = batch_totals(0.5, logits, labels, classes) + batch_totals(1.5, logits[:1], labels[:1], classes)
    assert totals.tolist() == [0.5 * 3 + 1.5 * 1, 2 + 1, 4]
    assert eval_results(totals, "classification") == {"loss": 0.75, "accuracy": 0.75}
    text = {"task": "language_model", "loss": "cross_entropy"}
    tokens = batch_totals(2.0, np.zeros((2, 5, 3)), np.zeros((2, 3), dtype=np.int64), text)
    assert tokens.tolist() == [12.0, 6.0, 6.0]  # the loss is a mean over the 6 tokens
    assert eval_results(tokens, "language_model") == {"loss": 2.0, "perplexity": math.exp(2.0), "accuracy": 1.0}
    regression = batch_totals(0.25, np.zeros((4, 2)), np.zeros((4, 2)), {"task": "regression", "loss": "mse"})
    assert regression.tolist() == [1.0, 0.0, 4.0] and eval_results(regression, "regression") == {"loss": 0.25}


def test_batch_totals_of_one_logit_per_record_and_of_trailing_size_one_dims():
    """bce_with_logits on two classes: one logit per record, class 1 where it is
    positive (argmax over axis 1 failed: the logits have no axis 1). A model-zoo
    classifier's [N, classes, 1, 1] against a flat label: the trailing dims dropped."""
    two_classes = {"task": "classification", "loss": "bce_with_logits"}
    assert batch_totals(0.5, np.array([2.0, -1.0, 0.5, -3.0]), np.array([1, 0, 0, 0]), two_classes).tolist() == [
        2.0, 3.0, 4.0]
    assert batch_totals(0.5, np.array([[2.0], [-1.0]]), np.array([1, 1]), two_classes).tolist() == [1.0, 1.0, 2.0]
    pooled = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]]).reshape(2, 3, 1, 1)
    classes = {"task": "classification", "loss": "cross_entropy"}
    assert batch_totals(1.0, pooled, np.array([1, 2]), classes).tolist() == [2.0, 1.0, 2.0]
    expected = loss_of(pooled.reshape(2, 3), np.array([1, 2]), "cross_entropy")
    assert loss_of(pooled, np.array([1, 2]), "cross_entropy") == pytest.approx(expected, rel=1e-12)


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


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    atomic.write_text(path, "old\n")
    with pytest.raises(RuntimeError):
        with atomic.file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the writer fails")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    with atomic.file(path) as tmp:
        assert tmp == tmp_path / "out.json.tmp"
        tmp.write_text("new\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_an_atomic_folder_replaces_the_old_one_only_when_complete(tmp_path):
    out = tmp_path / "split"
    with atomic.folder(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic.folder(out) as tmp:
            assert tmp == tmp_path / "split.tmp" and list(tmp.iterdir()) == []
            (tmp / "b").write_text("2")
            raise RuntimeError("the writer fails")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split"]
    assert sorted(p.name for p in out.iterdir()) == ["a"]
    (tmp_path / "split.tmp").mkdir()  # left by a crash
    (tmp_path / "split.tmp" / "stale").write_text("x")
    with atomic.folder(out) as tmp:
        (tmp / "c").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == ["c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split"]
