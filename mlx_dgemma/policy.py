"""Hardware-aware step policy: what a denoising step and an autoregressive token cost on a device
(measured here, or predicted by a roofline model for known devices) and the generation plan that
follows from it.

A denoising step runs the whole canvas (C tokens) through every layer plus two vocabulary-wide
products (head and self-conditioning), so at C = 256 it is compute-bound; an autoregressive token is
one position, bandwidth-bound. Whether diffusion wins depends on the device's FLOP/s per byte/s and
on how many steps a canvas takes: the crossover is ``256 · t_token / t_step(256)`` steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from .config import FULL, GenerationConfig, ModelConfig

CANVAS_LENGTHS = (16, 32, 64, 128, 256)
POLICIES = ("reference", "auto", "fast", "ar")


@dataclass(frozen=True)
class Device:
    name: str
    tflops: float  # dense fp16/bf16 matmul peak, TFLOP/s
    bandwidth: float  # memory bandwidth, GB/s
    vendor: str  # "apple" | "nvidia"
    memory_gb: float = 0.0


# Public spec-sheet figures (GPU FP16 for Apple, dense tensor-core BF16/FP16 for NVIDIA). Apple GPUs
# run FP16 at the FP32 rate before M5; M5's per-core neural accelerators raise matmul throughput
# (Apple quotes "over 4x" peak GPU AI compute over M4); M5 Pro/Max figures are scaled from M5.
KNOWN_DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("M1", 2.6, 68, "apple"),
        Device("M1 Pro", 5.2, 200, "apple"),
        Device("M1 Max", 10.4, 400, "apple"),
        Device("M1 Ultra", 20.8, 800, "apple"),
        Device("M2", 3.6, 100, "apple"),
        Device("M2 Pro", 6.8, 200, "apple"),
        Device("M2 Max", 13.6, 400, "apple"),
        Device("M2 Ultra", 27.2, 800, "apple"),
        Device("M3", 4.1, 100, "apple"),
        Device("M3 Pro", 7.4, 150, "apple"),
        Device("M3 Max", 16.4, 400, "apple"),
        Device("M3 Ultra", 32.8, 819, "apple"),
        Device("M4", 4.3, 120, "apple"),
        Device("M4 Pro", 9.2, 273, "apple"),
        Device("M4 Max", 18.4, 546, "apple"),
        Device("M5", 17.0, 153, "apple"),
        Device("M5 Pro", 34.0, 307, "apple"),
        Device("M5 Max", 68.0, 614, "apple"),
        Device("RTX 4090", 165.0, 1008, "nvidia", 24),
        Device("RTX 5090", 209.0, 1792, "nvidia", 32),
        Device("H100", 989.0, 3350, "nvidia", 80),
        Device("H200", 989.0, 4800, "nvidia", 141),
    )
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that a real engine reaches, and a fixed cost per layer per forward."""

    compute: float
    bandwidth: float
    per_layer_s: float


# Calibrated so that the model reproduces both public data points with one compute efficiency:
# M1 Ultra, 4-bit: 71 tok/s autoregressive and ~15 tok/s diffusion (≈16 steps per 256-canvas);
# H100, bf16: diffusion "up to 4x" the autoregressive model.
EFFICIENCY = {
    "apple": Efficiency(compute=0.12, bandwidth=0.25, per_layer_s=100e-6),
    "nvidia": Efficiency(compute=0.12, bandwidth=0.7, per_layer_s=20e-6),
}

# The released google/diffusiongemma-26B-A4B-it (its config.json's text_config).
RELEASED = ModelConfig(
    vocab_size=262144, hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704,
    num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=2, num_experts=128, top_k_experts=8,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, sliding_window=1024,
)


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float


