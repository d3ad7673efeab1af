"""Where a forward's time goes, by layer and by part: one denoising step of ``--canvas`` positions, one
verifying pass of ``--draft-length`` tokens and one AR token, after a ``--prompt``-token prompt, on
MLX's default device, with random weights made in memory at full_scale.py's shapes.

    python benchmarks/profile_step.py [--layers 30] [--dtype bfloat16] [--recipe none] [--json OUT.json]
    python benchmarks/profile_step.py --preset pattern --dtype float32 --canvas 16 --draft-length 8  # quick

Each part (a layer's attention projections, attention, router, experts, dense MLP and norms; the
embedding, the self-conditioning signal and MLP, the final norm and the vocabulary head) is timed
alone between ``mx.eval`` barriers: its inputs evaluated before its clock starts, its outputs after.
The model's own forward runs (``denoise``, ``encode``, ``next_token_logits``, ``head``): its parts
are timed in place, not copied, so the profile is of the code that runs. "other" is what runs
between the parts (residual adds, layer scalars, cache writes). The barriers cost time of their own
and stop work overlapping: "whole" is the same forward with no barrier inside, and the parts'
shares are the thing to read.
"""

from __future__ import annotations

from mlx_dgemma import fast_blas

fast_blas.load()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import full_scale  # noqa: E402
import mlx.core as mx  # noqa: E402
from shapes import add_shape_options, describe, require_positive, sizes_from  # noqa: E402

from mlx_dgemma.model.config import FULL  # noqa: E402

NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2",
)
# (attribute path in a layer, part) of each layer; every norm counts as "norms".
LAYER_PARTS = (
    ("self_attn.project", "attention projections"),
    ("self_attn.attend", "attention"),
    ("router", "router"),
    ("experts", "experts"),
    ("mlp", "dense MLP"),
    *((norm, "norms") for norm in NORMS),
)
# (attribute path in the model, part) outside the layers.
MODEL_PARTS = (
    ("embed", "embedding"),
    ("self_conditioning_signal", "self-conditioning signal"),
    ("model.decoder.self_conditioning", "self-conditioning MLP"),
    ("model.decoder.norm", "final norm"),
    ("head", "vocabulary head"),
)
PARTS = tuple(dict.fromkeys(part for _, part in (*LAYER_PARTS, *MODEL_PARTS)))


class _Timed:
    """``fn`` called with an ``mx.eval`` barrier on each side, its seconds added to ``seconds[key]``."""

    def __init__(self, fn, key: tuple[int | None, str], seconds: dict):
        self.fn, self.key, self.seconds = fn, key, seconds

    def __call__(self, *args, **kwargs):
        mx.eval([a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)])
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        mx.eval(out)
        self.seconds[self.key] = self.seconds.get(self.key, 0.0) + time.perf_counter() - start
        return out


@contextmanager
def parts_timed(model, seconds: dict):
    """While inside, every part of ``model`` adds its seconds to ``seconds[(layer or None, part)]``:
    each part's attribute is shadowed on its owner by a timed wrapper, removed again on the way out."""
    shadowed = []

    def shadow(root, path: str, key):
        *owners, name = path.split(".")
        for owner in owners:
            root = getattr(root, owner)
        object.__setattr__(root, name, _Timed(getattr(root, name), key, seconds))
        shadowed.append((root, name))

    try:
        for path, part in MODEL_PARTS:
            shadow(model, path, (None, part))
        for i, layer in enumerate(model.layers):
            for path, part in LAYER_PARTS:
                shadow(layer, path, (i, part))
        yield seconds
    finally:
        for owner, name in shadowed:
            vars(owner).pop(name)


@dataclass
class ForwardProfile:
    name: str
    whole_s: float  # the forward with no barrier inside
    barriers_s: float  # the forward with a barrier around each part
    parts_s: dict[tuple[int | None, str], float] = field(default_factory=dict)

    @property
    def other_s(self) -> float:
        return self.barriers_s - sum(self.parts_s.values())

    def by_part(self) -> dict[str, float]:
        """Seconds by part, summed over the layers, of the parts this forward ran."""
        totals = {}
        for (_, part), s in self.parts_s.items():
            totals[part] = totals.get(part, 0.0) + s
        return {part: totals[part] for part in PARTS if part in totals}

    def layer(self, i: int) -> dict[str, float]:
        return {part: s for (layer, part), s in self.parts_s.items() if layer == i}

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "whole_s": self.whole_s,
            "barriers_s": self.barriers_s,
            "other_s": self.other_s,
            "parts_s": [{"layer": layer, "part": part, "seconds": s} for (layer, part), s in self.parts_s.items()],
        }


