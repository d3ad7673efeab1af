"""Small random DiffusionGemma checkpoints built and saved by the reference (transformers).

Sizes are chosen so that no two dimensions coincide (no matrix is square by accident), and every
layer scalar, norm weight and router scale is set to a distinct non-1 value before saving, so a
port that swaps encoder/decoder scalars, transposes a weight or drops a norm weight cannot match.

    python -m checkpoint_tools.random_checkpoint OUT_DIR [--preset NAME] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

PRESETS: dict[str, dict] = {
    # 3 sliding + 1 full; window shorter than the test prompts.
    "small": dict(
        vocab_size=397,
        hidden_size=72,
        intermediate_size=88,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=20,
        global_head_dim=36,
        num_global_key_value_heads=1,
        num_experts=6,
        top_k_experts=2,
        sliding_window=5,
        canvas_length=12,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
    # The released 5:1 pattern, 3 experts per token.
    "pattern": dict(
        vocab_size=521,
        hidden_size=96,
        intermediate_size=136,
        moe_intermediate_size=40,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        global_head_dim=28,
        num_global_key_value_heads=2,
        num_experts=8,
        top_k_experts=3,
        sliding_window=7,
        canvas_length=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    ),
    # Every expert on every token: no discrete routing choice that bf16 rounding could flip.
    "all-experts": dict(
        vocab_size=397,
        hidden_size=72,
        intermediate_size=88,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=20,
        global_head_dim=36,
        num_global_key_value_heads=1,
        num_experts=3,
        top_k_experts=3,
        sliding_window=5,
        canvas_length=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    # Experts are 85% of the weights and every size divides by 64 (quantizable): sharding tests.
    "many-experts": dict(
        vocab_size=448,
        hidden_size=128,
        intermediate_size=192,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        num_experts=32,
        top_k_experts=4,
        sliding_window=7,
        canvas_length=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
    # Two full layers, MHA on full layers, top-1 routing, a non-default soft-cap.
    "mixed": dict(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=20,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        global_head_dim=40,
        num_global_key_value_heads=4,
        num_experts=5,
        top_k_experts=1,
        sliding_window=6,
        canvas_length=10,
        final_logit_softcapping=25.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    ),
    # A vision tower of its own sizes (GQA, 2-D RoPE, 2x2 pooling, clipped linears, standardized
    # features) and an image processor at 4-pixel patches, so images of tens of pixels give tens of
    # image tokens; the window is shorter than an image's block of tokens. Text input widths are
    # multiples of 32, so that it quantizes at group size 32.
    "vision": dict(
        vocab_size=431,
        hidden_size=160,
        intermediate_size=224,
        moe_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=72,
        num_global_key_value_heads=1,
        num_experts=6,
        top_k_experts=2,
        sliding_window=9,
        canvas_length=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        vision=dict(
            hidden_size=44,
            intermediate_size=60,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            patch_size=4,
            pooling_kernel_size=2,
            position_embedding_size=150,
            standardize=True,
            use_clipped_linears=True,
        ),
        image_processor=dict(max_soft_tokens=70),
    ),
}

# The vision tower of the text-only presets: the reference always builds one.
SMALL_VISION = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    position_embedding_size=16,
)


def build_reference(
    preset: str | dict = "small", seed: int = 0, init_std: float = 0.06, tame: bool = False, converging: bool = False
):
    """A reference ``DiffusionGemmaForBlockDiffusion`` (fp32, eval mode) with distinct scalars.

    Random weights give, with attention scale 1.0, very peaked attention; bf16 rounding then moves
    both the reference's and any port's bf16 logits by tens of percent. ``tame`` makes attention
    soft (Q/K norm weights × 0.3), as in a trained model, so bf16 parity measures rounding (use it
    with the "all-experts" preset, where no near-tied top-k choice can flip either).

    Random weights never converge: every canvas runs all denoising steps. ``converging`` makes the
    layers write little into the residual stream and sharpens the head, so each position predicts
    its own input token with confidence; denoising then settles and the stop rule fires early (4-6
    of the 8 steps on "small").
    """
    import torch
    from transformers import (
        DiffusionGemmaConfig,
        DiffusionGemmaForBlockDiffusion,
        DiffusionGemmaTextConfig,
        Gemma4VisionConfig,
    )
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    sizes = copy.deepcopy(PRESETS[preset] if isinstance(preset, str) else preset)
    canvas = sizes.pop("canvas_length")
    vision_sizes = sizes.pop("vision", SMALL_VISION)
    sizes.pop("image_processor", None)
    text = DiffusionGemmaTextConfig(
        **sizes,
        max_position_embeddings=4096,
        use_bidirectional_attention="vision",
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        initializer_range=init_std,
    )
    vision = Gemma4VisionConfig(**vision_sizes)
    v = sizes["vocab_size"]
    cfg = DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=canvas,
        image_token_id=v - 3,
        boi_token_id=v - 2,
        eoi_token_id=v - 1,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    _perturb(model, seed, tame)
    if "vision" in (PRESETS[preset] if isinstance(preset, str) else preset):
        _perturb_vision(model, seed)
    if converging:
        _make_converging(model)
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_new_tokens=2 * canvas,
        max_denoising_steps=8,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=0.005,
        bos_token_id=2,
        eos_token_id=[1],
        pad_token_id=0,
    )
    return model


def _perturb(model, seed: int, tame: bool) -> None:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        decoder = model.model.decoder
        encoder_layers = model.model.encoder.language_model.layers
        for i, layer in enumerate(decoder.layers):
            layer.layer_scalar.fill_(0.8 + 0.09 * i)
            encoder_layers[i].layer_scalar.fill_(1.3 - 0.07 * i)
            layer.router.scale.copy_(0.5 + torch.rand(layer.router.scale.shape, generator=g))
            layer.router.per_expert_scale.copy_(0.5 + torch.rand(layer.router.per_expert_scale.shape, generator=g))
        for name, p in decoder.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        if tame:
            for layer in decoder.layers:
                layer.self_attn.q_norm.weight.mul_(0.3)
                layer.self_attn.k_norm.weight.mul_(0.3)


def _perturb_vision(model, seed: int) -> None:
    """Weights large enough that images move the logits; distinct norm weights, position tables,
    standardization and clipping bounds that clip some activations (all are 1, 0 or ±inf at init)."""
    import torch

    g = torch.Generator().manual_seed(seed + 2)
    encoder = model.model.encoder
    with torch.no_grad():
        for name, p in encoder.vision_tower.named_parameters():
            if name.endswith("linear.weight") or name.endswith("input_proj.weight"):
                p.mul_(5.0)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("position_embedding_table"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        tower = encoder.vision_tower
        tower.std_bias.copy_(0.2 * torch.randn(tower.std_bias.shape, generator=g))
        tower.std_scale.copy_(0.5 + torch.rand(tower.std_scale.shape, generator=g))
        for i, (name, module) in enumerate(tower.named_modules()):
            if hasattr(module, "input_min"):
                module.input_min.fill_(-2.0 - 0.05 * (i % 7))
                module.input_max.fill_(2.2 + 0.05 * (i % 5))
                module.output_min.fill_(-1.0 - 0.04 * (i % 3))
                module.output_max.fill_(1.1 + 0.03 * (i % 4))


def _make_converging(model) -> None:
    import torch

    with torch.no_grad():
        decoder = model.model.decoder
        for layer in decoder.layers:
            layer.post_attention_layernorm.weight.mul_(0.05)
            layer.post_feedforward_layernorm.weight.mul_(0.05)
        decoder.norm.weight.mul_(2.5)


def save(model, out: Path, dtype: str = "float32") -> Path:
    import torch

    out = Path(out)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def build(
    out: Path,
    preset: str | dict = "small",
    seed: int = 0,
    dtype: str = "float32",
    tame: bool = False,
    converging: bool = False,
) -> Path:
    out = save(build_reference(preset, seed, tame=tame, converging=converging), out, dtype)
    sizes = PRESETS[preset] if isinstance(preset, str) else preset
    if "image_processor" in sizes:
        save_image_processor(out, sizes)
    return out


def save_image_processor(out: Path, sizes: dict) -> None:
    """The reference's image processor, at the vision tower's patch and pooling sizes, saved as the
    reference saves it (preprocessor_config.json)."""
    from transformers import Gemma4ImageProcessorPil

    vision = sizes["vision"]
    Gemma4ImageProcessorPil(
        patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"], **sizes["image_processor"]
    ).save_pretrained(out)


def write_global_head_spelling(folder: Path) -> None:
    """Rewrite config.json with the released checkpoint's spelling of the full-attention sizes."""
    path = Path(folder) / "config.json"
    raw = json.loads(path.read_text())
    text = raw["text_config"]
    override = next(iter(text.pop("per_layer_config").values()))
    text["global_head_dim"] = override["head_dim"]
    text["num_global_key_value_heads"] = override["num_key_value_heads"]
    path.write_text(json.dumps(raw, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--converging", action="store_true", help="a model whose denoising settles early")
    args = parser.parse_args()
    print(build(args.out, args.preset, args.seed, args.dtype, converging=args.converging))


if __name__ == "__main__":
    main()
