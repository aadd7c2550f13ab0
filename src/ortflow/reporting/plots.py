"""The plots of a run's report, drawn from train/metrics.json: the loss, the learning rate
and the throughput."""

from __future__ import annotations

from pathlib import Path

from .. import atomic
from ..config import Config
from ..training.run_summary import RunSummary

PLOTS = ("loss", "learning_rate", "throughput")


def plot_training(metrics: RunSummary, config: Config, out_dir: Path) -> None:
    """loss.png (train and eval loss, eval quality), learning_rate.png (the
    whole schedule and the logged rates), throughput.png (samples/s and step time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..training.schedule import learning_rate

    train, evals = metrics.history["train"], metrics.history["eval"]
    steps = [row["step"] for row in train]

    figure, (loss_axes, quality_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot(steps, [row["loss"] for row in train], marker=".", label="train (global batch)")
    loss_axes.plot([row["step"] for row in evals], [row["loss"] for row in evals], marker="o", label="eval (whole split)")
    loss_axes.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    loss_axes.legend()
    name = next((key for key in ("perplexity", "accuracy") if evals and key in evals[0]), None)
    if name:
        quality_axes.plot([row["step"] for row in evals], [row[name] for row in evals], marker="o", color="C1")
    quality_axes.set(xlabel="optimizer step", ylabel=name or "-", title=f"Eval {name or '(no quality measure)'}")
    save(figure, out_dir / "loss.png")

    train_cfg = config.train
    all_steps = range(train_cfg.steps)
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([s + 1 for s in all_steps],
              [learning_rate(s, train_cfg.steps, train_cfg.optimizer.lr, train_cfg.lr_schedule)
               for s in all_steps], label=f"{train_cfg.lr_schedule.name} schedule")
    axes.plot(steps, [row["lr"] for row in train], "o", label="logged")
    axes.set(xlabel="optimizer step", ylabel="learning rate", title="Learning rate")
    axes.legend()
    save(figure, out_dir / "learning_rate.png")

    figure, (rate_axes, time_axes) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [row["samples_per_s"] for row in train]
    rate_axes.plot(steps, rates, marker=".", label="logged step")
    if metrics.samples_per_s is not None:  # None: the last attempt ran no step
        rate_axes.axhline(metrics.samples_per_s, color="C2", linestyle="--", label="steady state (run)")
    rate_axes.set(xlabel="optimizer step", ylabel="samples/s", title="Throughput")
    rate_axes.legend()
    time_axes.plot(steps, [1000 * metrics.global_batch_size / rate for rate in rates], marker=".",
                   label="logged step")
    for key, style in (("step_time_p50_s", "--"), ("step_time_p95_s", ":")):
        if getattr(metrics, key) is not None:
            time_axes.axhline(1000 * getattr(metrics, key), color="C3", linestyle=style, label=key[10:13] + " (run)")
    time_axes.set(xlabel="optimizer step", ylabel="ms", title="Step time")
    time_axes.legend()
    save(figure, out_dir / "throughput.png")


def save(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    with atomic.file(path) as temporary:
        figure.savefig(temporary, dpi=100, format="png")
    plt.close(figure)
