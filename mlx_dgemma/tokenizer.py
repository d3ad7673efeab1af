"""Tokenizer loading (placeholder until the sampler issue lands the full chat tokenizer)."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, backend=None, eos_token_ids=(1,)):
        self._backend = backend
        self.eos_token_ids = list(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        if self._backend is None:
            raise ValueError("this checkpoint has no tokenizer files; pass token ids instead of text")
        return self._backend.encode(text).ids

    def decode(self, ids) -> str:
        if self._backend is None:
            return " ".join(str(i) for i in ids)
        return self._backend.decode(list(ids))


def load_tokenizer(folder: Path, config) -> Tokenizer:
    path = Path(folder) / "tokenizer.json"
    backend = None
    if path.exists():
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(path))
    return Tokenizer(backend, config.eos_token_id)
