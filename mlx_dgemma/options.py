"""A generation's options, written once: ``GenerationArgs`` (what to generate and how) with its
sampler-settings part ``SamplingArgs`` (as mlx-lm's ``SamplingArguments``). The API's keyword
arguments (``stream_generate(model, tokenizer, prompt, **kwargs)``), the CLI's flags and the
server's requests all become one, which ``request.prepare`` checks and settles before any forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from .errors import OptionError
from .validate import finite_number, integer_in

PREFILL_STEP_SIZE = 2048  # mlx-lm's default: prompt tokens encoded per forward
MAX_PREFILL_STEP_SIZE = 1 << 20  # past any context: a step this long is the whole prompt in one forward
check_prefill_step_size = integer_in(1, MAX_PREFILL_STEP_SIZE)
KV_BITS = (4, 8)  # the widths a KV cache quantizes to (cache.py)
KV_GROUP_SIZES = (32, 64, 128)  # mx.quantize's group sizes
KV_GROUP_SIZE = 64  # mlx-lm's defaults (--kv-group-size, --quantized-kv-start)
QUANTIZED_KV_START = 5000
check_schedule_scale = finite_number(0, low_open=True)


@dataclass(frozen=True)
class KVQuantization:
    """A KV cache stored at ``bits`` per element, affine in groups of ``group_size`` along the head
    dimension, once it holds more than ``start`` positions (mlx-lm's ``--kv-bits``,
    ``--kv-group-size``, ``--quantized-kv-start``)."""

    bits: int
    group_size: int = KV_GROUP_SIZE
    start: int = QUANTIZED_KV_START

    def check(self, head_dims: list[int]) -> None:
        """An OptionError naming the option that is wrong for a model of these per-layer head dims."""
        if self.bits not in KV_BITS:
            raise OptionError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, not {self.bits!r}", "kv_bits")
        if self.group_size not in KV_GROUP_SIZES:
            raise OptionError(
                f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, not {self.group_size!r}",
                "kv_group_size",
            )
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise OptionError(
                f"quantized_kv_start must be a whole number of tokens >= 0, not {self.start!r}", "quantized_kv_start"
            )
        if bad := [d for d in head_dims if d % self.group_size]:
            fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in head_dims)]
            raise OptionError(
                f"kv_group_size {self.group_size} does not divide this model's head dim {bad[0]}; "
                f"take {' or '.join(map(str, fits)) or 'no KV quantization'}",
                "kv_group_size",
            )


@dataclass(frozen=True)
class SamplingArgs:
    """How tokens are chosen (None: the plan's, or off). ``settings`` (a ``sampler.SamplerSettings``)
    replaces the plan's sampler settings as a whole, and the numbers go on top of it.

    ``temperature`` is the sampling temperature under every policy (docs/policies.md): autoregressive
    and verified tokens are drawn from softmax(logits / temperature) (None or 0: greedy); a denoising
    step draws each position at ``temperature`` times the step's temperature of the schedule (None or
    1: the schedule's own, the reference; 0: greedy draws). ``top_p``, ``top_k`` and ``min_p`` filter
    every draw (filters.sampling_probs). The schedule itself (from ``temp_max`` at the first step to
    ``temp_min`` at the last, which also tempers what the denoiser sees of its previous step) is
    scaled by ``schedule_scale``."""

    steps: int | None = None
    entropy_bound: float | None = None
    temp_min: float | None = None
    temp_max: float | None = None
    freeze_after: int | None = None  # active-set compaction (sampler.SamplerSettings)
    settings: object = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    schedule_scale: float | None = None
    repetition_penalty: float | None = None  # the penalties: ar only (filters.penalized)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def overrides(self, defaults) -> dict:
        """``SamplerSettings`` field -> value for every setting the caller gave (``defaults``: the
        checkpoint's generation config, whose schedule ``schedule_scale`` scales when
        ``temp_min``/``temp_max`` or ``settings`` do not give it)."""
        given = {f.name: getattr(self.settings, f.name) for f in fields(self.settings)} if self.settings else {}
        numbers = dict(
            steps=self.steps,
            entropy_bound=self.entropy_bound,
            t_min=self.temp_min,
            t_max=self.temp_max,
            freeze_after=self.freeze_after,
            draw_temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        given.update({k: v for k, v in numbers.items() if v is not None})
        if self.schedule_scale is not None:
            check_schedule_scale(self.schedule_scale, "schedule_scale")
            for name in ("t_min", "t_max"):
                given[name] = given.get(name, getattr(defaults, name)) * self.schedule_scale
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
    schema: object = None  # a JSON schema the answer validates against ({}: any JSON value) or its grammar.Grammar
    images: list | None = None  # paths or PIL images, or an images.ImageInputs
    videos: list | None = None  # paths, encoded bytes or lists of PIL frames (video.load_video)
    video_fps: float | None = None  # frames sampled per second (None: the checkpoint's, or evenly)
    draft_length: int | None = None
    draft_steps: int | None = None
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    prefill_step_size: int = PREFILL_STEP_SIZE
    prompt_cache: object = None  # a one-row cache holding the prompt's first ids
    kv_bits: int | None = None  # a quantized KV cache (KVQuantization); None: the activations' dtype
    kv_group_size: int = KV_GROUP_SIZE
    quantized_kv_start: int = QUANTIZED_KV_START
    drafts: bool = False
    on_step: Callable | None = None
    logprobs: int | None = None  # each response's tokens' log-probabilities, with this many most likely (api)

    @property
    def kv_quantization(self) -> KVQuantization | None:
        return (
            None if self.kv_bits is None else KVQuantization(self.kv_bits, self.kv_group_size, self.quantized_kv_start)
        )

    @classmethod
    def of(cls, **kwargs) -> GenerationArgs:
        """From the API's keyword arguments: the sampler's go to ``sampling``; a name that is neither's
        is a TypeError naming it."""
        sampling_names = {f.name for f in fields(SamplingArgs)}
        own = {f.name for f in fields(cls)} - {"sampling"}
        if unknown := sorted(set(kwargs) - sampling_names - own):
            raise TypeError(
                f"unexpected keyword argument {unknown[0]!r}; the options are {', '.join(sorted(own | sampling_names))}"
            )
        sampling = SamplingArgs(**{k: v for k, v in kwargs.items() if k in sampling_names})
        return cls(sampling=sampling, **{k: v for k, v in kwargs.items() if k in own})
