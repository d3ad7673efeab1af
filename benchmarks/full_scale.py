"""The released model's size end to end: a random checkpoint with google/diffusiongemma-26B-A4B-it's
text config, converted, loaded and run with each policy, timed stage by stage.

    python benchmarks/full_scale.py [--layers 30] [--bits 4] [--recipe mixed] [--work-dir DIR]
    python benchmarks/full_scale.py --in-memory [--recipe none] [--sweep --predict-device H200]

By default it writes the bf16 source (``checkpoint_tools.synthetic_checkpoint.write_checkpoint``), converts it
with ``python -m mlx_dgemma.convert`` (``--recipe none``: unquantized), loads the conversion and runs
an autoregressive answer, one verified-drafting round and one diffusion canvas at ``--steps`` steps
(the stop rule cannot fire). It prints each stage's time and peak RSS (writing and converting run as
child processes, measured alone), the load time and resident memory, the time per forward of each
policy and the peak memory, then deletes its files (also on an error, Ctrl-C or SIGTERM).

``--in-memory`` writes nothing: random weights are made on the default device and quantized there,
layer by layer (the GPU run, where a 50 GB checkpoint fits neither the disk nor the time).
``--sweep`` adds the denoising step time at 16..256 positions and the AR token rate, beside what
``policy.predict`` gives for ``--predict-device`` at the model's own bits per weight and the time the
measurement takes per predicted time (``x roofline``). ``--width N`` runs a small model instead of the
released shapes (``benchmarks/gpu_suite.sh --dry-run``).
"""

from __future__ import annotations

from mlx_dgemma import fast_blas

fast_blas.load()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # checkpoint_tools/ and mlx_dgemma/ of this checkout, also in the child processes

from checkpoint_tools.synthetic_checkpoint import ONES, hf_config, hf_tensors, scaled_sizes  # noqa: E402
from mlx_dgemma.convert import Quantization  # noqa: E402
from mlx_dgemma.engine import drafting, policy, rules  # noqa: E402
from mlx_dgemma.engine.batch import prefill  # noqa: E402
from mlx_dgemma.engine.sampler import MxRandom, SamplerSettings  # noqa: E402
from mlx_dgemma.loader import load_model  # noqa: E402
from mlx_dgemma.model.config import FULL, ModelConfig  # noqa: E402
from mlx_dgemma.model.diffusion_gemma import DiffusionGemma  # noqa: E402

GB = 1e9
RECIPES = ("mixed", "uniform", "none")


def released_sizes(layers: int) -> dict:
    """The released text config (policy.RELEASED) cut to ``layers`` layers, the last one full attention."""
    sizes = {
        k: v
        for k, v in asdict(policy.RELEASED).items()
        if k not in ("quantization", "vision_config", "eos_token_id", "rope_parameters")
    }
    types = list(policy.RELEASED.layer_types[:layers])
    types[-1] = FULL
    sizes.update(num_hidden_layers=layers, layer_types=types)
    return sizes


def source_bytes(sizes: dict, dtype: str) -> int:
    return sum(math.prod(shape) for _, shape in hf_tensors(sizes)) * getattr(mx, dtype).size


def converted_bytes(sizes: dict, bits: int, recipe: str, dtype: str) -> int:
    """The conversion's size, near enough: each matrix at the bits the recipe gives its module, plus a
    16-bit scale and bias per group; vectors as they are."""
    if recipe == "none":
        return source_bytes(sizes, dtype)
    quantization = Quantization.from_flags(bits, None, None, recipe)
    total = 0.0
    for name, shape in hf_tensors(sizes):
        if len(shape) < 2:
            total += math.prod(shape) * getattr(mx, dtype).size
            continue
        params = quantization.params_for(name.removesuffix(".weight"))
        total += math.prod(shape) * (params.bits + 32 / params.group_size) / 8
    return int(total)


# --- stages -------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    seconds: float
    peak_rss_gb: float
    detail: str = ""

    def line(self) -> str:
        return f"{self.name:<16} {self.seconds:8.1f} s   peak RSS {self.peak_rss_gb:6.2f} GB   {self.detail}"


_children: list[subprocess.Popen] = []


