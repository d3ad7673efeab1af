"""Running the transformers reference the way generate() does, for parity tests."""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

_models: dict[tuple, DiffusionGemmaForBlockDiffusion] = {}


def torch_device() -> torch.device:
    """The torch device matching MLX's: set by DGEMMA_TEST_DEVICE (cpu | gpu)."""
    if os.environ.get("DGEMMA_TEST_DEVICE", "cpu") != "gpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 as MLX's
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    raise RuntimeError("DGEMMA_TEST_DEVICE=gpu but torch sees neither CUDA nor MPS")


def on_reference(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list, numpy or MLX array) as a tensor on the reference's device."""
    return torch.as_tensor(np.asarray(values), dtype=dtype, device=torch_device())


def load_reference(path, dtype: torch.dtype = torch.float32) -> DiffusionGemmaForBlockDiffusion:
    key = (str(path), dtype)
    if key not in _models:
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=dtype)
        _models[key] = model.to(torch_device()).eval()
    return _models[key]


class ReferenceSession:
    """Encoder cache plus denoising forwards, positions as in the reference generate loop."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion):
        self.model = model
        self.cache = DynamicCache(config=model.config.text_config)
        self.length = 0

    @torch.no_grad()
    def encode(self, ids, pixel_values=None, image_position_ids=None) -> None:
        """Encode ``ids``; with images, as generate() does: the image tokens marked in
        ``mm_token_type_ids`` (as the processor marks them) and the encoder masks built from them."""
        device = self.model.device
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=device).reshape(1, -1)
        positions = torch.arange(self.length, self.length + ids.shape[1], device=device)[None]
        vision = {}
        if pixel_values is not None:
            types = (ids == self.model.config.image_token_id).long()
            masks = self.model.model.encoder.create_masks_for_generate(
                config=self.model.config,
                inputs_embeds=torch.empty(1, ids.shape[1], 0, device=device),
                attention_mask=torch.ones(1, self.length + ids.shape[1], dtype=torch.bool, device=device),
                cache=self.cache,
                position_ids=positions,
                mm_token_type_ids=types,
            )
            vision = dict(
                pixel_values=torch.as_tensor(np.asarray(pixel_values), device=device),
                image_position_ids=torch.as_tensor(np.asarray(image_position_ids), device=device),
                mm_token_type_ids=types,
                attention_mask=masks,
            )
        self.model.model.encoder(input_ids=ids, cache=self.cache, position_ids=positions, **vision)
        self.length += ids.shape[1]

    @torch.no_grad()
    def denoise(self, canvas, self_conditioning=None) -> np.ndarray:
        device = self.model.device
        canvas = torch.as_tensor(np.asarray(canvas), dtype=torch.long, device=device).reshape(1, -1)
        sc = None
        if self_conditioning is not None:
            dtype = self.model.model.decoder.embed_tokens.weight.dtype
            sc = torch.as_tensor(np.asarray(self_conditioning)).to(device=device, dtype=dtype)
        positions = torch.arange(self.length, self.length + canvas.shape[1], device=device)[None]
        out = self.model(
            decoder_input_ids=canvas, cache=self.cache, self_conditioning_logits=sc, decoder_position_ids=positions
        )
        return out.logits.float().cpu().numpy()

    def layer_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        entry = self.cache.layers[layer]
        return entry.keys.float().cpu().numpy(), entry.values.float().cpu().numpy()
