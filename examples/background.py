"""Generation on a background thread, the way a desktop app embeds it: the UI thread stays free,
receives each committed canvas (and each denoising step, for a progress bar) through callbacks,
and can cancel between canvases.

    python examples/background.py
"""

import queue
import threading

from mlx_dgemma import load, stream_generate
from mlx_dgemma.generate import DEMO_MODEL


class Generation:
    """One answer being written on a worker thread; ``events`` carries what the UI shows."""

    def __init__(self, model, tokenizer, prompt: str, max_tokens: int = 96):
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(model, tokenizer, prompt, max_tokens), daemon=True)
        self.thread.start()

    def cancel(self):
        self.cancelled.set()  # honoured when the current canvas commits

    def _run(self, model, tokenizer, prompt, max_tokens):
        try:
            on_step = lambda draft: self.events.put(("step", draft.step))  # noqa: E731
            for response in stream_generate(model, tokenizer, prompt, max_tokens, seed=0, on_step=on_step):
                self.events.put(("canvas", response.text))
                if self.cancelled.is_set():
                    self.events.put(("done", "cancelled"))
                    return
            self.events.put(("done", response.finish_reason))
        except Exception as error:  # bad input arrives as a one-line ValueError: show it, don't crash the UI
            self.events.put(("error", str(error)))


def show(generation: Generation) -> str:
    """The UI loop: draw what arrives until the generation ends; returns how it ended."""
    text, steps = "", 0
    while True:
        kind, value = generation.events.get()
        if kind == "step":
            steps += 1
        elif kind == "canvas":
            text += value
            print(f"  canvas committed after {steps} denoising steps so far: {text!r}")
        else:
            print(f"  {kind}: {value}")
            return value


def main():
    model, tokenizer = load(DEMO_MODEL)
    print("a whole answer:")
    show(Generation(model, tokenizer, "json: name=ada age=36 city=rome color=red"))
    print("cancelled after its first canvas:")
    generation = Generation(model, tokenizer, "json: name=bob age=41 city=oslo color=blue")
    generation.cancel()
    show(generation)
    print("bad input, reported to the UI:")
    show(Generation(model, tokenizer, "   "))


if __name__ == "__main__":
    main()