def run_child(name: str, argv: list[str], detail: str = "") -> Stage:
    """Run ``argv`` to completion; its time and its own peak RSS (``wait4``'s, not this process's)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=ROOT, env=env)
    _children.append(child)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    _children.remove(child)
    if child.returncode != 0:
        raise SystemExit(f"full_scale: {name} failed (exit {child.returncode}): {' '.join(argv)}")
    return Stage(name, time.perf_counter() - start, usage.ru_maxrss * 1024 / GB, detail)


def folder_gb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / GB


def write_source(folder: Path, sizes: dict, dtype: str) -> Stage:
    code = (
        "import json, sys; from pathlib import Path; from checkpoint_tools.synthetic_checkpoint import write_checkpoint; "
        "write_checkpoint(Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])"
    )
    stage = run_child("source written", [sys.executable, "-c", code, str(folder), json.dumps(sizes), dtype])
    stage.detail = f"{folder_gb(folder):.2f} GB {dtype} on disk"
    return stage


def convert_source(src: Path, dst: Path, recipe: str, bits: int) -> Stage:
    argv = [sys.executable, "-m", "mlx_dgemma.convert", "--hf-path", str(src), "--mlx-path", str(dst)]
    if recipe != "none":
        argv += ["-q", "--q-bits", str(bits), "--quant-predicate", recipe]
    stage = run_child("converted", argv)
    stage.detail = f"{folder_gb(dst):.2f} GB on disk"
    return stage


def rss_gb(field: str = "VmRSS") -> float:
    """This process's resident (VmRSS) or peak resident (VmHWM) memory; 0 where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 0.0


def load_converted(folder: Path) -> tuple[DiffusionGemma, Stage]:
    start = time.perf_counter()
    model = load_model(folder)
    seconds = time.perf_counter() - start
    return model, Stage("loaded", seconds, rss_gb("VmHWM"), resident_detail())


def resident_detail() -> str:
    return f"resident {rss_gb():.2f} GB, MLX active {mx.get_active_memory() / GB:.2f} GB"


def random_model(sizes: dict, recipe: str, bits: int, dtype: str, seed: int = 0) -> tuple[DiffusionGemma, Stage]:
    """The model made in memory on the default device: random weights (0.02 · normal; norms and
    scales 0.5 + uniform, as write_checkpoint makes them) in ``dtype``, quantized as the converter's
    ``recipe`` would, one layer at a time so that only one layer is ever unquantized."""
    start = time.perf_counter()
    model = DiffusionGemma(ModelConfig.from_dict(hf_config(sizes, dtype)))  # parameters lazy until filled
    quantization = None if recipe == "none" else Quantization.from_flags(bits, None, None, recipe)
    key = mx.random.key(seed)
    shapes = {name: value.shape for name, value in tree_flatten(model.parameters())}
    for unit in _units(list(shapes)):
        for name in unit:
            key, sub = mx.random.split(key)
            shape = shapes[name]
            if name.endswith(ONES):
                weight = 0.5 + mx.random.uniform(shape=shape, key=sub)
            else:
                weight = 0.02 * mx.random.normal(shape, key=sub)
            model.update(tree_unflatten([(name, weight.astype(getattr(mx, dtype)))]))
        modules = {name.rsplit(".", 1)[0] for name in unit}
        if quantization is not None:
            nn.quantize(
                model,
                class_predicate=lambda path, m: (
                    path in modules and hasattr(m, "to_quantized") and asdict(quantization.params_for(path))
                ),
            )
        mx.eval([v for name, v in tree_flatten(model.parameters()) if name.rsplit(".", 1)[0] in modules])
    model.eval()
    seconds = time.perf_counter() - start
    return model, Stage("made in memory", seconds, rss_gb("VmHWM"), resident_detail())


def _units(names: list[str]) -> list[list[str]]:
    """Parameter names by decoder layer, then everything else (embedding, norms, self-conditioning)."""
    layers: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        unit = ".".join(parts[:4]) if name.startswith("model.decoder.layers.") else ""
        layers.setdefault(unit, []).append(name)
    return list(layers.values())


# --- runs ---------------------------------------------------------------------------------------


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def ar_answer(model, cache, logits: mx.array, tokens: int) -> str:
    """``tokens`` greedy tokens after the prompt in ``cache``, which is then trimmed back to it."""
    token = logits.argmax(-1, keepdims=True)

    def decode():
        nonlocal token
        for _ in range(tokens):
            token = model.next_token_logits(token, cache).argmax(-1, keepdims=True)
            mx.eval(token)

    _, seconds = timed(decode)
    cache.trim(tokens)
    return f"AR answer        {tokens} tokens: {seconds / tokens * 1e3:.1f} ms per token ({tokens / seconds:.2f} tok/s)"


def verified_round(model, cache, logits: mx.array, length: int, steps: int) -> str:
    """One verified-drafting round after the prompt in ``cache`` (trimmed back to it afterwards)."""
    before = cache.offset
    rule = rules.GreedyRule(set(), model.config.canvas_length)
    settings = drafting.DraftSettings(length, steps)
    known = int(logits.argmax(-1).item())
    row = drafting.DraftRow(cache, known, rule, SamplerSettings(), MxRandom(0))
    rounds, seconds = timed(lambda: drafting.verify_rounds(model, [row], settings))
    result = rounds[0]
    cache.trim(cache.offset - before)
    return (
        f"verified round   draft of {length} in {steps} step(s) + verifying pass: {seconds:.2f} s "
        f"({result.forwards} forwards, {seconds / result.forwards * 1e3:.0f} ms each), kept {result.kept}"
    )


