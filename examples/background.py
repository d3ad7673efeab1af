"""Generation on a background thread, the way a desktop app embeds it: one long-lived worker owns
the model, the UI thread stays free, receives each committed canvas (and each denoising step, for a
progress bar) through a queue, and can cancel between canvases. (One worker for the app's lifetime,
not a thread per answer: MLX 0.32 on Linux may abort at exit after a thread that ran the model ended.)

    python examples/background.py
"""

import queue
import threading

from mlx_dgemma import load, stream_generate
from mlx_dgemma.generate import DEMO_MODEL


class Generation:
    """One answer: ``events`` carries what the UI shows; ``cancel`` is honoured when a canvas commits."""

    def __init__(self, prompt: str, max_tokens: int = 96):
        self.prompt, self.max_tokens = prompt, max_tokens
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


class Worker:
    """The thread that owns the model and writes the answers asked of it, one after another."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def submit(self, prompt: str) -> Generation:
        generation = Generation(prompt)
        self.jobs.put(generation)
        return generation

    def _serve(self):
        while True:
            self._write(self.jobs.get())

    def _write(self, job: Generation):
        try:
            on_step = lambda draft: job.events.put(("step", draft.step))  # noqa: E731
            for response in stream_generate(
                self.model, self.tokenizer, job.prompt, job.max_tokens, seed=0, on_step=on_step
            ):
                job.events.put(("canvas", response.text))
                if job.cancelled.is_set():
                    job.events.put(("done", "cancelled"))
                    return
            job.events.put(("done", response.finish_reason))
        except Exception as error:  # bad input arrives as a one-line ValueError: show it, don't crash the UI
            job.events.put(("error", str(error)))


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
    worker = Worker(*load(DEMO_MODEL))
    print("a whole answer:")
    show(worker.submit("json: name=ada age=36 city=rome color=red"))
    print("cancelled after its first canvas:")
    generation = worker.submit("json: name=bob age=41 city=oslo color=blue")
    generation.cancel()
    show(generation)
    print("bad input, reported to the UI:")
    show(worker.submit("   "))


if __name__ == "__main__":
    main()
