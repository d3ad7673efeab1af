"""A generation's options, written once: ``GenerationArgs`` (what to generate and how) with its
sampler-settings part ``SamplingArgs`` (as mlx-lm's ``SamplingArguments``). The API's keyword
arguments (``stream_generate(model, tokenizer, prompt, **kwargs)``), the CLI's flags and the
server's requests all become one, which ``request.prepare`` checks and settles before any forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

PREFILL_STEP_SIZE = 2048  # mlx-lm's default: prompt tokens encoded per forward


@dataclass(frozen=True)
class SamplingArgs:
    """How tokens are chosen. The denoising numbers (None: the plan's) replace the plan's sampler
    settings, ``settings`` (a ``sampler.SamplerSettings``) as a whole and the numbers on top of it;
    ``temperature`` samples autoregressive and verified decoding (None or 0: greedy)."""

    steps: int | None = None
    entropy_bound: float | None = None
    temp_min: float | None = None
    temp_max: float | None = None
    freeze_after: int | None = None  # active-set compaction (sampler.SamplerSettings)
    settings: object = None
    temperature: float | None = None

    def overrides(self) -> dict:
        """``SamplerSettings`` field -> value for every setting the caller gave."""
        given = {f.name: getattr(self.settings, f.name) for f in fields(self.settings)} if self.settings else {}
        numbers = dict(steps=self.steps, entropy_bound=self.entropy_bound, t_min=self.temp_min, t_max=self.temp_max,
                       freeze_after=self.freeze_after)
        given.update({k: v for k, v in numbers.items() if v is not None})
        return given


@dataclass(frozen=True)
class GenerationArgs:
    """Everything about one generation but the model, the tokenizer and the prompt (see
    ``api.stream_generate`` for what each does)."""

    max_tokens: int | None = None
    seed: int | None = None
    rng: object = None  # a sampler.Random in place of the seeded draws
    system_prompt: str | None = None
    chat_template: bool = True
    think: bool = False  # thinking on: the chat template's switch, and the thought handed out apart
    policy: str = "reference"
    profile: object = None  # policy.Profile
    expected_steps: float | None = None
    template: object = None  # text with {{fill:N}} holes or a template.CanvasTemplate
    schema: object = None  # a JSON schema the answer validates against ({}: any JSON value); see grammar.py
    images: list | None = None
    draft_length: int | None = None
    draft_steps: int | None = None
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    prefill_step_size: int = PREFILL_STEP_SIZE
    prompt_cache: object = None  # a one-row cache holding the prompt's first ids
    drafts: bool = False
    on_step: Callable | None = None

    @classmethod
    def of(cls, **kwargs) -> GenerationArgs:
        """From the API's keyword arguments: the sampler's go to ``sampling``; a name that is neither's
        is a TypeError naming it."""
        sampling_names = {f.name for f in fields(SamplingArgs)}
        own = {f.name for f in fields(cls)} - {"sampling"}
        if unknown := sorted(set(kwargs) - sampling_names - own):
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the options are "
                            f"{', '.join(sorted(own | sampling_names))}")
        sampling = SamplingArgs(**{k: v for k, v in kwargs.items() if k in sampling_names})
        return cls(sampling=sampling, **{k: v for k, v in kwargs.items() if k in own})

    def kwargs(self) -> dict:
        """The options as the API's keyword arguments (``of``'s inverse)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sampling"}
        out.update((f.name, getattr(self.sampling, f.name)) for f in fields(self.sampling))
        return out
