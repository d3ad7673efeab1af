"""Fine-tuning data: mlx-lm's ``train.jsonl`` / ``valid.jsonl`` / ``test.jsonl`` → examples → batches.

One JSON object per line, in one of mlx-lm's forms::

    {"messages": [{"role": "user", "content": "upper: abc"}, {"role": "assistant", "content": "ABC"}]}
    {"prompt": "upper: abc", "completion": "ABC"}
    {"text": "any text"}

Chat and completions: the prompt is every message but the last through the chat template with the
generation prompt, the answer is the last (assistant) message followed by the end-of-turn token.
Text: ``<bos>`` alone is the prompt and the whole text, ending with ``<eos>``, is the answer. The
answer is what the decoder learns to denoise, canvas by canvas; ``mask_prompt`` keeps the prompt
out of the encoder's causal-LM loss as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import DataError
from ..tokenizer import Tokenizer
from .objective import Batch, Example, collate

SPLITS = ("train", "valid", "test")
END_OF_TURN = "<turn|>"


def _messages(record: dict, where: str) -> list[dict]:
    if "messages" in record:
        messages = record["messages"]
        if (
            not isinstance(messages, list)
            or len(messages) < 2
            or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
        ):
            raise DataError(f"{where}: 'messages' must be a list of at least two {{role, content}} messages")
        if messages[-1].get("role") != "assistant":
            raise DataError(
                f"{where}: the last message must be the assistant's answer "
                f"(role 'assistant', not {messages[-1].get('role')!r})"
            )
        return messages
    if not (isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str)):
        raise DataError(
            f"{where}: expected 'messages', 'prompt' and 'completion', or 'text' (found keys {sorted(record)})"
        )
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def make_example(record, tokenizer: Tokenizer, where: str, mask_prompt: bool = False) -> Example:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
        if mask_prompt:
            raise DataError(f"{where}: --mask-prompt needs chat or completions data; a text sample has no prompt")
        answer = tokenizer.encode(record["text"], add_special_tokens=False) + [tokenizer.stop_ids[0]]
        return Example([tokenizer.bos_token_id], answer)
    messages = _messages(record, where)
    prefix = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
    end = tokenizer.token_id(END_OF_TURN)
    answer = tokenizer.encode(messages[-1]["content"].strip(), add_special_tokens=False)
    return Example(prefix, answer + [tokenizer.stop_ids[0] if end is None else end], mask_prompt)


def load_split(
    path: Path, tokenizer: Tokenizer, canvas_length: int, max_length: int, mask_prompt: bool = False
) -> list[Example]:
    """Every line of one ``.jsonl`` file as an example; the first bad line is a ``DataError``."""
    examples = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        example = make_example(record, tokenizer, where, mask_prompt)
        if (n := example.length(canvas_length)) > max_length:
            raise DataError(
                f"{where}: the sample takes {n} positions (prompt {len(example.prefix)} + "
                f"{example.canvases(canvas_length)} canvases of {canvas_length}), more than the "
                f"context of {max_length} (--max-seq-length)"
            )
        examples.append(example)
    if not examples:
        raise DataError(f"{path} has no samples; put one JSON object per line")
    return examples


def load_dataset(
    folder: str | Path,
    tokenizer: Tokenizer,
    canvas_length: int,
    max_length: int,
    splits=SPLITS,
    mask_prompt: bool = False,
) -> dict[str, list[Example]]:
    """The named splits of a data folder; each must be there."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data folder {folder} does not exist; it holds train.jsonl, valid.jsonl, test.jsonl")
    out = {}
    for split in splits:
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            raise DataError(f"{path} is missing; --train needs train.jsonl and valid.jsonl, --test test.jsonl")
        out[split] = load_split(path, tokenizer, canvas_length, max_length, mask_prompt)
    return out


def iterate_batches(
    examples: list[Example],
    batch_size: int,
    canvas_length: int,
    pad_id: int,
    rng: np.random.Generator | None = None,
    loop: bool = False,
) -> Iterator[Batch]:
    """Batches of up to ``batch_size`` examples of one canvas count (no compute on unscored
    canvases), shuffled by ``rng`` each pass (in file order without one)."""
    buckets: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        buckets.setdefault(e.canvases(canvas_length), []).append(i)
    while True:
        batches = []
        for indexes in buckets.values():
            order = rng.permutation(indexes) if rng is not None else indexes
            batches += [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        for chosen in batches:
            yield collate([examples[i] for i in chosen], canvas_length, pad_id)
        if not loop:
            return
