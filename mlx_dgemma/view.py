"""A live terminal view of a canvas settling, step by step.

On a terminal the current draft (the step's argmax canvas) is drawn right after the committed text
and redrawn in place every step: positions whose token the sampler accepted this step in bold green,
positions that kept last step's token plain, positions still changing dim, and positions that are
fixed (a template's clamped text, or settled and frozen by the fast policy) underlined blue. A status line gives the
step, the accepted count and the mean entropy. When the canvas commits, the draft is replaced by the
committed text. Elsewhere (a pipe, a file) each step is one plain line.
"""

from __future__ import annotations

import shutil
import sys

from .engine.sampler import Draft

ACCEPTED, SETTLED, CHANGING, STATUS, RESET = "\x1b[1;32m", "", "\x1b[2m", "\x1b[36m", "\x1b[0m"
FIXED = "\x1b[4;34m"
SAVE, RESTORE_AND_CLEAR = "\x1b7", "\x1b8\x1b[J"


def _visible(text: str) -> str:
    """One glyph per control character (and for an id without text), so a draft keeps its shape."""
    if not text:
        return "·"
    return "".join("⏎" if c == "\n" else "⇥" if c == "\t" else "·" if ord(c) < 32 else c for c in text)


class TerminalView:
    def __init__(self, tokenizer, steps: int, stream=None, ansi: bool | None = None):
        self.tokenizer = tokenizer
        self.steps = steps
        self.stream = stream or sys.stdout
        self.ansi = self.stream.isatty() if ansi is None else ansi
        self.canvas = 1
        self.previous: list[int] | None = None
        self.column = 0  # where the committed text ends on its last line
        self.drawn = False

    def step(self, draft: Draft) -> None:
        pieces = [_visible(self.tokenizer.piece(int(t))) for t in draft.tokens]
        status = (
            f"canvas {self.canvas} · step {draft.step}/{self.steps} · "
            f"{sum(draft.accepted)}/{len(pieces)} accepted · mean entropy {draft.mean_entropy:.3f}"
        )
        if draft.fixed is not None:
            status += f" · {sum(draft.fixed)} fixed"
        if self.ansi:
            self._redraw(pieces, draft, status)
        else:
            self.stream.write(f"[{status}] {''.join(pieces)}\n")
        self.previous = draft.tokens
        self.stream.flush()

    def commit(self, text: str) -> None:
        """The canvas is done: its text replaces the draft."""
        if self.ansi:
            self._clear()
            self.stream.write(text)
            last_line = text.rsplit("\n", 1)[-1]
            self.column = len(last_line) if "\n" in text else self.column + len(last_line)
        else:
            self.stream.write(f"[canvas {self.canvas} committed] {text}\n")
        self.stream.flush()
        self.canvas += 1
        self.previous = None

    def _redraw(self, pieces: list[str], draft: Draft, status: str) -> None:
        self._clear()
        width = max(shutil.get_terminal_size().columns, 20)
        column = self.column % width
        # Make room first, so drawing cannot scroll the screen under the saved cursor position.
        rows = (column + sum(map(len, pieces))) // width + 1 + len(status) // width
        self.stream.write("\n" * rows + f"\x1b[{rows}A\r" + (f"\x1b[{column}C" if column else "") + SAVE)
        for i, piece in enumerate(pieces):
            if draft.fixed is not None and draft.fixed[i]:
                style = FIXED
            elif draft.accepted[i]:
                style = ACCEPTED
            elif self.previous is not None and self.previous[i] == draft.tokens[i]:
                style = SETTLED
            else:
                style = CHANGING
            self.stream.write(f"{style}{piece}{RESET}" if style else piece)
        self.stream.write(f"\n{STATUS}{status}{RESET}")
        self.drawn = True

    def _clear(self) -> None:
        if self.drawn:
            self.stream.write(RESTORE_AND_CLEAR)
            self.drawn = False

    def close(self) -> None:
        if self.ansi:
            self._clear()
            self.stream.write("\n")
        self.stream.flush()
