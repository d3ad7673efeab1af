"""What a conversion recipe costs (measured here; ``convert.sweep`` runs the conversions): logit error
against the unquantized source on a fixed prompt and canvas (one plain denoising step and one
self-conditioned step), size on disk, load time, and on the demo tasks (fresh instances) the accuracy
under diffusion with its denoising steps per canvas and the accuracy under AR."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..loader import load

PROMPT_LENGTH = 32
MAX_CANVAS = 256
TEMPERATURE = 0.8  # t_max: the first steps' self-conditioning temperature


@dataclass(frozen=True)
class Probe:
    """A fixed prompt and canvas: seeded token ids, so any checkpoint of the same vocabulary gets the
    same input (the first denoising canvas is uniform noise in the real sampler, too)."""

    prompt: mx.array
    canvas: mx.array

    @classmethod
    def for_model(cls, model, seed: int = 0) -> "Probe":
        cfg = model.config
        rng = np.random.default_rng(seed)
        prompt = rng.integers(3, cfg.vocab_size, size=(1, PROMPT_LENGTH))
        canvas = rng.integers(0, cfg.vocab_size, size=(1, min(cfg.canvas_length, MAX_CANVAS)))
        return cls(mx.array(prompt, dtype=mx.int32), mx.array(canvas, dtype=mx.int32))


def probe_logits(model, probe: Probe) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a first denoising step and of a step self-conditioned on the first one's."""
    cache = model.make_cache()
    model.encode(probe.prompt, cache)
    first = model.denoise(probe.canvas, cache)
    second = model.denoise(probe.canvas, cache, first / TEMPERATURE)
    return np.array(first), np.array(second)


@dataclass(frozen=True)
class LogitError:
    rel_rms: float  # ‖Δ‖₂ / ‖reference‖₂
    max_abs: float  # max |Δ|, in logits (the soft-cap bounds logits to ±30)
    top1: float  # share of canvas positions whose argmax token agrees

    @classmethod
    def between(cls, ours: np.ndarray, reference: np.ndarray) -> "LogitError":
        delta = ours.astype(np.float64) - reference
        return cls(
            rel_rms=float(np.sqrt((delta**2).sum() / (reference.astype(np.float64) ** 2).sum())),
            max_abs=float(np.abs(delta).max()),
            top1=float((ours.argmax(-1) == reference.argmax(-1)).mean()),
        )


@dataclass(frozen=True)
class TaskRow:
    """The demo tasks, every task's instances together."""

    diffusion_accuracy: float  # the checkpoint's own sampler (policy reference)
    steps_per_canvas: float  # its mean denoising steps per canvas
    ar_accuracy: float

    @classmethod
    def measure(cls, model, tokenizer, instances: int, seed: int) -> "TaskRow":
        from ..demo.scores import evaluate_policies

        scores = evaluate_policies(model, tokenizer, instances, seed, ["reference", "ar"])
        diffusion, ar = (list(scores[p].values()) for p in ("reference", "ar"))
        steps = [n for s in diffusion for n in s.steps]
        return cls(_accuracy(diffusion), sum(steps) / len(steps), _accuracy(ar))


def _accuracy(scores) -> float:
    return sum(s.correct for s in scores) / sum(s.total for s in scores)


@dataclass(frozen=True)
class QualityRow:
    label: str
    size_bytes: int
    load_seconds: float
    step: LogitError
    self_conditioned: LogitError
    tasks: TaskRow | None = None


def weights_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def measure_recipe(
    folder: Path, label: str, reference: tuple[np.ndarray, np.ndarray], probe: Probe, instances: int = 0, seed: int = 0
) -> QualityRow:
    start = time.perf_counter()
    model, tokenizer = load(folder)
    load_seconds = time.perf_counter() - start
    step, self_conditioned = probe_logits(model, probe)
    tasks = TaskRow.measure(model, tokenizer, instances, seed) if instances else None
    return QualityRow(
        label,
        weights_size(folder),
        load_seconds,
        LogitError.between(step, reference[0]),
        LogitError.between(self_conditioned, reference[1]),
        tasks,
    )


def reference_logits(src: Path) -> tuple[tuple[np.ndarray, np.ndarray], Probe]:
    model, _ = load(src)
    probe = Probe.for_model(model)
    return probe_logits(model, probe), probe


def format_table(rows: list[QualityRow]) -> str:
    """One line per recipe; the task columns (diffusion accuracy, steps per canvas, AR accuracy) where measured."""
    tasks = any(r.tasks for r in rows)
    header = (
        f"{'recipe':<32} {'size':>10} {'load s':>7} {'rel RMS':>9} {'max|Δ|':>8} {'top-1':>6}"
        f" {'SC rel RMS':>10} {'SC max|Δ|':>9} {'SC top-1':>8}"
    )
    if tasks:
        header += f" {'diff acc':>8} {'steps':>6} {'AR acc':>6}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (
            f"{r.label:<32} {format_size(r.size_bytes):>10} {r.load_seconds:>7.2f} {r.step.rel_rms:>9.2e}"
            f" {r.step.max_abs:>8.3f} {r.step.top1:>6.1%} {r.self_conditioned.rel_rms:>10.2e}"
            f" {r.self_conditioned.max_abs:>9.3f} {r.self_conditioned.top1:>8.1%}"
        )
        if r.tasks:
            line += f" {r.tasks.diffusion_accuracy:>8.1%} {r.tasks.steps_per_canvas:>6.2f} {r.tasks.ar_accuracy:>6.1%}"
        lines.append(line)
    return "\n".join(lines)


def format_size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


def measure_against(src: Path, candidates: dict[str, Path]) -> str:
    """The table for already converted checkpoints against their source."""
    reference, probe = reference_logits(Path(src))
    rows = [measure_recipe(Path(folder), label, reference, probe) for label, folder in candidates.items()]
    return format_table(rows)
