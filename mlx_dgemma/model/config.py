"""Configuration dataclasses read from a checkpoint's config.json and generation_config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


@dataclass
class VisionConfig:
    """The Gemma 4 vision tower (``vision_config``; the reference's ``Gemma4VisionConfig`` defaults)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_dict(cls, raw: dict) -> "VisionConfig":
        names = {f for f in cls.__dataclass_fields__ if f != "rope_theta"}
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config rope_type {rope['rope_type']!r} is not supported (only 'axial')")
        return cls(
            **{k: v for k, v in raw.items() if k in names}, rope_theta=float(rope.get("rope_theta", cls.rope_theta))
        )


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_global_key_value_heads: int
    num_experts: int
    top_k_experts: int
    layer_types: list[str]
    sliding_window: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    rope_parameters: dict = field(default_factory=lambda: dict(_DEFAULT_ROPE))
    max_position_embeddings: int = 131072
    canvas_length: int = 256
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: list[int] = field(default_factory=lambda: [1])
    quantization: dict | None = None
    vision_config: VisionConfig | None = None
    image_token_id: int = 258880
    boi_token_id: int = 255999
    eoi_token_id: int = 258882
    use_bidirectional_attention: str | None = None

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_key_value_heads if self.is_sliding(layer) else self.num_global_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must be a JSON object, got {_json_kind(raw)}")
        model_type = raw.get("model_type")
        if model_type not in ("diffusion_gemma", "diffusion_gemma_text", None):
            raise ConfigError(
                f"config.json has model_type {model_type!r}, expected 'diffusion_gemma': "
                "this is not a DiffusionGemma checkpoint"
            )
        text = raw.get("text_config") or raw
        if not isinstance(text, dict):
            raise ConfigError(f"config.json text_config must be a JSON object, got {_json_kind(text)}")
        layers = _whole(text, "num_hidden_layers")
        head_dim = _whole(text, "head_dim", 256)
        kv_heads = _whole(text, "num_key_value_heads")
        global_head_dim, global_kv_heads = _full_attention_sizes(text, head_dim, kv_heads)
        layer_types = text.get("layer_types") or _default_layer_types(layers)
        if not isinstance(layer_types, list):
            raise ConfigError(f"config.json layer_types must be a list, got {json.dumps(layer_types)}")
        layer_types = list(layer_types)
        layer_types[-1] = FULL  # the reference forces the last layer to full attention
        eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
        rope = dict(_DEFAULT_ROPE)
        rope.update(_section(text, "rope_parameters"))
        cfg = cls(
            vocab_size=_whole(text, "vocab_size"),
            hidden_size=_whole(text, "hidden_size"),
            intermediate_size=_whole(text, "intermediate_size"),
            moe_intermediate_size=_whole(text, "moe_intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=_whole(text, "num_attention_heads"),
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            num_global_key_value_heads=global_kv_heads,
            num_experts=_whole(text, "num_experts"),
            top_k_experts=_whole(text, "top_k_experts"),
            layer_types=layer_types,
            sliding_window=_whole(text, "sliding_window", 512),
            rms_norm_eps=_positive(text, "rms_norm_eps", 1e-6),
            final_logit_softcapping=_positive(text, "final_logit_softcapping", 30.0)
            if text.get("final_logit_softcapping") != 0
            else 30.0,
            rope_parameters=rope,
            max_position_embeddings=_whole(text, "max_position_embeddings", 131072),
            canvas_length=_whole(raw, "canvas_length", 256),
            pad_token_id=_whole(text, "pad_token_id", _whole(raw, "pad_token_id", 0, 0, True), 0, True),
            bos_token_id=_whole(text, "bos_token_id", _whole(raw, "bos_token_id", 2, 0, True), 0, True),
            eos_token_id=_token_ids(eos, "config.json eos_token_id"),
            quantization=raw.get("quantization"),
            vision_config=VisionConfig.from_dict(_section(raw, "vision_config")) if raw.get("vision_config") else None,
            image_token_id=_whole(raw, "image_token_id", 258880, 0, True),
            boi_token_id=_whole(raw, "boi_token_id", 255999, 0, True),
            eoi_token_id=_whole(raw, "eoi_token_id", 258882, 0, True),
            use_bidirectional_attention=text.get("use_bidirectional_attention"),
        )
        if len(cfg.layer_types) != layers or set(cfg.layer_types) - {SLIDING, FULL}:
            raise ConfigError(
                f"config.json layer_types must list {layers} entries of {SLIDING!r}/{FULL!r}, got {cfg.layer_types}"
            )
        if cfg.top_k_experts > cfg.num_experts:
            raise ConfigError(f"top_k_experts {cfg.top_k_experts} exceeds num_experts {cfg.num_experts}")
        for heads, kv in (
            (cfg.num_attention_heads, cfg.num_key_value_heads),
            (cfg.num_attention_heads, cfg.num_global_key_value_heads),
        ):
            if heads % kv:
                raise ConfigError(
                    f"config.json: num_attention_heads {heads} is not a multiple of the {kv} key/value "
                    "heads; fix the config"
                )
        # A stop id past the vocabulary is allowed: it can never be produced (benchmarks use one so that
        # random weights never stop early); padding and <bos> are written into prompts, so they must exist.
        if bad := [i for i in (cfg.pad_token_id, cfg.bos_token_id) if i >= cfg.vocab_size]:
            raise ConfigError(f"config.json: token id {bad[0]} is outside the vocabulary of {cfg.vocab_size}")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(_read_json(Path(path)))


def _default_layer_types(layers: int) -> list[str]:
    return [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)]


def _full_attention_sizes(text: dict, head_dim: int, kv_heads: int) -> tuple[int, int]:
    """Full-attention head size and KV heads, from either spelling the reference accepts."""
    per_layer = _section(text, "per_layer_config")
    if per_layer and "global_head_dim" not in text:
        override = next(iter(per_layer.values()))
        if not isinstance(override, dict):
            raise ConfigError(f"config.json per_layer_config entries must be JSON objects, got {_json_kind(override)}")
        return _whole(override, "head_dim", head_dim), _whole(override, "num_key_value_heads", kv_heads)
    # The reference's defaults when neither spelling is present: 512-wide heads, the sliding KV heads.
    return (
        _whole(text, "global_head_dim", 512, none_is_default=True),
        _whole(text, "num_global_key_value_heads", kv_heads, none_is_default=True),
    )


_REQUIRED = object()


def _json_kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _whole(
    section: dict,
    key: str,
    default=_REQUIRED,
    minimum: int = 1,
    none_is_default: bool = False,
    file: str = "config.json",
) -> int:
    """``section[key]`` as an integer of at least ``minimum``; one line naming the key otherwise."""
    value = section.get(key, default)
    if value is None and none_is_default:
        value = default
    if value is _REQUIRED:
        raise ConfigError(f"{file} lacks {key!r}; re-export the checkpoint with save_pretrained")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not value.is_integer())
        or value < minimum
    ):
        raise ConfigError(f"{file}: {key} must be an integer of at least {minimum}, got {json.dumps(value)}")
    return int(value)


