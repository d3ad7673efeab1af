"""The transformers reference timed at full_scale.py's shapes, on torch's device: prefill of a prompt,
a denoising step at 16..``--canvas`` positions, an AR token and a verifying pass, in the rows and
units of full_scale.py's ``--sweep``; with ``--mlx``, the same figures of this project's model beside
them and the speed-up.

    python benchmarks/reference_speed.py [--layers 30] [--dtype bfloat16] [--device auto] [--mlx]
    python benchmarks/reference_speed.py --preset pattern --dtype float32 --canvas 16    # a quick check

Random weights at the released shapes are made in memory on the device (no checkpoint is written);
``--preset`` takes a small preset of ``checkpoint_tools.random_checkpoint`` instead.

What is timed, on the reference's side (each the best of ``--repeats`` after a warm-up):

- a denoising step is one step of the reference's own ``generate()`` loop, its ``_denoising_step``
  (decoder forward with self-conditioning, temperature, softmax, multinomial draw, entropy-bound
  acceptance, stop rule), each timed alone: the mean over a canvas of ``--steps`` steps (the stop
  rule cannot fire);
- prefill: the encoder over the prompt into an empty cache;
- an AR token: the encoder over one token after the prompt, the tied head, the soft-cap, the argmax;
- a verifying pass: the encoder over ``--draft-length`` tokens after the prompt, their next-token
  argmax on the host (verified drafting's check).

On MLX's side the figures are ``policy.measure``'s, the very ones full_scale.py's sweep prints.
"""

from __future__ import annotations

from mlx_dgemma import fast_blas

fast_blas.load()  # before mlx.core (with --mlx, MLX runs here too)

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

import full_scale  # noqa: E402
import mlx.core as mx  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from shapes import add_shape_options, describe, require_positive, sizes_from  # noqa: E402
from transformers import (  # noqa: E402
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
    DiffusionGemmaTextConfig,
    DynamicCache,
    Gemma4VisionConfig,
)
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (  # noqa: E402
    DiffusionGemmaGenerationConfig,
    EntropyBoundSamplerConfig,
)

from checkpoint_tools.random_checkpoint import SMALL_VISION  # noqa: E402
from mlx_dgemma.engine import policy  # noqa: E402

DEVICES = ("auto", "cpu", "cuda", "mps")
TOP_LEVEL = ("canvas_length", "image_token_id", "boi_token_id", "eoi_token_id")


def torch_device(name: str):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available() or name == "mps" and not torch.backends.mps.is_available():
        raise SystemExit(f"reference_speed: torch sees no {name} device; pass --device cpu or auto")
    return torch.device(name)


