"""The checkpoint's tokenizer: ``tokenizer.json`` through ``tokenizers`` (sentencepiece
``tokenizer.model`` as the fallback), the Gemma 4 chat template, and output clean-up (cut at the stop
ids, drop padding and ``<|channel>…<channel|>`` thought scaffolding).

A checkpoint without tokenizer files still loads: prompts must then be token ids, and text is the
ids written out as numbers.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from .chat_template import RenderLimit, render
from .errors import TokenizerError
from .model.config import GenerationConfig, ModelConfig
from .model.images import IMAGE_PLACEHOLDER
from .model.video import VIDEO_PLACEHOLDER

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"
THINK = "<|think|>"  # what Gemma 4's template writes into the system turn to switch thinking on

# Gemma 4's chat format, used when the checkpoint ships no template. Content is text, or a list of
# parts where an image (video) part is the image (video) placeholder, written inline as Gemma 4's template does.
# Thinking is Gemma 4's switch: ``enable_thinking`` opens the system turn with ``<|think|>`` (a system
# turn of its own when the conversation has none) and leaves the model's turn open for its thought;
# without it the generation prompt ends with an empty thought channel, and the model answers at once.
BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- if thinking and messages[0]['role'] != 'system' -%}{{ '<|turn>system\n"
    + THINK
    + "\n<turn|>\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\n' }}"
    "{%- if thinking and loop.first and role == 'system' -%}{{ '" + THINK + "\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{%- elif item['type'] == 'video' -%}{{ '" + VIDEO_PLACEHOLDER + "' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}"
    "{%- if not thinking -%}{{ '<|channel>thought\n<channel|>' }}{%- endif -%}{%- endif -%}"
)


class _TokenizersBackend:
    """``tokenizer.json``; added (special) tokens written in the text are matched as tokens."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        self.size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def piece(self, token: int) -> str | None:
        return self._tok.id_to_token(token)

    def token_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)


