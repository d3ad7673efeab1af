"""A request's generation options: the body fields that are ``options.GenerationArgs`` or
``SamplingArgs`` fields of the same name (OpenAI's ``temperature``, ``top_p`` and ``seed``, vLLM's
``top_k`` and ``min_p``, and this runtime's own, sent as the ``openai`` client's ``extra_body``), each
checked here so that a bad value is a 400 naming its field before the worker sees it. Every other
option is set by the request otherwise (``SET_OTHERWISE``) or is not the client's to set
(``NOT_SETTABLE``, with the reason).
"""

from __future__ import annotations

from ..engine.policy import POLICIES
from ..engine.sampler import SamplerSettings
from ..options import SamplingArgs, check_schedule_scale
from ..validate import (
    MIN_TEMPERATURE,
    at_least,
    check_entropy_bound,
    check_min_p,
    check_penalty,
    check_repetition_penalty,
    check_seed,
    check_steps,
    check_temperature,
    check_top_k,
    check_top_p,
    finite_number,
    integer_in,
    is_number,
    shown,
)
from .api import BadRequest

MAX_TEMPERATURE = 2  # OpenAI's
# The body fields read as the options of the same name (every API passes them on as they come).
SETTINGS = (
    "seed",
    "policy",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "steps",
    "entropy_bound",
    "temp_min",
    "temp_max",
    "schedule_scale",
    "freeze_after",
    "draft_length",
    "draft_steps",
    "expected_steps",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
PENALTIES = {"repetition_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0}  # each with its value that is off

SET_OTHERWISE = {
    "max_tokens": "max_tokens (max_completion_tokens, max_output_tokens, num_predict), fitted to the context",
    "template": "template, response_format, a forced tool call or suffix",
    "images": "the messages' image parts",
    "videos": "the messages' video_url parts",
    "schema": "response_format (Ollama's format, Responses' text.format) or a forced tool call",
    "think": "reasoning_effort or reasoning (Anthropic's thinking, Ollama's think)",
    "logprobs": "logprobs and top_logprobs, scored by the worker beside the answer (scheduler.py)",
}
NOT_SETTABLE = {
    "rng": "a Python object; seed sets the draws",
    "settings": "a Python object; the numbers set it",
    "system_prompt": "the server renders the chat template itself: send a system message",
    "chat_template": "the server renders the chat template for chat, and takes a completions prompt as it is",
    "profile": "the device's, measured once per model by the server",
    "prefill_step_size": "the server's (--prefill-step-size), shared by the requests it batches",
    "kv_bits": "the server's (--kv-bits), the width of the caches it keeps for every request",
    "kv_group_size": "the server's (--kv-group-size), with --kv-bits",
    "quantized_kv_start": "the server's (--quantized-kv-start), with --kv-bits",
    "prompt_cache": "the server's own, shared by its requests",
    "drafts": "each step's canvas, for a live view: no API carries it",
    "on_step": "a Python callback",
    "video_fps": "the checkpoint's video settings (its frame limit, and its rate where it has one) sample every video",
}


def _checks(defaults, canvas: int, max_steps: int) -> dict:
    """Body field -> its check (value, name); ``max_steps`` bounds steps and draft steps."""
    steps = defaults.max_denoising_steps

    def temperature(value, name):  # (validate.check_temperature's bounds, OpenAI's top)
        if not (is_number(value) and (value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE)):
            raise ValueError(
                f"{name} must be 0 or a finite number from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE}, got {shown(value)}"
            )

    def policy(value, name):
        if not isinstance(value, str) or value not in POLICIES:
            raise ValueError(f"{name} must be one of {', '.join(POLICIES)}, got {shown(value)}")

    def draft_length(value, name):
        at_least(1)(value, name)
        if value > canvas:
            raise ValueError(
                f"{name} must be an integer from 1 to the model's canvas length {canvas}, got {shown(value)}"
            )

    return {
        "seed": check_seed,
        "policy": policy,
        "temperature": temperature,
        "top_p": check_top_p,
        "top_k": check_top_k,
        "min_p": check_min_p,
        "steps": lambda value, name: check_steps(value, name, max_steps),
        "entropy_bound": check_entropy_bound,
        "temp_min": check_temperature,
        "temp_max": check_temperature,
        "schedule_scale": check_schedule_scale,
        "freeze_after": lambda value, name: integer_in(0, max_steps)(value, name),
        "draft_length": draft_length,
        "draft_steps": lambda value, name: check_steps(value, name, max_steps),
        "expected_steps": finite_number(1, max(steps, max_steps), high_open=False),
        "repetition_penalty": check_repetition_penalty,
        "presence_penalty": check_penalty,
        "frequency_penalty": check_penalty,
    }


def request_options(body: dict, defaults, canvas: int, max_steps: int) -> dict:
    """The options ``body`` sets (``GenerationArgs.of``'s keywords), each checked; a bad one is a
    ``BadRequest`` naming it. ``defaults``: the checkpoint's generation config; ``canvas``: its length;
    ``max_steps``: the server's bound on steps."""
    options, checks = {}, _checks(defaults, canvas, max_steps)
    for name in SETTINGS:
        value, check = body.get(name), checks[name]
        if value is None:
            continue
        try:
            check(value, name)
        except ValueError as e:
            raise BadRequest(str(e), param=name) from None
        options[name] = value
    for name, off in PENALTIES.items():
        if options.get(name, off) != off and options.get("policy") != "ar":
            raise BadRequest(
                f'{name} applies to autoregressive decoding only: send policy "ar" with it, or '
                f"leave it out or send {off}",
                param=name,
            )
    schedule = [name for name in ("temp_min", "temp_max", "schedule_scale") if name in options]
    if schedule:  # the schedule they make together (temp_min below temp_max)
        sampling = SamplingArgs(**{name: options[name] for name in schedule})
        try:
            SamplerSettings.from_generation_config(defaults, **sampling.overrides(defaults))
        except ValueError as e:  # (its message names the CLI's flags and the scaled temperatures)
            given = ", ".join(f"{name} {shown(options[name])}" for name in schedule)
            raise BadRequest(
                f"{given}: the temperature schedule they make cannot be used ({e})", param=schedule[0]
            ) from None
    return options