def forward_cost(cfg: ModelConfig, tokens: int, prefix: int, bits: float, denoise: bool) -> Cost:
    """FLOPs and bytes moved by one forward over ``tokens`` positions after ``prefix`` cached ones.

    ``bits`` is the average bits per weight (16 for bf16, ≈4.5 for the 4-bit mixed recipe). Weights
    are read once per forward; an expert is read if any token routes to it.
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    weight_bytes = bits / 8
    macs = 0.0
    params = 0.0
    kv_bytes = 0.0
    for layer in range(cfg.num_hidden_layers):
        d, kv = cfg.layer_head_dim(layer), cfg.layer_kv_heads(layer)
        n_proj = 2 if cfg.layer_types[layer] == FULL else 3  # full layers have no v_proj
        attn = H * cfg.num_attention_heads * d * 2 + H * kv * d * (n_proj - 1)
        dense = 3 * H * cfg.intermediate_size + H * cfg.num_experts
        expert = 3 * H * cfg.moe_intermediate_size
        touched = cfg.num_experts * (1 - (1 - cfg.top_k_experts / cfg.num_experts) ** tokens)
        seen = prefix if cfg.layer_types[layer] == FULL else min(prefix, cfg.sliding_window - 1)
        keys = seen + (tokens if denoise else 1)
        macs += tokens * (attn + dense + cfg.top_k_experts * expert)
        macs += tokens * 2 * cfg.num_attention_heads * d * keys
        params += attn + dense + touched * expert
        kv_bytes += 2 * seen * kv * d * 2
    heads = 2 if denoise else 1  # the tied head, plus the self-conditioning soft embedding
    macs += heads * tokens * H * V + (3 * tokens * H * cfg.intermediate_size if denoise else 0)
    params += H * V
    logits_bytes = 4 * 4 * tokens * V if denoise else 0  # fp32 logits, ~4 vocabulary passes
    return Cost(flops=2 * macs, bytes=params * weight_bytes + kv_bytes + logits_bytes)


def predicted_seconds(device: Device, cost: Cost, layers: int) -> float:
    eff = EFFICIENCY[device.vendor]
    compute = cost.flops / (device.tflops * 1e12 * eff.compute)
    memory = cost.bytes / (device.bandwidth * 1e9 * eff.bandwidth)
    return max(compute, memory) + layers * eff.per_layer_s


@dataclass
class Profile:
    """Seconds per denoising step by canvas length, per autoregressive token, and prefill speed."""

    device: str
    source: str  # "measured" | "predicted"
    step_s_by_canvas: dict[int, float]
    ar_token_s: float
    prefill_tok_s: float
    dtype: str = ""

    def step_s(self, canvas: int) -> float:
        """Step time at any canvas length, interpolated linearly between measured lengths."""
        points = sorted(self.step_s_by_canvas.items())
        if canvas <= points[0][0]:
            return points[0][1] * max(canvas, 1) / points[0][0] if len(points) == 1 else points[0][1]
        for (c0, s0), (c1, s1) in zip(points, points[1:]):
            if canvas <= c1:
                return s0 + (s1 - s0) * (canvas - c0) / (c1 - c0)
        c_last, s_last = points[-1]
        return s_last * canvas / c_last

    @property
    def ar_tok_s(self) -> float:
        return 1.0 / self.ar_token_s

    def diffusion_tok_s(self, steps: float, canvas: int = 256) -> float:
        return canvas / (steps * self.step_s(canvas))

    def crossover_steps(self, canvas: int = 256) -> float:
        """Steps per canvas at which diffusion and autoregression emit tokens equally fast."""
        return canvas * self.ar_token_s / self.step_s(canvas)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "Profile":
        """A profile from ``to_json``'s dict; ValueError if any figure is missing or not a positive time."""
        try:
            raw = dict(raw)
            raw["step_s_by_canvas"] = {int(k): float(v) for k, v in raw["step_s_by_canvas"].items()}
            profile = cls(**raw)
            figures = [*profile.step_s_by_canvas.values(), float(profile.ar_token_s), float(profile.prefill_tok_s)]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a device profile ({type(e).__name__}: {e})") from None
        if not profile.step_s_by_canvas or not all(0 < f < float("inf") for f in figures):
            raise ValueError("not a device profile (its times must be positive)")
        return profile