def reference_model(sizes: dict, dtype: str, device):
    """The reference ``DiffusionGemmaForBlockDiffusion`` at ``sizes``, random (its own init) and made on
    ``device`` in ``dtype``; the vision tower it always builds is the tiny one of the text presets."""

    text = {k: v for k, v in sizes.items() if k not in TOP_LEVEL}
    text.update(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    v = sizes["vocab_size"]  # image tokens play no part in text-only timing
    config = DiffusionGemmaConfig(
        text_config=DiffusionGemmaTextConfig(**text),
        vision_config=Gemma4VisionConfig(**SMALL_VISION),
        canvas_length=sizes["canvas_length"],
        image_token_id=v - 3,
        boi_token_id=v - 2,
        eoi_token_id=v - 1,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=getattr(torch, dtype)).eval()
    model.generation_config = DiffusionGemmaGenerationConfig(
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=1e-30,
        bos_token_id=2,
        eos_token_id=[1],
        pad_token_id=0,
    )  # the stop rule never fires
    return model


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def best_s(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (which returns its own seconds), after one to warm up."""
    fn()
    return min(fn() for _ in range(repeats))


class Reference:
    """The reference model after a prompt: its figures, timed on its device."""

    def __init__(self, model, prompt_tokens: int, device):
        self.model, self.device = model, device
        vocab = model.config.text_config.vocab_size
        self.prompt = torch.randint(3, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(7)).to(device)
        self.prompt_cache = DynamicCache(config=model.config.text_config)
        self.encode(self.prompt, self.prompt_cache)

    @torch.no_grad()
    def encode(self, ids, cache):
        """The encoder over ``ids`` after what ``cache`` holds (appended to it): the final-normed hidden states."""
        start = cache.get_seq_length()
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        return self.model.model.encoder(input_ids=ids, cache=cache, position_ids=positions).last_hidden_state

    def timed(self, fn) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        fn()
        synchronize(self.device)
        return time.perf_counter() - start

    def prefill_s(self) -> float:
        return self.timed(lambda: self.encode(self.prompt, DynamicCache(config=self.model.config.text_config)))

    def step_s(self, canvas: int, steps: int) -> float:
        """The mean seconds of the denoising steps of one ``generate()`` of a canvas of ``canvas``
        positions at ``steps`` steps, each timed on its own (the reference's ``_denoising_step``)."""
        model, seconds = self.model, []
        step = model._denoising_step

        def timed_step(*args, **kwargs):
            synchronize(self.device)
            start = time.perf_counter()
            out = step(*args, **kwargs)
            synchronize(self.device)
            seconds.append(time.perf_counter() - start)
            return out

        model.config.canvas_length = canvas
        model._denoising_step = timed_step
        try:
            model.generate(self.prompt, max_new_tokens=canvas, max_denoising_steps=steps)
        finally:
            del model._denoising_step
        if len(seconds) != steps:
            raise RuntimeError(f"reference_speed: the reference ran {len(seconds)} denoising steps of {steps}")
        return sum(seconds) / steps

    def ar_token_s(self, tokens: int) -> float:
        cache = copy.deepcopy(self.prompt_cache)
        token = self.prompt[:, -1:]
        cap = self.model.config.text_config.final_logit_softcapping

        def decode():
            nonlocal token
            for _ in range(tokens):
                logits = self.model.lm_head(self.encode(token, cache)[:, -1]).float()
                token = (cap * torch.tanh(logits / cap)).argmax(-1, keepdim=True)
                synchronize(self.device)  # as MLX's AR loop evaluates each token

        return self.timed(decode) / tokens

    def verify_s(self, length: int) -> float:
        cache = copy.deepcopy(self.prompt_cache)
        ids = torch.randint(
            3, self.model.config.text_config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length)
        ).to(self.device)
        return self.timed(lambda: self.model.lm_head(self.encode(ids, cache)).argmax(-1).tolist())

    @torch.no_grad()
    def profile(
        self, canvases: list[int], steps: int, repeats: int, ar_tokens: int, draft_lengths: list[int]
    ) -> policy.Profile:
        steps_s = {c: best_s(lambda c=c: self.step_s(c, steps), repeats) for c in canvases}
        ar = best_s(lambda: self.ar_token_s(ar_tokens), repeats)
        prefill = best_s(self.prefill_s, repeats)
        verify = {n: best_s(lambda n=n: self.verify_s(n), repeats) for n in draft_lengths}
        dtype = str(self.model.dtype).removeprefix("torch.")
        return policy.Profile(
            f"torch {self.device}",
            "measured",
            steps_s,
            ar,
            self.prompt.shape[1] / prefill,
            dtype,
            verify,
            self.prompt.shape[1],
        )


def rows(profile: policy.Profile, canvases: list[int], length: int) -> list[tuple[str, float, str, float | None]]:
    """(label, figure, unit, seconds) of each row of full_scale.py's sweep: the seconds of the work the
    row is about (two profiles compare by their ratio), None for the crossover (a ratio itself)."""
    out = [
        ("AR", profile.ar_tok_s, "tok/s", profile.ar_token_s),
        ("prefill", profile.prefill_tok_s, "tok/s", profile.prefix / profile.prefill_tok_s),
    ]
    out += [(f"step at {c}", profile.step_s(c) * 1e3, "ms", profile.step_s(c)) for c in canvases]
    out.append((f"crossover at {canvases[-1]}", profile.crossover_steps(canvases[-1]), "steps", None))
    round_s = profile.step_s(length) + profile.verify_s(length)
    out.append((f"round of {length}, 1 step", round_s * 1e3, "ms", round_s))
    return out


def table(reference: policy.Profile, mlx: policy.Profile | None, canvases: list[int], length: int) -> list[str]:
    """The reference's rows; with ``mlx``, MLX's beside them and MLX's speed-up (reference seconds /
    MLX seconds: above 1, MLX is faster)."""
    head = f"{'':<18}{'reference':>12}" + (f"{'MLX':>16}{'MLX speed-up':>16}" if mlx else "")
    lines = [
        f"reference: {reference.device}, {reference.dtype}" + (f"; MLX: {mlx.device}, {mlx.dtype}" if mlx else ""),
        head,
    ]
    theirs = rows(mlx, canvases, length) if mlx else None
    for i, (label, figure, unit, seconds) in enumerate(rows(reference, canvases, length)):
        text = f"{label:<18}{figure:>9.2f} {unit:<5}"
        if theirs:
            _, mlx_figure, _, mlx_seconds = theirs[i]
            text += f"{mlx_figure:>10.2f} {unit:<5}" + (f"{seconds / mlx_seconds:>10.2f}x" if seconds else "")
        lines.append(text)
    return lines


def measure_mlx(sizes: dict, args: argparse.Namespace, canvases: list[int]) -> policy.Profile:
    """``policy.measure`` (full_scale.py's sweep) of the model made in memory at the same shapes and
    dtype, unquantized; the model is freed before the reference is made."""
    model, stage = full_scale.random_model(sizes, "none", 4, args.dtype)
    print(stage.line(), flush=True)
    profile = policy.measure(
        model,
        prefix=args.prompt,
        canvases=canvases,
        repeats=args.repeats,
        ar_tokens=args.ar_tokens,
        steps=args.steps,
        draft_lengths=[args.draft_length],
    )
    del model
    gc.collect()
    mx.clear_cache()
    return profile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_options(p)
    p.add_argument("--device", choices=DEVICES, default="auto", help="torch's device (auto: cuda, mps or cpu)")
    p.add_argument("--prompt", type=int, default=46, help="prompt tokens before each run")
    p.add_argument("--ar-tokens", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="denoising steps each step time is the mean of")
    p.add_argument("--canvas", type=int, default=256, help="the longest canvas of the sweep (16..256)")
    p.add_argument("--draft-length", type=int, default=32, help="positions of the verifying pass")
    p.add_argument("--repeats", type=int, default=2, help="repeats of each figure (best is kept)")
    p.add_argument("--mlx", action="store_true", help="also this project's model at the same shapes, and the ratio")
    args = p.parse_args(argv)
    if not 1 <= args.canvas <= 256 or not 1 <= args.draft_length <= args.canvas:
        p.error(f"--canvas must be 1..256 and --draft-length 1..--canvas, got {args.canvas} and {args.draft_length}")
    require_positive(p, args, ("prompt", "ar_tokens", "steps", "repeats"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = sizes_from(args)
    canvases = [c for c in policy.CANVAS_LENGTHS if c <= args.canvas] or [args.canvas]
    device = torch_device(args.device)
    print(
        f"reference_speed: {describe(args)}; torch {torch.__version__} on {device}, transformers "
        f"{transformers.__version__}, {torch.get_num_threads()} CPU threads",
        flush=True,
    )
    mlx = measure_mlx(sizes, args, canvases) if args.mlx else None
    start = time.perf_counter()
    model = reference_model(sizes, args.dtype, device)
    synchronize(device)
    print(f"reference made   {time.perf_counter() - start:8.1f} s", flush=True)
    reference = Reference(model, args.prompt, device).profile(
        canvases, args.steps, args.repeats, args.ar_tokens, [args.draft_length]
    )
    for line in table(reference, mlx, canvases, args.draft_length):
        print(line, flush=True)


if __name__ == "__main__":
    main()