def diffusion_canvas(model, cache, steps: int, canvas: int) -> str:
    seconds = policy.time_canvas(model, cache, steps, canvas)  # the cache is only read
    return (
        f"diffusion canvas {canvas} positions, {steps} steps: {seconds:.2f} s "
        f"({seconds / steps * 1e3:.0f} ms per step, {canvas / seconds:.2f} tok/s)"
    )


def bits_per_weight(model) -> float:
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return 8 * nbytes / policy.parameter_count(model.config)


def sweep(model, prompt: mx.array, device: str | None, repeats: int, canvas: int, length: int) -> list[str]:
    """Step time per canvas length up to ``canvas``, AR and prefill, as ``policy.measure`` times them
    (best of ``repeats`` after a warm-up), beside the roofline's prediction for ``device``."""
    canvases = [c for c in policy.CANVAS_LENGTHS if c <= canvas] or [canvas]
    drafts = [n for n in policy.DRAFT_LENGTHS if n <= canvas]
    measured = policy.measure(model, prefix=prompt.shape[1], canvases=canvases, repeats=repeats, draft_lengths=drafts)
    bits = bits_per_weight(model)
    predicted = policy.predict(device, model.config, bits=bits, prefix=prompt.shape[1]) if device else None
    head = f"{'':<20}{'measured':>12}" + (f"{'predicted (' + device + ')':>24}{'x roofline':>12}" if predicted else "")
    lines = [f"sweep: {measured.device}, {bits:.2f} bits per weight", head]

    def row(label: str, ours: float, theirs: float | None, unit: str, slower: float | None = None) -> str:
        text = f"{label:<20}{ours:>9.2f} {unit:<5}"
        if theirs is None:
            return text
        return text + f"{theirs:>18.2f} {unit:<5}" + (f"{slower:>10.2f}x" if slower is not None else "")

    def rate(label: str, ours: float, theirs: float | None) -> str:  # tok/s: the roofline's times ours
        return row(label, ours, theirs, "tok/s", theirs / ours if theirs else None)

    def time(label: str, ours_s: float, theirs_s: float | None) -> str:
        return row(
            label, ours_s * 1e3, theirs_s * 1e3 if theirs_s else None, "ms", ours_s / theirs_s if theirs_s else None
        )

    lines.append(rate("AR", measured.ar_tok_s, predicted.ar_tok_s if predicted else None))
    lines.append(rate("prefill", measured.prefill_tok_s, predicted.prefill_tok_s if predicted else None))
    for c in canvases:
        lines.append(time(f"step at {c}", measured.step_s(c), predicted.step_s(c) if predicted else None))
    lines.append(
        row(
            f"crossover at {canvases[-1]}",
            measured.crossover_steps(canvases[-1]),
            predicted.crossover_steps(canvases[-1]) if predicted else None,
            "steps",
        )
    )
    ours = measured.step_s(length) + measured.verify_s(length)
    theirs = predicted.step_s(length) + predicted.verify_s(length) if predicted else None
    lines.append(time(f"round of {length}, 1 step", ours, theirs))
    return lines


# --- the whole run ------------------------------------------------------------------------------