def default_bits(device: Device, cfg: ModelConfig = RELEASED) -> float:
    """What people run: 4-bit mixed (≈4.5 bits/weight) on a Mac, bf16 on an NVIDIA GPU it fits on."""
    if device.vendor == "apple":
        return 4.5
    bf16_gb = parameter_count(cfg) * 2 / 1e9
    return 16 if bf16_gb < 0.9 * device.memory_gb else 4.5


def parameter_count(cfg: ModelConfig) -> float:
    H = cfg.hidden_size
    total = cfg.vocab_size * H + 3 * H * cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        d, kv = cfg.layer_head_dim(layer), cfg.layer_kv_heads(layer)
        n_proj = 2 if cfg.layer_types[layer] == FULL else 3
        total += H * cfg.num_attention_heads * d * 2 + H * kv * d * (n_proj - 1)
        total += 3 * H * cfg.intermediate_size + H * cfg.num_experts
        total += cfg.num_experts * 3 * H * cfg.moe_intermediate_size
    return total


def predict(device: Device | str, cfg: ModelConfig = RELEASED, bits: float | None = None, prefix: int = 512) -> Profile:
    """A profile for a device not at hand (see ``default_bits`` for the precision assumed)."""
    device = KNOWN_DEVICES[device] if isinstance(device, str) else device
    if bits is None:
        bits = default_bits(device, cfg)
    layers = cfg.num_hidden_layers
    steps = {
        c: predicted_seconds(device, forward_cost(cfg, c, prefix, bits, denoise=True), layers) for c in CANVAS_LENGTHS
    }
    ar = predicted_seconds(device, forward_cost(cfg, 1, prefix, bits, denoise=False), layers)
    prefill = predicted_seconds(device, forward_cost(cfg, prefix, 0, bits, denoise=False), layers)
    return Profile(device.name, "predicted", steps, ar, prefix / prefill, f"{bits:g}-bit")


def predicted_table(steps: float = 16, cfg: ModelConfig = RELEASED) -> dict[str, dict[str, float]]:
    table = {}
    for name in KNOWN_DEVICES:
        p = predict(name, cfg)
        diffusion = p.diffusion_tok_s(steps)
        table[name] = {"ar_tok_s": p.ar_tok_s, "diffusion_tok_s": diffusion, "speedup": diffusion / p.ar_tok_s}
    return table


# ---------------------------------------------------------------------------------------------
# Measuring the current device


def device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and hasattr(mx, "metal") and mx.metal.is_available():
        return mx.metal.device_info().get("device_name", "Metal GPU")
    if device.type == mx.gpu:
        return "GPU"
    return f"CPU ({platform.machine()}, {platform.processor() or 'unknown'})"


def model_fingerprint(model) -> str:
    cfg = model.config
    dtype = str(model.model.decoder.norm.weight.dtype)
    raw = json.dumps([asdict(cfg), dtype, str(mx.default_device())], sort_keys=True, default=str)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def time_canvas(model, cache, steps: int, canvas: int, seed: int = 0) -> float:
    """Seconds for one canvas of exactly ``steps`` sampler steps (the stop rule cannot fire)."""
    from .sampler import MxRandom, SamplerSettings, denoise_canvas

    settings = SamplerSettings(steps=steps, confidence_threshold=1e-30)
    start = time.perf_counter()
    result = denoise_canvas(model, cache, settings, MxRandom(seed), canvas_length=canvas)
    mx.eval(result.tokens)
    return time.perf_counter() - start


