"""Tokenizer files for test checkpoints, in the demo model's format: the character-level sentencepiece
model that checkpoint_tools/train_demo.py trains (``tokenizer.model`` + ``tokenizer_config.json`` with its chat
template), and the same vocabulary as a ``tokenizer.json`` for the ``tokenizers`` backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from checkpoint_tools import train_demo

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + train_demo.CHAT_TOKENS


def train_sentencepiece(folder: Path) -> Path:
    """The demo's sentencepiece model (≈330 pieces: fits the random checkpoints' 397-token vocabulary)."""
    return Path(train_demo.train_tokenizer(str(folder), seed=0))


def write_sentencepiece(folder: Path, model_file: Path, chat_template: str | None = train_demo.CHAT_TEMPLATE) -> None:
    shutil.copyfile(model_file, Path(folder) / "tokenizer.model")
    config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
    }
    if chat_template:
        config["chat_template"] = chat_template
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))


def write_tokenizer_json(folder: Path, model_file: Path, extra: dict[str, int] | None = None) -> None:
    """The sentencepiece vocabulary as a Gemma-style ``tokenizer.json`` (same ids), no chat template;
    ``extra`` adds special tokens at given ids (e.g. the image tokens at the top of the vocabulary)."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    vocab.update(extra or {})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in SPECIAL + list(extra or {})])
    tok.save(str(Path(folder) / "tokenizer.json"))