@contextmanager
def cleaned_up(folder: Path | None):
    """Delete ``folder`` however the run ends; SIGTERM ends it like Ctrl-C, stopping any child first."""

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        for child in list(_children):
            child.terminate()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        signal.signal(signal.SIGTERM, previous)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def check_disk(work_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(work_dir).free
    if free < needed:
        raise SystemExit(
            f"full_scale: needs {needed / GB:.1f} GB free in {work_dir}, there are {free / GB:.1f} GB; "
            "pass --work-dir on a larger disk, or --layers N for fewer layers"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=policy.RELEASED.num_hidden_layers)
    p.add_argument(
        "--width",
        type=int,
        default=None,
        help="not the released shapes: a small model, every width of the pattern preset times this "
        "(a dry run of the script in seconds)",
    )
    p.add_argument("--recipe", choices=RECIPES, default="mixed", help="the converter's recipe; none: unquantized")
    p.add_argument("--bits", type=int, default=4, help="the converter's --q-bits")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="the source's dtype")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--in-memory", action="store_true", help="make the model in memory: no checkpoint written")
    p.add_argument("--model", type=Path, default=None, help="only load and run this MLX conversion")
    p.add_argument("--prompt", type=int, default=46, help="prompt tokens before each run")
    p.add_argument("--ar-tokens", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="denoising steps of the diffusion canvas")
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--draft-length", type=int, default=32)
    p.add_argument("--draft-steps", type=int, default=1)
    p.add_argument("--warmup", action="store_true", help="run each policy once untimed first (compiles on a GPU)")
    p.add_argument("--sweep", action="store_true", help="also step ms at 16..256 positions and AR tok/s")
    p.add_argument(
        "--predict-device",
        choices=sorted(policy.KNOWN_DEVICES),
        default=None,
        help="print policy.py's prediction for this device beside the sweep",
    )
    p.add_argument("--repeats", type=int, default=2, help="repeats of each sweep figure (best is kept)")
    args = p.parse_args(argv)
    if not 1 <= args.layers <= policy.RELEASED.num_hidden_layers:
        p.error(f"--layers must be 1..{policy.RELEASED.num_hidden_layers}, got {args.layers}")
    if not 1 <= args.canvas <= policy.RELEASED.canvas_length or not 1 <= args.draft_length <= args.canvas:
        p.error("--canvas must be 1..256 and --draft-length 1..--canvas")
    if args.width is not None and not 1 <= args.width <= 64:
        p.error(f"--width must be 1..64, got {args.width}")
    if args.width is not None and args.recipe != "none" and args.width % 8:
        p.error(
            f"--width {args.width} with --recipe {args.recipe}: quantizing needs a multiple of 8 (widths in groups "
            "of 64), or --recipe none"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is not None:  # a conversion at hand (the last stage of a full run, in its own process)
        model, stage = load_converted(args.model)
        print(stage.line(), flush=True)
        run_policies(model, args)
        return
    sizes = released_sizes(args.layers) if args.width is None else scaled_sizes(args.layers, args.width)
    label = "unquantized" if args.recipe == "none" else f"{args.recipe} {args.bits}-bit"
    shapes = "released text shapes" if args.width is None else f"the pattern preset's shapes x {args.width}"
    print(
        f"full_scale: {shapes}, {args.layers} layer(s), {label}, source {args.dtype}; "
        f"device {mx.default_device()}; BLAS: {fast_blas.describe()}",
        flush=True,
    )
    if args.in_memory:
        model, stage = random_model(sizes, args.recipe, args.bits, args.dtype)
        print(stage.line(), flush=True)
        run_policies(model, args)
        return
    source = source_bytes(sizes, args.dtype)
    check_disk(args.work_dir, source + converted_bytes(sizes, args.bits, args.recipe, args.dtype))
    work = Path(tempfile.mkdtemp(prefix="dgemma-full-scale-", dir=args.work_dir))
    with cleaned_up(work):
        src, dst = work / "source", work / "converted"
        print(write_source(src, sizes, args.dtype).line(), flush=True)
        print(convert_source(src, dst, args.recipe, args.bits).line(), flush=True)
        shutil.rmtree(src)  # not read again: its disk space back before loading
        runs = run_child("load and runs", [sys.executable, __file__, "--model", str(dst), *run_options(args)])
        print(runs.line(), flush=True)


def run_options(args: argparse.Namespace) -> list[str]:
    """The command line of the options that shape the policy runs (for the child that does them)."""
    options = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in _RUN_OPTIONS]
    flags = [f"--{name}" for name in ("warmup", "sweep") if getattr(args, name)]
    device = ["--predict-device", args.predict_device] if args.predict_device else []
    return options + flags + device


_RUN_OPTIONS = ("prompt", "ar_tokens", "steps", "canvas", "draft_length", "draft_steps", "repeats")


def run_policies(model, args: argparse.Namespace) -> None:
    """One prefill of a random prompt, then each policy after it (the cache trimmed back between them)."""
    prompt = mx.random.randint(3, model.config.vocab_size, (1, args.prompt), key=mx.random.key(7))
    mx.reset_peak_memory()
    cache = model.make_cache()
    logits, seconds = timed(lambda: prefill(model, prompt, cache, logits=True))
    print(f"prefill          {args.prompt} tokens: {seconds:.2f} s ({args.prompt / seconds:.1f} tok/s)", flush=True)
    runs = [
        lambda: ar_answer(model, cache, logits, args.ar_tokens),
        lambda: verified_round(model, cache, logits, args.draft_length, args.draft_steps),
        lambda: diffusion_canvas(model, cache, args.steps, args.canvas),
    ]
    for run in runs:
        if args.warmup:
            run()
        print(run(), flush=True)
    if args.sweep:
        for line in sweep(model, prompt, args.predict_device, args.repeats, args.canvas, args.draft_length):
            print(line, flush=True)
    print(
        f"peak             RSS {rss_gb('VmHWM'):.2f} GB, MLX {mx.get_peak_memory() / GB:.2f} GB; {resident_detail()}",
        flush=True,
    )


if __name__ == "__main__":
    main()