def measure(model, prefix: int = 64, canvases=CANVAS_LENGTHS, repeats: int = 2, ar_tokens: int = 8,
            steps: int = 3) -> Profile:
    """Time real sampler steps (forward, self-conditioning, sampling) per canvas length, AR tokens
    and prefill on this device; each figure is the best of ``repeats`` after a warm-up."""
    cfg = model.config
    ids = mx.random.randint(3, cfg.vocab_size, (1, prefix), key=mx.random.key(0))
    cache = model.make_cache()
    start = time.perf_counter()
    model.encode(ids, cache)
    mx.eval(cache.state())
    prefill_s = time.perf_counter() - start
    step_s = {}
    for c in canvases:
        time_canvas(model, cache, 1, c)  # warm-up: kernels and buffers for this shape
        step_s[c] = min(time_canvas(model, cache, steps, c) for _ in range(repeats)) / steps

    def ar_run():
        ar_cache = model.make_cache()
        model.encode(ids, ar_cache)
        mx.eval(ar_cache.state())
        token = ids[:, -1:]
        start = time.perf_counter()
        for _ in range(ar_tokens):
            token = model.next_token_logits(token, ar_cache).argmax(-1, keepdims=True)
            mx.eval(token)
        return (time.perf_counter() - start) / ar_tokens

    ar_run()
    ar = min(ar_run() for _ in range(repeats))
    dtype = str(model.model.decoder.norm.weight.dtype).replace("mlx.core.", "")
    return Profile(device_name(), "measured", step_s, ar, prefix / prefill_s, dtype)


def profile_cache_path(model, root: Path | None = None) -> Path | None:
    """Where this machine's profile of ``model`` is cached; None without a home folder to keep it in."""
    if root is None:
        try:
            root = Path.home() / ".cache" / "mlx_dgemma" / "profiles"
        except (RuntimeError, KeyError):  # no HOME and no password entry
            return None
    return root / f"{platform.node() or 'host'}-{model_fingerprint(model)}.json"


def cached_profile(model, root: Path | None = None, refresh: bool = False) -> Profile:
    """The measured profile of this machine and model, measured once and cached on disk. A damaged
    cache file is measured again and replaced; a cache that cannot be written is said, not fatal.
    A model sharded over several ranks (distributed.py) uses rank 0's profile on every rank, so
    that all of them plan alike; they measure together, since every forward involves them all."""
    group = getattr(model, "group", None)
    lead = group is None or group.rank() == 0
    path = profile_cache_path(model, root)
    profile = _read_cached_profile(path) if lead and not refresh else None
    if group is not None:
        from .distributed import from_rank0

        if not from_rank0(profile is None, group):
            return Profile.from_json(from_rank0(profile.to_json() if lead else None, group))
    elif profile is not None:
        return profile
    if lead:
        print(f"measuring denoising steps and AR tokens on this device, once (cached in {path})", file=sys.stderr)
    profile = measure(model)
    if group is not None:
        profile = Profile.from_json(from_rank0(profile.to_json(), group))
    if not lead:
        return profile
    if path is None:
        print("no home folder to cache the device profile in; it will be measured again next time", file=sys.stderr)
        return profile
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(profile.to_json(), indent=2))
        tmp.replace(path)  # whole or not at all: a killed run leaves no truncated cache
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(f"cannot cache the device profile in {path} ({e.strerror or e}); it will be measured again "
              "next time", file=sys.stderr)
    return profile