class _SentencePieceBackend:
    """``tokenizer.model``. SentencePiece never reads control symbols (``<bos>``, ``<pad>``, …) out
    of text, so the text is split on them first."""

    def __init__(self, path: Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.size = self._sp.get_piece_size()
        self._control = {self._sp.id_to_piece(i): i for i in range(self.size) if self._sp.is_control(i)}
        pattern = "|".join(re.escape(p) for p in sorted(self._control, key=len, reverse=True) if p)
        self._split = re.compile(f"({pattern})") if pattern else None

    def encode(self, text: str) -> list[int]:
        chunks = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for i, chunk in enumerate(chunks):
            if i % 2:  # the separators captured by the split
                ids.append(self._control[chunk])
            elif chunk:
                ids.extend(self._sp.encode(chunk))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def piece(self, token: int) -> str | None:
        return self._sp.id_to_piece(token)

    def token_id(self, piece: str) -> int | None:
        token = self._sp.piece_to_id(piece)
        return None if token == self._sp.unk_id() and piece != self._sp.id_to_piece(token) else token


class Tokenizer:
    def __init__(
        self,
        backend=None,
        stop_ids=(1,),
        pad_token_id: int = 0,
        bos_token_id: int = 2,
        chat_template: str | None = None,
        add_bos_token: bool = True,
        generation_config: GenerationConfig | None = None,
        image_token_id: int | None = None,
    ):
        self._backend = backend
        self.stop_ids = list(stop_ids)
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template or BUILTIN_CHAT_TEMPLATE
        self.add_bos_token = add_bos_token
        # The checkpoint's generation_config.json: loader.load() hands only this module the folder.
        self.generation_config = generation_config or GenerationConfig(eos_token_id=self.stop_ids)
        self._thought = (self.token_id(THOUGHT_OPEN), self.token_id(THOUGHT_CLOSE))
        # The model's image token, for a vocabulary that does not spell it (a text-only tokenizer
        # given to a vision checkpoint): the placeholder a template writes is then that id.
        self._image = image_token_id if backend is not None and self.token_id(IMAGE_PLACEHOLDER) is None else None

    @property
    def has_vocabulary(self) -> bool:
        return self._backend is not None

    # Kept for code written against the placeholder tokenizer.
    @property
    def eos_token_ids(self) -> list[int]:
        return self.stop_ids

    def token_id(self, piece: str) -> int | None:
        return self._backend.token_id(piece) if self._backend else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<bos>``, ``<|turn>``…) become their
        ids, and so does the image placeholder (the model's image token) where the vocabulary lacks it.
        ``add_special_tokens`` prepends ``<bos>`` (as Gemma's tokenizer does) unless it is there."""
        if self._backend is None:
            raise TokenizerError(
                "this checkpoint has no tokenizer files (tokenizer.json or tokenizer.model); "
                "pass the prompt as token ids"
            )
        ids = self._encode_images(text) if self._image is not None else self._backend.encode(text)
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _encode_images(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
            ids += ([self._image] if i else []) + (self._backend.encode(chunk) if chunk else [])
        return ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._backend is None:
            return " ".join(str(i) for i in ids)
        # A model's vocabulary may be padded past the tokenizer's; those ids have no text.
        return self._backend.decode([i for i in ids if 0 <= i < self._backend.size])

    def piece(self, token: int) -> str:
        """The vocabulary entry of one id, word boundaries (▁) as spaces: for live views."""
        if self._backend is None:
            return f"{token} "
        piece = self._backend.piece(int(token)) if 0 <= token < self._backend.size else None
        return "" if piece is None else piece.replace("▁", " ")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True, **kwargs
    ):
        """The conversation through the chat template: token ids, or with ``tokenize=False`` the text
        (as transformers' and mlx-lm's tokenizers do). Either may be given to ``generate`` as the prompt:
        text that starts as the template's does is not templated again (``carries_chat_template``)."""
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self._special_text(self.bos_token_id),
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def carries_chat_template(self, text: str) -> bool:
        """Whether ``text`` is already a rendered conversation: it starts with ``<bos>`` or with the
        chat template's opening of a turn (``<|turn>`` on Gemma 4), as mlx-lm checks for ``<bos>``."""
        bos = self._special_text(self.bos_token_id)
        if self.has_vocabulary and bos and text.startswith(bos):
            return True
        opener = _turn_opener(self.chat_template, bos)
        return bool(opener) and text.startswith(opener)

    @property
    def renders_thinking(self) -> bool:
        """Whether the chat template has Gemma 4's thinking switch (renders ``enable_thinking``)."""
        return chat_template_renders_thinking(self.chat_template)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template writes a request's tools into the prompt (the demo's never does:
        tools sent to it are text the model does not see)."""
        return chat_template_renders_tools(self.chat_template)

    def clean(self, ids, stop_ids=None) -> list[int]:
        """What a reader should see: ids before the first stop id, without padding or ``<bos>`` and
        without ``<|channel>…<channel|>`` spans (an unclosed one hides everything after it)."""
        stops = set(self.stop_ids if stop_ids is None else stop_ids)
        hidden = {self.pad_token_id, self.bos_token_id}
        opener, closer = self._thought
        out: list[int] = []
        in_thought = False
        for token in (int(i) for i in ids):
            if token in stops:
                break
            if in_thought:
                in_thought = token != closer
            elif opener is not None and token == opener:
                in_thought = True
            elif token not in hidden:
                out.append(token)
        return out

    def decode_clean(self, ids, stop_ids=None) -> str:
        return self.decode(self.clean(ids, stop_ids))

    def thought_tokens(self, ids, stop_ids=None) -> int:
        """How many of the ids before the first stop id are thought: what ``clean`` hides of them but
        padding and ``<bos>`` (the ``<|channel>…<channel|>`` spans, their markers included)."""
        stops = set(self.stop_ids if stop_ids is None else stop_ids)
        hidden = {self.pad_token_id, self.bos_token_id}
        shown = 0
        for token in (int(i) for i in ids):
            if token in stops:
                break
            shown += token not in hidden
        return shown - len(self.clean(ids, stops))

    def decode_thought(self, ids, stop_ids=None) -> str:
        """The text ``clean`` hides: the inside of each ``<|channel>name\n…<channel|>`` span before the
        first stop id, without the channel's name line (an unclosed span counts up to the end)."""
        stops = set(self.stop_ids if stop_ids is None else stop_ids)
        hidden = {self.pad_token_id, self.bos_token_id}
        opener, closer = self._thought
        spans: list[list[int]] = []
        in_thought = False
        for token in (int(i) for i in ids):
            if token in stops:
                break
            if in_thought and token == closer:
                in_thought = False
            elif in_thought and token not in hidden:
                spans[-1].append(token)
            elif opener is not None and token == opener:
                in_thought = True
                spans.append([])
        texts = [self.decode(span) for span in spans]
        return "".join(text.partition("\n")[2] for text in texts)

    def _special_text(self, token: int) -> str:
        piece = self._backend.piece(token) if self._backend else None
        return piece or ""


class TextStream:
    """The clean text (or with ``thought=True`` the thought channel's) of a growing token sequence,
    handed out as it grows. An incomplete UTF-8
    character at the end is held back until the next piece completes it (or ``final``)."""

    def __init__(self, tokenizer: Tokenizer, stop_ids=None, thought: bool = False):
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.decode = (
            tokenizer.decode_thought if thought else tokenizer.decode_clean
        )  # the thought channel, or the answer
        self.tokens: list[int] = []
        self.text = ""

    def add(self, ids, final: bool = False) -> str:
        self.tokens.extend(int(i) for i in ids)
        text = self.decode(self.tokens, self.stop_ids)
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.text):
            return ""
        new, self.text = text[len(self.text) :], text
        return new


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    render_limit: RenderLimit = RenderLimit(),
    **context,
) -> str:
    """Render a Hugging Face chat template the way transformers does (sandboxed jinja2, trimmed blocks),
    within ``render_limit``'s seconds and characters (chat_template.py: ``RenderLimitError`` past them)."""
    return render(template, render_limit, messages=messages, add_generation_prompt=add_generation_prompt, **context)


