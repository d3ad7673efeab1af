"""Device profiles: the seconds a denoising step, a verifying pass and an autoregressive token take,
measured on this machine and cached on disk per model (or predicted: roofline.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from stat import S_ISREG

import mlx.core as mx

from ...cpu_threads import follow_free_cores
from ..sampler import SamplerSettings

CANVAS_LENGTHS = (16, 32, 64, 128, 256)
DRAFT_LENGTHS = (2, 4, 8, 16, 32, 64, 128, 256)  # verified drafting's candidates (up to the canvas length)
DRAFT_STEPS = (1, 2)
# Bumped whenever the engine's speed, or how a profile is measured, changes enough to make cached profiles stale.
PROFILE_VERSION = 6
# Prefix keys between the two prefixes a profile's growth with the prefix is measured at (both past the
# sliding window, so that only the full-attention layers grow).
SLOPE_KEYS = 2048


@dataclass
class Profile:
    """Seconds per denoising step by canvas length, per autoregressive token, and prefill speed."""

    device: str
    source: str  # "measured" | "predicted"
    step_s_by_canvas: dict[int, float]
    ar_token_s: float
    prefill_tok_s: float
    dtype: str = ""
    # One encoder forward over L tokens with next-token logits at each (verified drafting's check).
    verify_s_by_length: dict[int, float] = field(default_factory=dict)
    # The prefix the times above are at, and the seconds each key past it adds (its full-attention
    # layers' share): to a step of the longest canvas measured (a shorter pass: in proportion to its
    # positions, but no less than an AR token, which reads the same keys) and to an AR token.
    prefix: int = 0
    step_s_per_key: float = 0.0
    ar_s_per_key: float = 0.0
    # The kinds of forward ("step", "verify", "ar") whose times the engine's own runs have confirmed
    # or corrected (observed.py); a measured profile starts with none.
    observed: list[str] = field(default_factory=list)

    def fitted(self) -> Profile:
        """The profile in a shape the hardware can have: a step or a verifying pass over more positions
        costs no less than one over fewer (an isotonic fit of the times by length; a point measured
        while the machine was busy is pooled with its neighbours), and a prefix key adds no negative
        time."""
        return replace(
            self,
            step_s_by_canvas=isotonic(self.step_s_by_canvas),
            verify_s_by_length=isotonic(self.verify_s_by_length),
            step_s_per_key=max(0.0, self.step_s_per_key),
            ar_s_per_key=max(0.0, self.ar_s_per_key),
        )

    def at_prefix(self, prefix: int) -> Profile:
        """The profile after ``prefix`` tokens of context (no faster than at its own prefix)."""
        extra = max(0, prefix - self.prefix)
        if not extra:
            return self
        longest = max(self.step_s_by_canvas)

        def grown(points: dict[int, float]) -> dict[int, float]:
            return {n: s + max(self.step_s_per_key * n / longest, self.ar_s_per_key) * extra for n, s in points.items()}

        return replace(
            self,
            step_s_by_canvas=grown(self.step_s_by_canvas),
            prefix=prefix,
            verify_s_by_length=grown(self.verify_s_by_length),
            ar_token_s=self.ar_token_s + self.ar_s_per_key * extra,
        )

    def step_s(self, canvas: int) -> float:
        """Step time at any canvas length, interpolated linearly between measured lengths."""
        return _interpolate(self.step_s_by_canvas, canvas)

    def verify_s(self, length: int) -> float:
        """An encoder pass over ``length`` tokens with their next-token logits; where it was not
        measured, a denoising step of that length (the same layers, one vocabulary pass fewer)."""
        if length == 1:
            return self.ar_token_s
        return _interpolate(self.verify_s_by_length, length) if self.verify_s_by_length else self.step_s(length)

    def verified_tok_s(self, length: int, steps: int, tokens_per_round: float) -> float:
        """Tokens/s of verified drafting: a round is ``steps`` denoising steps and one verify pass."""
        return tokens_per_round / (steps * self.step_s(length) + self.verify_s(length))

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
            raw["verify_s_by_length"] = {int(k): float(v) for k, v in raw.get("verify_s_by_length", {}).items()}
            profile = cls(**raw)
            figures = [*profile.step_s_by_canvas.values(), float(profile.ar_token_s), float(profile.prefill_tok_s)]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a device profile ({type(e).__name__}: {e})") from None
        if not profile.step_s_by_canvas or not all(0 < f < float("inf") for f in figures):
            raise ValueError("not a device profile (its times must be positive)")
        return profile


def isotonic(points_by_length: dict[int, float]) -> dict[int, float]:
    """The non-decreasing times closest (least squares) to ``points_by_length``: pool adjacent
    violators, each pool at the mean of its points."""
    pools: list[list] = []  # [sum, count, lengths]
    for length, seconds in sorted(points_by_length.items()):
        pools.append([seconds, 1, [length]])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count, lengths = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
            pools[-1][2] += lengths
    return {n: total / count for total, count, lengths in pools for n in lengths}


def settled(values) -> float:
    """A forward's time (or ratio) at the machine's load, not at its bursts: the lower quartile of the
    observations (the fastest of up to 4). Another process only ever slows a forward, and its bursts
    last several forwards on a shared machine; a load that stays moves the quartile once it holds
    for three quarters of them."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def _interpolate(points_by_length: dict[int, float], length: int) -> float:
    """Linear between measured lengths; below the shortest, its value; beyond the longest, proportional."""
    points = sorted(points_by_length.items())
    if length <= points[0][0]:
        return points[0][1] * max(length, 1) / points[0][0] if len(points) == 1 else points[0][1]
    for (c0, s0), (c1, s1) in zip(points, points[1:]):
        if length <= c1:
            return s0 + (s1 - s0) * (length - c0) / (c1 - c0)
    c_last, s_last = points[-1]
    return s_last * length / c_last