def profile_forward(model, name: str, run, reset, repeats: int) -> ForwardProfile:
    """``run()`` (a forward, returning its output) timed whole and by part, the best of ``repeats``
    each after a warm-up; ``reset()`` after every run puts the cache back."""

    def once(seconds: dict | None) -> float:
        start = time.perf_counter()
        if seconds is None:
            mx.eval(run())
        else:
            with parts_timed(model, seconds):
                mx.eval(run())
        elapsed = time.perf_counter() - start
        reset()
        return elapsed

    once(None)
    whole = min(once(None) for _ in range(repeats))
    best = None
    for _ in range(repeats):
        seconds = {}
        total = once(seconds)
        if best is None or total < best.barriers_s:
            best = ForwardProfile(name, whole, total, seconds)
    return best


def profiles(model, prompt: int, canvas: int, draft_length: int, repeats: int) -> list[ForwardProfile]:
    """A denoising step (self-conditioned, on a canvas view laid out once as the sampler lays it out),
    a verifying pass and an AR token, each after the same prompt."""
    vocab = model.config.vocab_size
    cache = model.make_cache()
    model.encode(mx.random.randint(3, vocab, (1, prompt), key=mx.random.key(7)), cache)
    mx.eval(cache.state())
    canvas_ids = mx.random.randint(0, vocab, (1, canvas), key=mx.random.key(8))
    view = cache.canvas_view(canvas)
    signal = model.denoise(canvas_ids, view)  # the first step's logits: what the second step is conditioned on
    mx.eval(signal)
    draft = mx.random.randint(3, vocab, (1, draft_length), key=mx.random.key(9))
    token = mx.array([[5]])
    return [
        profile_forward(
            model,
            f"denoising step of {canvas} positions",
            lambda: model.denoise(canvas_ids, view, self_conditioning=signal),
            lambda: None,
            repeats,
        ),
        profile_forward(
            model,
            f"verifying pass of {draft_length} tokens",
            lambda: model.head(model.encode(draft, cache, return_hidden=True)),
            lambda: cache.trim(draft_length),
            repeats,
        ),
        profile_forward(
            model, "AR token", lambda: model.next_token_logits(token, cache), lambda: cache.trim(1), repeats
        ),
    ]


def report(profile: ForwardProfile, layer_types: list[str]) -> list[str]:
    ms = 1e3
    lines = [
        f"{profile.name}: {profile.whole_s * ms:.2f} ms whole, {profile.barriers_s * ms:.2f} ms with a barrier "
        "around each part",
        f"  {'part':<26}{'ms':>10}{'share':>8}",
    ]
    for part, s in [*profile.by_part().items(), ("other", profile.other_s)]:
        lines.append(f"  {part:<26}{s * ms:>10.3f}{s / profile.barriers_s:>8.1%}")
    layer_parts = list(dict.fromkeys(part for _, part in LAYER_PARTS))
    heads = {"attention projections": "attn proj"}
    lines.append(
        "  by layer (ms)  " + "".join(f"{heads.get(part, part):>12}" for part in layer_parts) + f"{'layer':>12}"
    )
    for i, kind in enumerate(layer_types):
        parts = profile.layer(i)
        cells = "".join(f"{parts[part] * ms:>12.3f}" for part in layer_parts)
        lines.append(f"  {i:>3} {'full' if kind == FULL else 'sliding':<10}{cells}{sum(parts.values()) * ms:>12.3f}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_options(p)
    p.add_argument(
        "--recipe",
        choices=("none", "mixed", "uniform"),
        default="none",
        help="quantized in memory as the converter's recipe would; none: unquantized",
    )
    p.add_argument("--bits", type=int, default=4, help="the recipe's bits")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before each forward")
    p.add_argument("--canvas", type=int, default=256, help="positions of the denoising step")
    p.add_argument("--draft-length", type=int, default=32, help="tokens of the verifying pass")
    p.add_argument("--repeats", type=int, default=2, help="repeats of each forward (best is kept)")
    p.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    args = p.parse_args(argv)
    require_positive(p, args, ("prompt", "canvas", "draft_length", "repeats"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = sizes_from(args)
    quantized = "unquantized" if args.recipe == "none" else f"{args.recipe} {args.bits}-bit"
    print(f"profile_step: {describe(args)}, {quantized}; device {mx.default_device()}", flush=True)
    model, stage = full_scale.random_model(sizes, args.recipe, args.bits, args.dtype)
    print(stage.line(), flush=True)
    results = profiles(model, args.prompt, args.canvas, args.draft_length, args.repeats)
    for profile in results:
        for line in report(profile, model.config.layer_types):
            print(line, flush=True)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "shapes": describe(args),
                    "quantization": quantized,
                    "device": str(mx.default_device()),
                    "forwards": [p.to_json() for p in results],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
