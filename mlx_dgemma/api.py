"""The Python API, shaped like mlx-lm's: ``generate``, ``stream_generate(model, tokenizer, prompt,
**kwargs)``, ``infill`` and ``drafted_json_template``. A request is checked and settled once
(request.prepare, from one ``options.GenerationArgs``), then runs as a batch of one through the
engine (batch.py), which block-autoregressively encodes the prompt, denoises a canvas, commits and
encodes it and goes on to the next, as the reference ``generate()`` does (or decodes
autoregressively or verified, per the plan). ``mlx_dgemma.generate`` holds the command line and
re-exports these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .engine.batch import BatchGenerator
from .engine.policy import Plan
from .engine.request import PreparedRequest, generation_device, prepare
from .engine.sampler import Draft
from .engine.scoring import Scorer, TokenLogprob
from .errors import OptionError
from .options import GenerationArgs
from .structured.layout import drafted_layout
from .structured.template import CanvasTemplate
from .tokenizer import Tokenizer
from .validate import check_text

if TYPE_CHECKING:
    from .model.diffusion_gemma import DiffusionGemma


@dataclass
class GenerationResponse:
    """One commit of the answer: a denoised canvas, a block of autoregressive tokens (a canvas's worth,
    or what auto chose) or a verified round, with all its ``tokens``. mlx-lm yields one response per
    token; its per-token fields are here per commit: ``token`` is the commit's last id, ``logprobs``
    each of its tokens' log-probability (with ``logprobs=N``), and ``from_draft`` says the tokens come
    from a verified round (the decoder's draft, checked by the encoder)."""

    text: str  # the text this commit adds to the answer
    tokens: list[int]  # the commit's ids, up to and including a stop id, within max_tokens
    steps: int  # forwards this commit took (denoising steps; draft steps and the verifying pass)
    tokens_per_forward: float  # non-pad tokens committed so far per denoising forward (whole canvases)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # committed so far
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None  # "stop" (a stop id), "length" (max tokens), None while more follow
    drafts: list[Draft] | None = None  # per-step argmax drafts, when asked for
    plan: Plan | None = None  # how this commit was run (policy's choice and reasons)
    thought: str = ""  # the text this commit adds to the thought (with think=True; never part of text)
    # With logprobs=N: each of ``tokens``' log-probability under the encoder given everything before
    # it, and the N most likely tokens at its place (engine/scoring.py says what they mean per policy).
    logprobs: list[TokenLogprob] | None = None

    @property
    def token(self) -> int | None:
        """The commit's last id (mlx-lm's ``token``: the one just generated)."""
        return self.tokens[-1] if self.tokens else None

    @property
    def from_draft(self) -> bool:
        """Whether the commit is a verified round's: drafted by the decoder, accepted by the encoder."""
        return self.plan is not None and self.plan.mode == "verified"


@dataclass
class BatchStats:
    """A batch's figures, as mlx-lm's ``batch_generate`` reports them."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0  # seconds encoding the prompts
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0  # seconds generating after them
    generation_tps: float = 0.0
    peak_memory: float = 0.0  # GB


@dataclass
class BatchResponse:
    """``batch_generate``'s answers, one per prompt in order, and the batch's figures."""

    texts: list[str]
    stats: BatchStats


def stream_generate(
    model: DiffusionGemma, tokenizer: Tokenizer, prompt: str | list[int], max_tokens: int | None = None, **kwargs: Any
) -> Iterator[GenerationResponse]:
    """Yield one ``GenerationResponse`` per committed canvas, block of autoregressive tokens (a
    canvas's worth, or what auto chose) or verified round.

    ``prompt`` is text (the chat template is applied unless ``chat_template=False``) or token ids.
    ``kwargs`` are the fields of ``options.GenerationArgs`` and of its ``SamplingArgs``. Unset numbers
    come from the checkpoint's generation config; ``max_tokens`` is computed in whole canvases, as
    the reference does, and the text and tokens handed out stop at it. ``rng`` replaces the seeded
    ``mx.random`` draws; ``settings`` replaces the sampler settings built from the rest.
    ``drafts=True`` attaches each step's argmax canvas to the responses; ``on_step`` is called with it
    as soon as the step is done.

    ``policy`` picks how to generate (policy.py): "reference" (the generation config, exactly),
    "auto" (whichever of the others this device's ``profile`` — measured once and cached when not
    given — and what the model did so far predict fastest, re-chosen at every canvas or round;
    ``expected_steps`` per canvas replaces its prior and its memory of earlier generations), "fast" (active-set
    compaction, no confirming step, a trimmed last canvas), "ar" or "verified" (drafting.py: the
    decoder drafts ``draft_length`` tokens in ``draft_steps`` steps, the encoder verifies them; one
    response per round). Explicit sampler numbers override the plan; ``freeze_after`` is the
    compaction's (sampler.SamplerSettings). ``temperature`` is the sampling temperature under every
    policy (options.SamplingArgs): ar and verified draw tokens at it (default 0, greedy; verified output
    has the ar distribution exactly), the diffusion policies draw each position at it times the
    schedule's temperature (default 1, the checkpoint's sampling); ``top_p``, ``top_k`` and ``min_p``
    filter every draw, ``schedule_scale`` scales the denoising schedule, and the repetition, presence
    and frequency penalties apply under ar.

    ``template`` lays the answer out in advance (template.py): text with ``{{fill:N}}`` holes, or a
    ``CanvasTemplate`` (``json_template(tokenizer, schema)``, ``infill_template``). Its literal
    tokens are clamped, the answer ends with it, and ``max_tokens`` is ignored; the text arrives
    whole with the last response (a hole's value is known only when its canvas commits).
    ``schema`` (a JSON schema) gets an answer that validates: under reference, fast and auto, where
    the schema's canvas template takes it, a free draft first and then the template with its holes
    sized by the draft's values (nothing of the draft is handed out); otherwise its grammar, token by
    token (structured/layout.py decides which, for every front door).

    ``think`` switches thinking on: the chat template's own switch (Gemma 4's ``enable_thinking``)
    renders the prompt, and each response's ``thought`` is what the answer's thought channel
    (``<|channel>thought`` … ``<channel|>``) adds, never part of ``text``; without it no thought is
    handed out. Token ids or an untemplated prompt are taken as given. A text template is the whole
    answer: its thought is what its own thought channel holds; a JSON one has none and is refused with it.

    ``images`` (paths or PIL images; a checkpoint with a vision tower) go with the prompt: a text
    prompt gets one image placeholder per image before the text; ids or an untemplated prompt must
    hold them (the image token, ``<|image|>``) themselves. ``videos`` (paths, or lists of PIL frames)
    likewise, after the images, with ``<|video|>``: each clip's sampled frames (``video_fps`` per
    second, or evenly) go in as images with their ``mm:ss`` times (docs/vision.md).

    ``prompt_cache`` (``model.make_cache()``) may already hold the prompt's first ``offset`` ids, images
    placed (a server's prompt cache): only the rest is encoded, and the answer is appended to it.

    ``kv_bits`` (8 or 4) stores the KV cache quantized in groups of ``kv_group_size`` once it holds
    more than ``quantized_kv_start`` positions, as mlx-lm does (cache.py; a ``prompt_cache`` keeps the
    setting it was made with: ``model.make_cache(None, GenerationArgs(kv_bits=...).kv_quantization)``).
    """
    yield from stream_from_args(model, tokenizer, prompt, GenerationArgs.of(max_tokens=max_tokens, **kwargs))


def stream_from_args(
    model, tokenizer: Tokenizer, prompt: str | list[int], args: GenerationArgs
) -> Iterator[GenerationResponse]:
    """``stream_generate`` with its options as one ``GenerationArgs`` (the command line's)."""
    if args.prompt_cache is not None and (args.images or args.videos):
        raise OptionError("give the images and videos or a prompt cache that already holds them, not both")
    job = prepare(model, tokenizer, prompt, args)
    scorer = Scorer(model, args.logprobs, args.prefill_step_size) if args.logprobs is not None else None
    engine = BatchGenerator(model, tokenizer, args.prefill_step_size, args.kv_quantization)
    drafts = [] if args.drafts else None
    engine.insert(job, args.prompt_cache, on_step=_step_hook(drafts, args.on_step))
    with generation_device(model):
        cached, tic = args.prompt_cache.offset if args.prompt_cache is not None else 0, time.perf_counter()
        engine.admit()
        prompt_tps = (len(job.ids) - cached) / (time.perf_counter() - tic)
        if scorer is not None:
            scorer.add(job.ids, **job.vision_inputs)
        yield from _responses(engine, job, prompt_tps, drafts, scorer)


def _responses(
    engine, job: PreparedRequest, prompt_tps: float, drafts: list | None, scorer: Scorer | None
) -> Iterator[GenerationResponse]:
    """The engine's commits for its one row, autoregressive tokens gathered into their blocks."""
    tic, forwards, generated, non_pad = time.perf_counter(), 0, 0, 0
    text, thought, tokens, steps = "", "", [], 0
    while len(engine):
        for r in engine.next():
            if r.error is not None:
                raise r.error
            text, tokens, steps = text + r.text, tokens + r.tokens, steps + r.steps
            if job.thought is not None:
                thought += job.thought.add(r.tokens, final=r.finish_reason is not None)
            non_pad += r.non_pad
            if not r.ends_block:
                continue
            forwards += steps
            generated += len(tokens)
            yield GenerationResponse(
                text,
                tokens,
                steps,
                non_pad / forwards,
                len(job.ids),
                prompt_tps,
                generated,
                generated / (time.perf_counter() - tic),
                mx.get_peak_memory() / 1e9,
                r.finish_reason,
                drafts[:] if drafts and r.plan.mode == "diffusion" else None,
                r.plan,
                thought,
                scorer.add(tokens) if scorer is not None else None,
            )
            text, thought, tokens, steps = "", "", [], 0
            if drafts is not None:
                drafts.clear()


def _step_hook(collected: list[Draft] | None, on_step: Callable[[Draft], None] | None):
    if collected is None:
        return on_step

    def hook(draft: Draft) -> None:
        collected.append(draft)
        if on_step is not None:
            on_step(draft)

    return hook


def generate(
    model: DiffusionGemma,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    verbose: bool = False,
    *,
    max_tokens: int | None = None,
    **kwargs: Any,
) -> str:
    """The whole answer as text; ``kwargs`` are those of ``stream_generate``. ``verbose`` (the fourth
    argument, as mlx-lm's) prints the text as it commits, then the statistics."""
    if not isinstance(verbose, bool):  # generate(m, t, p, 64): an older call's max_tokens
        raise TypeError(
            f"generate's fourth argument is verbose (True or False), as mlx-lm's; pass max_tokens={verbose!r}"
        )
    text, responses = "", []
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
        responses.append(response)
    if verbose:
        print("\n" + statistics(responses))
    return text


def batch_generate(
    model: DiffusionGemma,
    tokenizer: Tokenizer,
    prompts: list[str | list[int]],
    max_tokens: int | list[int | None] | None = None,
    *,
    seeds: list[int | None] | None = None,
    **kwargs: Any,
) -> BatchResponse:
    """The answers to ``prompts`` generated together; ``texts[i]`` equals
    ``generate(model, tokenizer, prompts[i], max_tokens=max_tokens[i], seed=seeds[i], **kwargs)``
    (``max_tokens``: one for all or one per prompt; ``kwargs``: those of ``stream_generate``)."""
    count = len(prompts)
    budgets = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * count
    seeds = list(seeds) if seeds is not None else [None] * count
    for name, values in (("max_tokens", budgets), ("seeds", seeds)):
        if len(values) != count:
            raise OptionError(f"{count} prompts but {len(values)} {name}; give one per prompt")
    if not count:
        return BatchResponse([], BatchStats())
    args = [GenerationArgs.of(max_tokens=m, seed=s, **kwargs) for m, s in zip(budgets, seeds)]
    engine = BatchGenerator(model, tokenizer, args[0].prefill_step_size, args[0].kv_quantization)
    jobs = [prepare(model, tokenizer, p, a) for p, a in zip(prompts, args)]
    uids = [engine.insert(job) for job in jobs]
    texts, generated = dict.fromkeys(uids, ""), 0
    with generation_device(model):
        tic = time.perf_counter()
        engine.admit()
        prompt_time = time.perf_counter() - tic
        while len(engine):
            for response in engine.next():
                if response.error is not None:
                    raise response.error
                texts[response.uid] += response.text
                generated += len(response.tokens)
        generation_time = time.perf_counter() - tic - prompt_time
    prompt_tokens = sum(len(job.ids) for job in jobs)
    stats = BatchStats(
        prompt_tokens,
        prompt_time,
        prompt_tokens / prompt_time,
        generated,
        generation_time,
        generated / generation_time if generation_time else 0.0,
        mx.get_peak_memory() / 1e9,
    )
    return BatchResponse([texts[uid] for uid in uids], stats)


def statistics(responses: list[GenerationResponse]) -> str:
    last = responses[-1]
    verified = all(r.plan is not None and r.plan.mode == "verified" for r in responses)
    unit, forwards = (
        ("rounds", "Forwards per round (draft steps + the verifying pass)")
        if verified
        else ("canvases", "Denoising steps per canvas")
    )
    extra = f", {last.generation_tokens / len(responses):.2f} tokens per round" if verified else ""
    return "\n".join(
        [
            "=" * 10,
            f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec",
            f"Generation: {last.generation_tokens} tokens in {len(responses)} {unit}, "
            f"{last.generation_tps:.3f} tokens-per-sec",
            f"{forwards}: {' '.join(str(r.steps) for r in responses)}; "
            f"{last.tokens_per_forward:.2f} tokens per forward{extra}",
            f"Finish: {last.finish_reason}",
            f"Peak memory: {last.peak_memory:.3f} GB",
        ]
    )


def infill(
    model: DiffusionGemma, tokenizer: Tokenizer, prefix: str | list[int], suffix: str, max_fill: int = 64, **kwargs: Any
) -> str:
    """The text between ``prefix`` and ``suffix``. The prefix (text as it is, no chat template, or
    ids) goes to the encoder cache; the suffix is clamped at the end of the canvas, after a hole of at
    least ``max_fill`` tokens that may take several canvases. ``kwargs`` are those of ``stream_generate``."""
    from .structured.template import infill_template

    template = infill_template(
        tokenizer, suffix, max_fill, model.config.canvas_length, model.config.max_position_embeddings
    )
    kwargs.setdefault("chat_template", False)
    if isinstance(prefix, str) and not kwargs["chat_template"]:  # an empty or blank prefix is a fine start
        prefix = tokenizer.encode(check_text(prefix, "the prefix"))
    responses = list(stream_generate(model, tokenizer, prefix, template=template, **kwargs))
    answer = responses[-1].text
    tail = tokenizer.decode(template.tokens[template.holes[0][1].size :])
    return answer[: len(answer) - len(tail)] if tail and answer.endswith(tail) else answer


def drafted_json_template(
    model, tokenizer: Tokenizer, prompt: str | list[int], schema: dict, args: GenerationArgs | None = None, **kwargs
) -> CanvasTemplate:
    """The JSON template of ``schema`` with its holes sized by a free generation's values (one more
    generation, with ``args`` or ``kwargs``: those of ``stream_generate``): what ``schema=`` does
    under a diffusion policy before it generates the answer (structured/layout.py)."""
    layout = drafted_layout(tokenizer, schema, model.config.max_position_embeddings)  # a bad schema fails first
    args = args or GenerationArgs.of(**kwargs)
    free = "".join(response.text for response in stream_from_args(model, tokenizer, prompt, args))
    return layout.sized(free).template