def device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and hasattr(mx, "metal") and mx.metal.is_available():
        return mx.metal.device_info().get("device_name", "Metal GPU")
    if device.type == mx.gpu:
        return "GPU"
    return f"CPU ({platform.machine()}, {platform.processor() or 'unknown'})"


def model_fingerprint(model) -> str:
    # The kernels and PROFILE_VERSION: a profile measured with other kernels (or before verified
    # drafting's timings existed) is measured again.
    settings = (str(model.model.decoder.norm.weight.dtype), str(mx.default_device()), model.kernels.name)
    kept = _FINGERPRINTS.get(id(model))
    if kept is None or kept[0] != (id(model.config), settings):  # (asked before every auto request)
        if kept is None:
            weakref.finalize(model, _FINGERPRINTS.pop, id(model), None)
        raw = json.dumps([asdict(model.config), *settings, PROFILE_VERSION], sort_keys=True, default=str)
        kept = _FINGERPRINTS[id(model)] = ((id(model.config), settings), hashlib.sha1(raw.encode()).hexdigest()[:16])
    return kept[1]


_FINGERPRINTS: dict[int, tuple[tuple, str]] = {}  # id(model) -> ((id of its config, settings), fingerprint)


def time_canvas(model, cache, steps: int, canvas: int, seed: int = 0) -> float:
    """Seconds for one canvas of exactly ``steps`` sampler steps (the stop rule cannot fire)."""
    from ..denoise import denoise_canvas
    from ..sampler import MxRandom

    settings = SamplerSettings(steps=steps, confidence_threshold=1e-30)
    start = time.perf_counter()
    result = denoise_canvas(model, cache, settings, MxRandom(seed), canvas_length=canvas)
    mx.eval(result.tokens)
    return time.perf_counter() - start


def measure(
    model,
    prefix: int = 64,
    canvases=CANVAS_LENGTHS,
    repeats: int = 3,
    ar_tokens: int = 8,
    steps: int = 3,
    draft_lengths=DRAFT_LENGTHS,
) -> Profile:
    """Time real sampler steps (forward, self-conditioning, sampling) per canvas length (and per draft
    length up to the model's canvas), verifying encoder passes per draft length, AR tokens and
    prefill on this device; each figure is the lower quartile of ``repeats`` after a warm-up
    (``settled``, as the engine's own forwards are taken in: on a core shared with another process a
    forward runs at one pace or at up to 10x slower, in bursts, and a point measured in a burst would
    price one plan out against the others), and the times are fitted to a shape the hardware can
    have (``Profile.fitted``)."""
    cfg = model.config
    ids = mx.random.randint(3, cfg.vocab_size, (1, prefix), key=mx.random.key(0))
    cache = model.make_cache()
    start = time.perf_counter()
    model.encode(ids, cache)
    mx.eval(cache.state())
    prefill_s = time.perf_counter() - start
    drafts = [n for n in draft_lengths if n <= cfg.canvas_length]
    step_s = {}
    for c in sorted(set(canvases) | set(drafts)):
        follow_free_cores()  # the thread count the engine would run at now
        time_canvas(model, cache, 1, c)  # warm-up: kernels and buffers for this shape
        step_s[c] = settled([time_canvas(model, cache, steps, c) for _ in range(repeats)]) / steps
    verify_s = {}
    for n in drafts:
        follow_free_cores()
        time_verify(model, cache, n)
        verify_s[n] = settled([time_verify(model, cache, n) for _ in range(repeats)])

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

    follow_free_cores()
    ar_run()
    ar = settled([ar_run() for _ in range(repeats)])
    dtype = str(model.model.decoder.norm.weight.dtype).replace("mlx.core.", "")
    step_slope, ar_slope = _slopes(model, max(step_s), steps, repeats)
    return Profile(
        device_name(), "measured", step_s, ar, prefix / prefill_s, dtype, verify_s, prefix, step_slope, ar_slope
    ).fitted()


