"""The 1F1B schedule of pipeline stages (training/pipeline_schedule.py) in the Trainer: the
ranks' grid and the warm-up, the train stage's refusal of artifacts cut otherwise, and on
real MPI ranks the built-in gpt trained 20 steps in 2 stages (1 and 2 copies of each) and 3,
and transformers' GPT-2 with Dropout in 2, against the same config in 1 stage: the
checkpoints the stages write, merged, and the evaluation through the stages."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, copy_inputs, fault, require_e2e, run_on_ranks, run_snakemake
from ortflow import cli, config as config_mod, machine
from ortflow.artifacts import Artifacts
from ortflow.checkpoints import layout, reader
from ortflow.checkpoints.merge import merge
from ortflow.checkpoints.ort_format import TrainingState, read_ort_checkpoint
from ortflow.graphs import pipeline, recompute
from ortflow.graphs.description import read_description
from ortflow.stages import build_artifacts
from ortflow.stages.prepare_data import prepare
from ortflow.training import engine, gradients, preflight
from ortflow.training.pipeline_schedule import place, warm_up

STEPS, BATCH = 20, 8  # the global batch of each copy: micro_batch_size x grad_accum_steps


MODELS = {
    "gpt": {"kind": "gpt", "layers": 2, "heads": 2, "width": 8},  # no Dropout, the token embedding tied to the head
    # transformers' GPT-2 has Dropout 0.1 (embeddings, attention, residuals), and the same tie.
    "gpt2": {"kind": "torch", "path": "transformers_models:GPT2", "kwargs": {"context": 8, "n_embd": 16}},
}


def settings(root: Path, world_size: int, stages: int, accumulated: int = 1, model: str = "gpt",
             zero: int = 0, recompute: str = "none", clip: float | None = 0.5) -> config_mod.Config:
    """The same run at any P: the global batch is micro_batch_size x grad_accum_steps x world_size / P."""
    return config_mod.load(overrides={
        "run": {"seed": 5}, "data": {"source": str(root / "corpus.txt"), "context": 8}, "model": MODELS[model],
        "train": {"world_size": world_size, "pipeline_stages": stages, "zero": zero, "recompute": recompute,
                  "steps": STEPS,
                  "micro_batch_size": BATCH // accumulated, "grad_accum_steps": accumulated, "clip_grad_norm": clip,
                  "checkpoint_every": STEPS, "eval_every": 1000, "log_every": 1}})


def test_the_copies_of_a_stage_are_neighbouring_ranks():
    assert [place(rank, 6, 3) for rank in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [warm_up(stage, 3, 4) for stage in range(3)] == [2, 1, 0]
    assert warm_up(0, 4, 2) == 2  # no more forwards than micro-batches


def test_the_train_stage_refuses_artifacts_of_other_stages_in_one_line(tmp_path, capsys):
    """Before any rank starts: artifacts built without stages (no pipeline.json) for P = 2."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "model.json").write_text("{}")
    assert cli.main(["train", "--config-json", json.dumps({"train": {"pipeline_stages": 2}}), "--train", "x",
                     "--eval", "y", "--artifacts", str(artifacts), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (
        f"ortflow train: error: config key 'train.pipeline_stages': 2 stages, but the artifacts {artifacts} are cut "
        "into 1 (pipeline.json); rebuild them with train.pipeline_stages: 2, or set train.pipeline_stages: 1\n")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A folder with the train split of a short text."""
    root = tmp_path_factory.mktemp("schedule")
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    prepare(settings(root, 2, 2), root / "train", root / "eval")
    return root


def built(root: Path, model: str, stages: int) -> Path:
    """The artifacts of `model` built for `stages` stages (the whole model's with them)."""
    out = root / f"{model}-{stages}"
    if not out.is_dir():
        build_artifacts.build(settings(root, stages, stages, model=model), root / "train", out)
    return out


def trained(folder: Path, config, artifacts: Path, train: Path) -> tuple[Path, dict, str]:
    """The checkpoint after train.steps steps of the Trainer on its ranks (the rank's entry that `ortflow
    train` starts), its evaluation of the whole eval split after them (metrics.json's), and the ranks' log."""
    folder.mkdir()
    job = {"config": config_mod.as_dict(config), "train": str(train), "eval": str(train.parent / "eval"),
           "artifacts": str(artifacts), "out": str(folder / "train"), "warnings": []}
    ranks = run_on_ranks(folder, f"from ortflow.training import trainer\ntrainer.main([{json.dumps(job)!r}])\n",
                         config.train.world_size)
    return (folder / "train" / "checkpoints" / f"step-{config.train.steps:08d}",
            json.loads((folder / "train" / "metrics.json").read_text())["eval"], ranks.stderr)


@pytest.fixture(scope="module")
def unpipelined(tmp_path_factory):
    """trained() of a run in 1 stage, once per config and artifacts: the recompute test compares
    against the same P = 1 run as the 2-stage one of 4 micro-batches, and trains it once."""
    runs = {}

    def train(config, artifacts: Path, data: Path) -> tuple[Path, dict, str]:
        key = (json.dumps(config_mod.as_dict(config), sort_keys=True), str(artifacts), str(data))
        if key not in runs:
            runs[key] = trained(tmp_path_factory.mktemp("p1") / "run", config, artifacts, data)
        return runs[key]

    return train


def largest_difference(got: TrainingState, expected: TrainingState) -> float:
    """Of every parameter and optimizer moment: both states hold the same names."""
    assert sorted(got.parameters) == sorted(expected.parameters)
    assert got.optimizer_states.keys() == expected.optimizer_states.keys()
    pairs = [(got.parameters[name], expected.parameters[name]) for name in expected.parameters]
    pairs += [(moments[moment], expected.optimizer_states[name][moment])
              for name, moments in got.optimizer_states.items() for moment in moments]
    return max(float(np.abs(a - b).max()) for a, b in pairs)


@pytest.mark.e2e
@pytest.mark.parametrize("model, stages, copies, accumulated", [
    ("gpt", 2, 1, 1), ("gpt", 2, 1, 4), ("gpt", 2, 2, 4), ("gpt2", 2, 1, 4),
    ("gpt", 3, 1, 4),  # a middle stage, which receives and sends both ways
])
def test_stages_train_the_weights_of_one(model, stages, copies, accumulated, root, unpipelined, tmp_path):
    """P = stages x D = copies against P = 1 on D ranks, the same global batch and seed, both
    through the Trainer: the checkpoint after 20 steps (AdamW, clipped to the global norm), with
    one micro-batch a step and with 4 (1F1B's warm-up, steady part and cool-down), every
    parameter and moment within 1e-6 of the unpipelined run's, the tied token embedding too
    (held and updated by the first and last stage, written by the first); transformers' GPT-2
    with its Dropout on, each stage drawing the whole model's masks. The same for the whole-model
    checkpoints merge_checkpoint makes of both. Measured: 0 in all five, bit for bit. And
    metrics.json's evaluation (through the stages) is the P = 1 run's."""
    artifacts, train = built(root, model, stages), root / "train"
    expected, expected_eval, _ = unpipelined(settings(root, copies, 1, accumulated, model), artifacts, train)
    got, got_eval, _ = trained(tmp_path / "pipelined", settings(root, stages * copies, stages, accumulated, model),
                               artifacts, train)
    # Every rank wrote its part of its stage; read together (and checked against the whole model), the
    # shards are the whole model's state, each parameter covered once.
    pipelined = reader.read_checkpoint(got, artifacts)
    assert pipelined.manifest.world_size == stages * copies
    tied = {"gpt": "tokens.weight", "gpt2": "model.transformer.wte.weight"}[model]  # the head tied to the embedding
    holders = [int(entry.file.split("-")[1]) for entry in pipelined.manifest.shards
               if tied in entry.parameters]
    assert holders and max(holders) < copies  # written by stage 0's ranks only, though the last stage holds it too
    worst = largest_difference(pipelined.state, reader.read_checkpoint(expected, artifacts).state)
    # merge_checkpoint's whole-model checkpoints (ONNX Runtime's format, which export and quantize read).
    merged = [read_ort_checkpoint(merge(folder, tmp_path / f"merged-{name}", model=artifacts)
                                  / "checkpoint") for name, folder in (("pipelined", got), ("p1", expected))]
    assert merged[0].optimizer == merged[1].optimizer
    worst_merged = largest_difference(*merged)
    print(f"{model} P={stages} x D={copies}, {accumulated} micro-batches, against P=1 after {STEPS} steps: "
          f"largest difference {worst:.3g} in the checkpoints, {worst_merged:.3g} merged")
    assert worst < 1e-6 and worst_merged < 1e-6
    assert got_eval == expected_eval  # the same weights and batches: the same loss and metrics
    assert expected_eval["loss"] > 0
    expected = reader.read_checkpoint(expected).state.parameters
    # The weights did move: the comparison is not of two untrained models.
    state = engine.initial_state(Artifacts(artifacts))
    initial = gradients.parameters_on_host(state, engine.trainable(state), np)
    assert max(float(np.abs(expected[name] - initial[name]).max()) for name in initial) > 1e-2


@pytest.mark.e2e
def test_zero_1_within_a_stage_trains_the_weights_of_one(root, unpipelined, tmp_path):
    """P = 2 x D = 2 under train.zero 1 (each stage's optimizer moments sharded over its 2
    copies by sharding.py's ZeRO-1, as at P = 1) against P = 1 on 2 ranks with train.zero 0
    and 1: every parameter and moment of the checkpoints after 20 steps of 4 micro-batches,
    and of the whole-model checkpoints merge_checkpoint makes of them, within 1e-6; the
    gradient norm of every step (summed from every copy's run of every stage) within 1e-6
    of P = 1's. Without clipping: with it, the norm's squares summed over other runs round
    the clipping factor's last bit otherwise, and AdamW turns that into up to 9.2e-7 on the
    attention's key bias, whose gradient is only rounding (measured; a CPU that sums
    differently may go past 1e-6). Clipping over the stages is the other tests' (bit for bit)."""
    artifacts, train = built(root, "gpt", 2), root / "train"
    got, got_eval, log = trained(tmp_path / "pipelined", settings(root, 4, 2, 4, zero=1, clip=None), artifacts,
                                 train)
    # Rank 0 (stage 0's copy 0) holds its run of its stage's moments: what it writes of the checkpoint.
    _, shard = reader.read_shard(got / layout.shard_name(0, 4))
    held = sum(array.nbytes for moments in shard.optimizer_states.values() for array in moments.values())
    state = engine.initial_state(Artifacts(artifacts).stage(0))
    stage = 2 * sum(array.nbytes for array in gradients.parameters(state, engine.trainable(state), np))
    assert 0.3 * stage < held < 0.7 * stage
    assert (f"train.zero 1: the optimizer's moments sharded over 2 ranks: rank 0 holds {held / 1e6:,.2f} MB of "
            f"{stage / 1e6:,.2f} MB") in log
    merged_got = read_ort_checkpoint(merge(got, tmp_path / "merged-pipelined", model=artifacts)
                                     / "checkpoint")
    for zero in (0, 1):
        expected, expected_eval, _ = unpipelined(settings(root, 2, 1, 4, zero=zero, clip=None), artifacts, train)
        worst = largest_difference(reader.read_checkpoint(got, artifacts).state,
                                   reader.read_checkpoint(expected, artifacts).state)
        merged = read_ort_checkpoint(merge(expected, tmp_path / f"merged-p1-zero{zero}",
                                                            model=artifacts) / "checkpoint")
        assert merged_got.optimizer == merged.optimizer
        worst_merged = largest_difference(merged_got, merged)
        print(f"P=2 x D=2 zero 1 against P=1 zero {zero} after {STEPS} steps: largest difference {worst:.3g} in "
              f"the checkpoints, {worst_merged:.3g} merged")
        assert worst < 1e-6 and worst_merged < 1e-6
        assert got_eval == pytest.approx(expected_eval, rel=1e-6)  # perplexity is exp(loss): relative
        norms = [[entry["grad_norm"] for entry in json.loads((run / "train/metrics.json").read_text())
                  ["history"]["train"]] for run in (tmp_path / "pipelined", expected.parents[2])]
        assert len(norms[0]) == STEPS and norms[0] == pytest.approx(norms[1], rel=1e-6)


@pytest.mark.e2e
def test_recompute_within_stages_trains_the_weights_of_one(root, unpipelined, tmp_path):
    """train.recompute: blocks with P = 2: each stage's own training graph rewritten as the whole
    model's is (graphs/recompute.py), 20 steps of 4 micro-batches against P = 1 without
    recomputation: every parameter and moment within 1e-6. Measured: 0."""
    import onnx

    artifacts, train = root / "gpt-2-recompute", root / "train"
    build_artifacts.build(settings(root, 2, 2, recompute="blocks"), train, artifacts)
    # Cut by parameters, the tiny gpt's first stage is its token embedding alone, the second its 2
    # blocks, whose forward the second stage's backward recomputes.
    recomputed = [{node.name.split("/")[2] for node in onnx.load(str(Artifacts(artifacts).stage(stage).training_model),
                                                                 load_external_data=False).graph.node
                   if node.name.endswith(recompute.SUFFIX) and node.name.startswith("/blocks/")}
                  for stage in range(2)]
    assert recomputed == [set(), {"blocks.0", "blocks.1"}]
    got, got_eval, _ = trained(tmp_path / "pipelined", settings(root, 2, 2, 4, recompute="blocks"), artifacts, train)
    expected, expected_eval, _ = unpipelined(settings(root, 1, 1, 4), built(root, "gpt", 2), train)
    worst = largest_difference(reader.read_checkpoint(got, artifacts).state,
                               reader.read_checkpoint(expected, artifacts).state)
    print(f"P=2 with train.recompute: blocks against P=1 without, after {STEPS} steps: largest difference {worst:.3g}")
    assert worst < 1e-6
    assert got_eval == pytest.approx(expected_eval, rel=1e-6)


# Larger than MODELS["gpt"]: its blocks outweigh the tied embedding, so a cut by parameters halves it.
WORKFLOW_MODEL = {"kind": "gpt", "layers": 4, "heads": 2, "width": 32}


def workflow_config(corpus: Path, name: str, stages: int) -> dict:
    """The built-in gpt in `stages` stages on as many ranks, 6 steps, evaluated and checkpointed every 3."""
    return {"run": {"name": name, "seed": 5}, "data": {"source": str(corpus), "context": 8}, "model": WORKFLOW_MODEL,
            "train": {"world_size": stages, "pipeline_stages": stages, "steps": 6, "micro_batch_size": 4,
                      "grad_accum_steps": 2, "eval_every": 3, "checkpoint_every": 3, "log_every": 1}}


def between_the_estimates(artifacts: Path, staged: dict) -> int:
    """Bytes of memory that the run `staged` (2 ranks of 2 stages) fits under the memory estimate
    and the same 2 ranks in 1 stage (the same global batch) do not: halfway between the two."""
    description, held = read_description(Artifacts(artifacts).model_json), pipeline.held_by_stages(Artifacts(artifacts))
    train = config_mod.load(overrides=staged).train
    _, share = preflight.largest_stage(description, 2, held)
    in_stages, whole = (2 * sum(preflight.memory_estimate(description, settings, 2, train.micro_batch_size,
                                                          part).values())
                        for settings, part in ((train, share), (one_stage(train), 1.0)))
    assert in_stages < whole, (in_stages, whole, share)
    return int(in_stages + whole) // 2


def one_stage(train):
    """`train` (2 stages on 2 ranks) as 2 copies of 1 stage with the same global batch."""
    return replace(train, pipeline_stages=1, grad_accum_steps=train.grad_accum_steps // 2)


@pytest.fixture(scope="module")
def workflow(tmp_path_factory) -> tuple[Path, Path, str, int]:
    """A Snakemake work folder with the run `staged` (2 stages) trained, merged and exported
    under a memory cap (ORTFLOW_MEMORY_AVAILABLE) that its 2 ranks fit only in stages, and the
    run `whole` (1 stage, the same global batch) trained in results/whole by the Trainer on its
    ranks from staged's data and artifacts (which hold the whole model's graphs too; Snakemake
    would prepare and build them again); their text; what Snakemake printed of the first; the cap."""
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    work = tmp_path_factory.mktemp("workflow") / "work"
    staged = workflow_config(corpus, "staged", 2)
    run_snakemake(work, staged, "build_artifacts")
    cap = between_the_estimates(work / "results/staged/artifacts", staged)
    printed = run_snakemake(work, staged, "export_model", env={machine.MEMORY_ENV: str(cap)}).stdout
    trained(work / "results/whole", config_mod.load(overrides=workflow_config(corpus, "whole", 1)),
            work / "results/staged/artifacts", work / "results/staged/data/train")
    return work, corpus, printed, cap


@pytest.mark.e2e
def test_a_run_that_fits_only_in_stages_trains_and_is_refused_in_one(workflow, monkeypatch):
    """Under the cap the fixture's `staged` run trained, merged and exported with, its 2 ranks
    in 1 stage are refused before any rank starts, told to cut the model into 2 stages; in 2
    stages the check passes, naming the larger stage."""
    work, corpus, _, cap = workflow
    artifacts = Artifacts(work / "results/staged/artifacts")
    description, train = read_description(artifacts.model_json), config_mod.load(overrides=workflow_config(corpus, "staged", 2)).train
    monkeypatch.setenv(machine.MEMORY_ENV, str(cap))
    refused = preflight.check_memory(description, one_stage(train))
    print(refused.detail, refused.fix, sep="\n")
    assert refused.status == preflight.FAIL
    assert "set train.pipeline_stages: 2 and train.grad_accum_steps to 2 (the global batch kept" in refused.fix
    fits = preflight.check_memory(description, train, held=pipeline.held_by_stages(artifacts))
    assert fits.status == preflight.OK and "(the rank of stage " in fits.detail, fits.detail
    assert (work / "results/staged/export/model.onnx").is_file()


@pytest.mark.e2e
def test_the_workflow_trains_and_exports_a_model_in_stages(workflow):
    """Snakemake's train in 2 stages, merge_checkpoint and export_model: the log names each
    rank's stage, the exported model is there, and metrics.json's evaluations and losses are
    those of the same run in 1 stage. Measured: equal, bit for bit."""
    work, _, printed, _ = workflow
    # Snakemake's summary at the end
    assert "ortflow: run staged in results/staged\n  model     results/staged/export/model.onnx\n" in printed
    log = (work / "logs/staged/train.log").read_text()
    assert "global batch 8 (4 x 2 accumulated x 1 copy of 2 stages)" in log
    assert "pipeline stages: rank 0: stage 0 (" in log and "; rank 1: stage 1 (" in log
    assert (work / "results/staged/export/model.onnx").is_file()
    staged, whole = (json.loads((work / f"results/{name}/train/metrics.json").read_text())
                     for name in ("staged", "whole"))
    print("eval in 2 stages:", staged["eval"], "in 1:", whole["eval"])
    assert len(staged["history"]["eval"]) == 2
    assert staged["history"]["eval"] == [pytest.approx(entry, abs=1e-6) for entry in whole["history"]["eval"]]
    losses_and_norms = [[entry[key] for entry in run["history"]["train"] for key in ("loss", "grad_norm")]
                        for run in (staged, whole)]
    assert len(losses_and_norms[0]) == 12 and losses_and_norms[0] == pytest.approx(losses_and_norms[1], abs=1e-6)
    # Each rank's waits on the other stage over the steps after the first, against 1F1B's
    # (P - 1) / (m + P - 1) at 2 stages of 2 micro-batches.
    assert staged["pipeline_bubble"] == pytest.approx(1 / 3)
    assert len(staged["pipeline_waited_share"]) == 2 and all(0 < w < 1 for w in staged["pipeline_waited_share"])
    assert "pipeline stages: ranks waited on other stages" in log and "(1F1B's bubble at 2 stages and 2 " in log
    assert "pipeline_waited_share" not in whole


@pytest.mark.e2e
def test_a_run_resumes_at_another_number_of_stages(workflow, tmp_path):
    """Each run resumed from the other's checkpoint of step 3 (2 stages from 1, 1 from 2) ends
    at the other's step 6. Measured: bit for bit."""
    work, corpus, _, _ = workflow
    artifacts, data = work / "results/staged/artifacts", work / "results/staged/data/train"  # artifacts of both Ps
    for name, stages, other in (("staged", 2, "whole"), ("whole", 1, "staged")):
        config = workflow_config(corpus, name, stages)
        config["train"]["resume_from"] = str(work / f"results/{other}/train/checkpoints/step-00000003")
        checkpoint, _, _ = trained(tmp_path / name, config_mod.load(overrides=config), artifacts, data)
        worst = largest_difference(reader.read_checkpoint(checkpoint).state, reader.read_checkpoint(
            work / f"results/{other}/train/checkpoints/step-00000006").state)
        print(f"{name} resumed from {other}'s step 3: largest difference at step 6 {worst:.3g}")
        assert worst < 1e-6


def train_staged(work: Path, corpus: Path, fault_env: dict, collective_timeout_s: int | None = None):
    """`ortflow train` of the staged run in `work`, as its rule runs it, with `fault_env` added to the
    environment: the exit code and what it printed (the rule's log). The stop and the watchdog are
    the Trainer's and its ranks', so Snakemake is left out."""
    require_e2e("starts MPI ranks")
    config = workflow_config(corpus, "staged", 2)
    if collective_timeout_s is not None:
        config["train"]["collective_timeout_s"] = collective_timeout_s
    run = subprocess.run(
        [str(BIN / "ortflow"), "train", "--config-json", json.dumps(config_mod.as_dict(config_mod.load(overrides=config))),
         "--train", "results/staged/data/train", "--eval", "results/staged/data/eval",
         "--artifacts", "results/staged/artifacts", "--out", "results/staged/train"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180,
        env={**os.environ, **fault_env})
    return run.returncode, run.stdout


@pytest.mark.e2e
def test_a_stop_signal_stops_the_stages_with_a_checkpoint_and_the_rerun_ends_as_uninterrupted(workflow, tmp_path):
    """Rank 1 (the last stage) sends SIGTERM to `ortflow train` before step 3 (0-based): every
    stage finishes step 4, writes its part of its checkpoint and stops; the rerun resumes there
    and ends with the uninterrupted run's checkpoint. Measured: bit for bit."""
    source, corpus, _, _ = workflow
    work = copy_inputs(source, tmp_path / "work")
    code, log = train_staged(work, corpus, fault(3, 1, "sigterm"))
    assert code != 0
    assert "stopping after step 4 of 6: SIGUSR1 on" in log
    assert "ortflow train: stopped by SIGTERM after step 4, with a checkpoint; rerun to resume from it" in log
    code, log = train_staged(work, corpus, {})
    assert code == 0, log
    assert "resuming at step 4 from results/staged/train/checkpoints/step-00000004" in log
    worst = largest_difference(*(reader.read_checkpoint(folder / "results/staged/train/checkpoints/step-00000006").state
                                 for folder in (work, source)))
    print(f"stopped after step 4 and resumed: largest difference at step 6 {worst:.3g}")
    assert worst < 1e-6


@pytest.mark.e2e
def test_a_stalled_stage_is_named_by_the_watchdog_and_a_failed_one_ends_the_job(workflow, tmp_path):
    """Rank 0 (stage 0) stalls before step 3 (0-based): rank 1, waiting for its activation, ends
    the run after train.collective_timeout_s naming rank 0. Rank 1 fails at step 3: every rank ends,
    and no metrics.json says the run finished."""
    source, corpus, _, _ = workflow
    work = copy_inputs(source, tmp_path / "work")
    (work / "results/staged/train/metrics.json").unlink()  # the finished run's
    code, log = train_staged(work, corpus, fault(3, 0, "stall"), collective_timeout_s=4)
    assert code != 0
    assert "rank 1: collective receive " in log and "from stage 0 did not finish within " \
        "train.collective_timeout_s=4s; rank 0 is behind: last seen at step 3 (forward)" in log
    code, log = train_staged(work, corpus, fault(3, 1, "raise"), collective_timeout_s=4)
    assert code != 0
    assert "injected failure on rank 1 at step 3" in log and "the ranks exited with code" in log
    assert not (work / "results/staged/train/metrics.json").exists()