def _positive(section: dict, key: str, default: float, file: str = "config.json") -> float:
    """``section[key]`` as a finite number above 0 (null: the default)."""
    value = section.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{file}: {key} must be a finite number above 0, got {json.dumps(value)}")
    return float(value)


def _section(section: dict, key: str, file: str = "config.json") -> dict:
    value = section.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{file}: {key} must be a JSON object, got {_json_kind(value)}")
    return value


def _token_ids(value, what: str) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(f"{what} must be a token id or a non-empty list of them, got {json.dumps(value)}")
    return ids


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_id: list[int] = field(default_factory=lambda: [1])
    pad_token_id: int = 0

    @classmethod
    def from_dict(
        cls, raw: dict, model: ModelConfig | None = None, file: str = "generation_config.json"
    ) -> "GenerationConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{file} must be a JSON object, got {_json_kind(raw)}")
        sampler = _section(raw, "sampler_config", file)
        eos = raw.get("eos_token_id", model.eos_token_id if model else [1])
        d = cls()
        t_min = _positive(raw, "t_min", d.t_min, file) if raw.get("t_min") != 0 else 0.0
        config = cls(
            max_new_tokens=_whole(raw, "max_new_tokens", d.max_new_tokens, none_is_default=True, file=file),
            max_denoising_steps=_whole(
                raw, "max_denoising_steps", d.max_denoising_steps, none_is_default=True, file=file
            ),
            entropy_bound=_positive(sampler, "entropy_bound", d.entropy_bound, file),
            t_min=t_min,
            t_max=_positive(raw, "t_max", d.t_max, file),
            stability_threshold=_whole(raw, "stability_threshold", d.stability_threshold, 0, True, file),
            confidence_threshold=_positive(raw, "confidence_threshold", d.confidence_threshold, file),
            eos_token_id=_token_ids(eos, f"{file} eos_token_id"),
            pad_token_id=_whole(raw, "pad_token_id", model.pad_token_id if model else 0, 0, True, file),
        )
        if not config.t_min < config.t_max:
            raise ConfigError(f"{file}: t_min {config.t_min} must be below t_max {config.t_max}")
        return config

    @classmethod
    def from_folder(cls, folder: str | Path, model: ModelConfig | None = None) -> "GenerationConfig":
        path = Path(folder) / "generation_config.json"
        return cls.from_dict(_read_json(path) if path.exists() else {}, model, str(path))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: a checkpoint folder needs config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; re-export it") from None
    except OSError as e:  # a folder, or a file that cannot be opened
        raise ConfigError(
            f"{path} cannot be read ({e.strerror}); a checkpoint folder needs a config.json file"
        ) from None