def _slopes(model, canvas: int, steps: int, repeats: int) -> tuple[float, float]:
    """Seconds per prefix key of a step of ``canvas`` and of an AR token, between a prefix just past
    the sliding window and ``SLOPE_KEYS`` more."""
    cfg = model.config
    ids = mx.random.randint(
        3, cfg.vocab_size, (1, cfg.sliding_window + cfg.canvas_length + SLOPE_KEYS), key=mx.random.key(1)
    )
    near = cfg.sliding_window + cfg.canvas_length
    cache = model.make_cache()
    times = []
    for part in (ids[:, :near], ids[:, near:]):
        model.encode(part, cache)
        mx.eval(cache.state())
        time_canvas(model, cache, 1, canvas)
        step = settled([time_canvas(model, cache, steps, canvas) for _ in range(repeats)]) / steps
        time_ar(model, cache)
        times.append((step, settled([time_ar(model, cache) for _ in range(repeats)])))
    (step0, ar0), (step1, ar1) = times
    return max(0.0, step1 - step0) / SLOPE_KEYS, max(0.0, ar1 - ar0) / SLOPE_KEYS


def time_ar(model, cache, tokens: int = 4) -> float:
    """Seconds per AR token after ``cache`` (trimmed back)."""
    token = mx.array([[5]])
    start = time.perf_counter()
    for _ in range(tokens):
        token = model.next_token_logits(token, cache).argmax(-1, keepdims=True)
        mx.eval(token)
    cache.trim(tokens)
    return (time.perf_counter() - start) / tokens


def time_verify(model, cache, length: int) -> float:
    """Seconds for verified drafting's check: an encoder pass over ``length`` tokens, their
    next-token predictions on the host, and the cache trimmed back."""
    ids = mx.random.randint(3, model.config.vocab_size, (1, length), key=mx.random.key(length))
    start = time.perf_counter()
    predictions = model.head(model.encode(ids, cache, return_hidden=True))[0].argmax(-1)
    predictions.tolist()
    cache.trim(length)
    return time.perf_counter() - start


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
    from ...distributed import from_rank0, sharded_group

    group = sharded_group(model)
    lead = group is None or group.rank() == 0
    path = profile_cache_path(model, root)
    profile = _read_cached_profile(path) if lead and not refresh else None
    if group is not None:
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
    store_profile(path, profile)
    return profile


def store_profile(path: Path | None, profile: Profile) -> None:
    """Write ``profile`` to ``path`` whole or not at all (a killed run leaves no truncated cache); a
    cache that cannot be written is said on stderr, not fatal."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(profile.to_json(), indent=2))
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(
            f"cannot cache the device profile in {path} ({e.strerror or e}); it will be measured again next time",
            file=sys.stderr,
        )


_READ: dict[Path, tuple[tuple[int, int], Profile]] = {}  # path -> (its mtime and size, the profile read)


def live_profile_store(model, root: Path | None = None):
    """The function that replaces this model's cached profile with one the engine observed, or None
    where a profile must not move under the engine: a model sharded over several ranks plans alike
    on all of them from rank 0's profile, which each rank's own timings would pull apart."""
    from ...distributed import sharded_group

    if sharded_group(model) is not None:
        return None
    path = profile_cache_path(model, root)
    return None if path is None else lambda profile: store_profile(path, profile)


def _read_cached_profile(path: Path | None) -> Profile | None:
    if path is None:
        return None
    try:
        st = path.stat()
        if not S_ISREG(st.st_mode):
            return None
        read = _READ.get(path)
        if read is not None and read[0] == (st.st_mtime_ns, st.st_size):  # read before every auto request
            return read[1]
        profile = Profile.from_json(json.loads(path.read_text())).fitted()  # a cache written before the fit, reshaped
        _READ[path] = ((st.st_mtime_ns, st.st_size), profile)
        return profile
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0] or type(e).__name__
        print(f"ignoring the damaged device profile {path} ({reason}); measuring again", file=sys.stderr)
        return None