def _read_cached_profile(path: Path | None) -> Profile | None:
    if path is None or not path.is_file():
        return None
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0] or type(e).__name__
        print(f"ignoring the damaged device profile {path} ({reason}); measuring again", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass
class Plan:
    """How to generate: the mode, the sampler settings and the last canvas length, with reasons."""

    policy: str
    mode: str  # "diffusion" | "ar"
    steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    trim_last_canvas: bool
    reasons: list[str] = field(default_factory=list)
    freeze_after: int = 0  # active-set compaction (sampler.SamplerSettings.freeze_after)
    stability_threshold: int | None = None  # None: the generation config's

    def explain(self) -> str:
        head = f"plan ({self.policy}): {self.mode}"
        if self.mode == "diffusion":
            head += f", ≤{self.steps} steps/canvas, entropy bound {self.entropy_bound:g}"
            head += f", t {self.t_min:g}–{self.t_max:g}"
            if self.freeze_after:
                head += f", positions settled for {self.freeze_after} step(s) frozen"
            if self.stability_threshold is not None:
                head += f", stability threshold {self.stability_threshold}"
            head += ", last canvas trimmed to the tokens wanted" if self.trim_last_canvas else ", full canvases"
        return "\n".join([head] + [f"  - {r}" for r in self.reasons])

    def using(self, settings) -> Plan:
        """The plan with the sampler settings the generation really uses (the caller's overrides of
        steps, bound, temperatures, freezing and stability), naming those that differ from it."""
        numbers = {"steps": settings.steps, "entropy_bound": settings.entropy_bound, "t_min": settings.t_min,
                   "t_max": settings.t_max, "freeze_after": settings.freeze_after}
        if self.stability_threshold is not None:  # None: the generation config's, whatever it is
            numbers["stability_threshold"] = settings.stability_threshold
        changed = {k: v for k, v in numbers.items() if getattr(self, k) != v}
        if not changed:
            return self
        given = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in changed.items())
        return replace(self, **changed, reasons=self.reasons + [f"set by the caller: {given}"])

    def last_canvas_length(self, remaining: int, canvas: int) -> int:
        """Length of a canvas when only ``remaining`` tokens are still wanted: whole canvases unless
        trimming, else rounded up to a multiple of 16 (of canvas/4 for small canvases)."""
        if not self.trim_last_canvas or remaining >= canvas:
            return canvas
        multiple = max(1, min(16, canvas // 4))
        return min(canvas, -(-remaining // multiple) * multiple)


FREEZE_AFTER = 1  # the fast policy's active-set compaction: benchmarks/demo_speed.py measures the choice


def make_plan(
    policy: str,
    gen: GenerationConfig,
    canvas: int,
    max_tokens: int,
    profile: Profile | None = None,
    expected_steps: float | None = None,
) -> Plan:
    """Turn a policy name, the generation config, the request and the device profile into a plan.

    ``expected_steps`` is how many steps a canvas typically takes with this model (the stop rule
    usually fires well before the limit); without it the step limit is assumed.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    reference = Plan(
        policy, "diffusion", gen.max_denoising_steps, gen.entropy_bound, gen.t_min, gen.t_max, False,
        [f"the checkpoint's generation config: {gen.max_denoising_steps} steps, bound {gen.entropy_bound:g}, "
         f"t {gen.t_min:g}–{gen.t_max:g}, whole canvases"],
    )
    if policy == "reference":
        return reference
    if policy == "ar":
        return replace(reference, mode="ar", reasons=["autoregressive decoding requested (the encoder as a causal LM)"])
    if policy == "fast":
        return replace(
            reference, trim_last_canvas=True, freeze_after=FREEZE_AFTER, stability_threshold=0,
            reasons=[f"positions accepted with the same token {FREEZE_AFTER} step(s) running are frozen (K/V kept) "
                     "and no longer recomputed: a step costs the share of the canvas still moving",
                     "a canvas may stop once confident (stability threshold 0): no extra step to confirm it",
                     "the last canvas is cut to the tokens still wanted (a step costs ~ canvas length when compute-bound)",
                     "measured on the demo tasks: benchmarks/demo_speed.py"],
        )
    # auto
    if profile is None:
        return replace(reference, trim_last_canvas=True, reasons=reference.reasons + ["no device profile: diffusion"])
    steps = expected_steps or gen.max_denoising_steps
    crossover = profile.crossover_steps(canvas)
    wanted = min(max_tokens, canvas)
    diffusion = profile.diffusion_tok_s(steps, canvas) * wanted / canvas
    reasons = [
        f"{profile.device} ({profile.source}): step {profile.step_s(canvas) * 1e3:.1f} ms at canvas {canvas}, "
        f"AR token {profile.ar_token_s * 1e3:.2f} ms",
        f"diffusion beats AR below {crossover:.1f} steps per canvas; expect {steps:.1f} "
        f"→ diffusion {diffusion:.1f} vs AR {profile.ar_tok_s:.1f} tok/s",
    ]
    if diffusion < profile.ar_tok_s:
        return replace(reference, mode="ar", reasons=reasons + ["autoregressive is faster on this device"])
    trim = profile.step_s(16) < 0.8 * profile.step_s(canvas)
    reasons.append(
        "diffusion is faster; " + ("steps are compute-bound, so the last canvas is trimmed"
                                   if trim else "steps are bandwidth-bound, trimming the last canvas saves little")
    )
    return replace(reference, policy="auto", trim_last_canvas=trim, reasons=reasons)
