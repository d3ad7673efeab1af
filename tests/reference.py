"""Running the transformers reference the way generate() does, for parity tests."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

_models: dict[str, DiffusionGemmaForBlockDiffusion] = {}


def load_reference(path, dtype: torch.dtype = torch.float32) -> DiffusionGemmaForBlockDiffusion:
    key = (str(path), dtype)
    if key not in _models:
        _models[key] = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=dtype).eval()
    return _models[key]


class ReferenceSession:
    """Encoder cache plus denoising forwards, positions as in the reference generate loop."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion):
        self.model = model
        self.cache = DynamicCache(config=model.config.text_config)
        self.length = 0

    @torch.no_grad()
    def encode(self, ids) -> None:
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long).reshape(1, -1)
        positions = torch.arange(self.length, self.length + ids.shape[1])[None]
        self.model.model.encoder(input_ids=ids, cache=self.cache, position_ids=positions)
        self.length += ids.shape[1]

    @torch.no_grad()
    def denoise(self, canvas, self_conditioning=None) -> np.ndarray:
        canvas = torch.as_tensor(np.asarray(canvas), dtype=torch.long).reshape(1, -1)
        sc = None
        if self_conditioning is not None:
            dtype = self.model.model.decoder.embed_tokens.weight.dtype
            sc = torch.as_tensor(np.asarray(self_conditioning)).to(dtype)
        positions = torch.arange(self.length, self.length + canvas.shape[1])[None]
        out = self.model(decoder_input_ids=canvas, cache=self.cache, self_conditioning_logits=sc,
                         decoder_position_ids=positions)
        return out.logits.float().numpy()

    def layer_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        entry = self.cache.layers[layer]
        return entry.keys.float().numpy(), entry.values.float().numpy()
