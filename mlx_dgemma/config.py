"""Configuration dataclasses read from a checkpoint's config.json and generation_config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SLIDING = "sliding_attention"
FULL = "full_attention"

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


class ConfigError(ValueError):
    """A config file that cannot describe a DiffusionGemma text model."""


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
        return cls(**{k: v for k, v in raw.items() if k in names},
                   rope_theta=float(rope.get("rope_theta", cls.rope_theta)))


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
        model_type = raw.get("model_type")
        if model_type not in ("diffusion_gemma", "diffusion_gemma_text", None):
            raise ConfigError(
                f"config.json has model_type {model_type!r}, expected 'diffusion_gemma': "
                "this is not a DiffusionGemma checkpoint"
            )
        text = raw.get("text_config") or raw
        try:
            layers = int(text["num_hidden_layers"])
            head_dim = int(text.get("head_dim", 256))
            kv_heads = int(text["num_key_value_heads"])
            global_head_dim, global_kv_heads = _full_attention_sizes(text, head_dim, kv_heads)
            layer_types = list(text.get("layer_types") or _default_layer_types(layers))
            if layer_types:
                layer_types[-1] = FULL  # the reference forces the last layer to full attention
            eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
            rope = dict(_DEFAULT_ROPE)
            rope.update(text.get("rope_parameters") or {})
            cfg = cls(
                vocab_size=int(text["vocab_size"]),
                hidden_size=int(text["hidden_size"]),
                intermediate_size=int(text["intermediate_size"]),
                moe_intermediate_size=int(text["moe_intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=int(text["num_attention_heads"]),
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                global_head_dim=global_head_dim,
                num_global_key_value_heads=global_kv_heads,
                num_experts=int(text["num_experts"]),
                top_k_experts=int(text["top_k_experts"]),
                layer_types=layer_types,
                sliding_window=int(text.get("sliding_window", 512)),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                final_logit_softcapping=float(text.get("final_logit_softcapping") or 30.0),
                rope_parameters=rope,
                max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
                canvas_length=int(raw.get("canvas_length", 256)),
                pad_token_id=int(text.get("pad_token_id", raw.get("pad_token_id", 0)) or 0),
                bos_token_id=int(text.get("bos_token_id", raw.get("bos_token_id", 2)) or 2),
                eos_token_id=[int(e) for e in (eos if isinstance(eos, list) else [eos])],
                quantization=raw.get("quantization"),
                vision_config=VisionConfig.from_dict(raw["vision_config"]) if raw.get("vision_config") else None,
                image_token_id=int(raw.get("image_token_id", 258880)),
                boi_token_id=int(raw.get("boi_token_id", 255999)),
                eoi_token_id=int(raw.get("eoi_token_id", 258882)),
                use_bidirectional_attention=text.get("use_bidirectional_attention"),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks {e.args[0]!r}; re-export the checkpoint with save_pretrained") from None
        if len(cfg.layer_types) != layers or set(cfg.layer_types) - {SLIDING, FULL}:
            raise ConfigError(
                f"config.json layer_types must list {layers} entries of {SLIDING!r}/{FULL!r}, got {cfg.layer_types}"
            )
        if cfg.top_k_experts > cfg.num_experts:
            raise ConfigError(f"top_k_experts {cfg.top_k_experts} exceeds num_experts {cfg.num_experts}")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(_read_json(Path(path)))


def _default_layer_types(layers: int) -> list[str]:
    return [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)]


def _full_attention_sizes(text: dict, head_dim: int, kv_heads: int) -> tuple[int, int]:
    """Full-attention head size and KV heads, from either spelling the reference accepts."""
    per_layer = text.get("per_layer_config")
    if per_layer and "global_head_dim" not in text:
        override = next(iter(per_layer.values()))
        return int(override.get("head_dim", head_dim)), int(override.get("num_key_value_heads", kv_heads))
    # The reference's defaults when neither spelling is present: 512-wide heads, the sliding KV heads.
    return int(text.get("global_head_dim") or 512), int(text.get("num_global_key_value_heads") or kv_heads)


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
    def from_dict(cls, raw: dict, model: ModelConfig | None = None) -> "GenerationConfig":
        sampler = raw.get("sampler_config") or {}
        eos = raw.get("eos_token_id", model.eos_token_id if model else [1])
        defaults = cls()
        return cls(
            max_new_tokens=int(raw.get("max_new_tokens") or defaults.max_new_tokens),
            max_denoising_steps=int(raw.get("max_denoising_steps") or defaults.max_denoising_steps),
            entropy_bound=float(sampler.get("entropy_bound", defaults.entropy_bound)),
            t_min=float(raw.get("t_min", defaults.t_min)),
            t_max=float(raw.get("t_max", defaults.t_max)),
            stability_threshold=int(raw.get("stability_threshold", defaults.stability_threshold)),
            confidence_threshold=float(raw.get("confidence_threshold", defaults.confidence_threshold)),
            eos_token_id=[int(e) for e in (eos if isinstance(eos, list) else [eos])],
            pad_token_id=int(raw.get("pad_token_id", model.pad_token_id if model else 0) or 0),
        )

    @classmethod
    def from_folder(cls, folder: str | Path, model: ModelConfig | None = None) -> "GenerationConfig":
        path = Path(folder) / "generation_config.json"
        return cls.from_dict(_read_json(path) if path.exists() else {}, model)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: a checkpoint folder needs config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