@functools.lru_cache(maxsize=8)
@functools.lru_cache(maxsize=8)
def _turn_opener(template: str, bos: str) -> str:
    """What ``template`` writes before the role of a user turn (after ``<bos>``): ``<|turn>`` on Gemma 4;
    empty where it writes the role first or cannot render."""
    try:
        text = render_chat_template(template, [{"role": "user", "content": "x"}], False, bos_token=bos)
    except Exception:  # (jinja's errors, whatever their class): the request's own render reports it
        return ""
    text = text.removeprefix(bos)
    return text[: text.find("user")] if "user" in text else ""


def chat_template_renders_tools(template: str) -> bool:
    """Whether ``template`` renders a conversation differently when it is given a tool."""
    messages = [{"role": "user", "content": "x"}]
    tool = {
        "type": "function",
        "function": {"name": "probe", "description": "a tool", "parameters": {"type": "object", "properties": {}}},
    }
    try:
        return render_chat_template(template, messages, tools=[tool]) != render_chat_template(template, messages)
    except Exception:  # a template that cannot take this conversation or these tools: none rendered here
        return False


@functools.lru_cache(maxsize=8)
def chat_template_renders_thinking(template: str) -> bool:
    """Whether ``template`` renders a conversation differently with ``enable_thinking``."""
    messages = [{"role": "user", "content": "x"}]
    try:
        return render_chat_template(template, messages, enable_thinking=True) != render_chat_template(
            template, messages, enable_thinking=False
        )
    except Exception:  # a template that cannot take this conversation: no switch seen
        return False


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise TokenizerError(f"{path} is not UTF-8 text; re-export it") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path} must be a JSON object, got {type(raw).__name__}")
    return raw


def _chat_template(folder: Path, settings: dict) -> str | None:
    """The checkpoint's template: chat_template.jinja, chat_template.json or tokenizer_config.json."""
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    template = _read_json(folder / "chat_template.json").get("chat_template") or settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _backend(folder: Path):
    if (folder / "tokenizer.json").exists():
        return _TokenizersBackend(folder / "tokenizer.json")
    if (folder / "tokenizer.model").exists():
        return _SentencePieceBackend(folder / "tokenizer.model")
    return None


def load_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    folder = Path(folder)
    settings = _read_json(folder / "tokenizer_config.json")
    generation = GenerationConfig.from_folder(folder, config)
    try:
        backend = _backend(folder)
    except Exception as e:  # tokenizers / sentencepiece raise bare exceptions on damaged files
        reason = str(e).splitlines()[0] if str(e) else repr(e)
        raise TokenizerError(f"cannot read the tokenizer in {folder}: {reason}") from None
    return Tokenizer(
        backend,
        stop_ids=generation.eos_token_id,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        chat_template=_chat_template(folder, settings),
        add_bos_token=bool(settings.get("add_bos_token", True)),
        generation_config=generation,
        image_token_id=config.image_token_id if config.image_token_id < config.vocab_size else None,
    )
