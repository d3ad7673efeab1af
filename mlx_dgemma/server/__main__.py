"""``python -m mlx_dgemma.server``: serve a model (the bundled demo without --model) over OpenAI's API."""

from __future__ import annotations

import click

from ..generate import DEMO_MODEL, PREFILL_STEP_SIZE
from .app import MAX_REQUEST_BYTES


def _positive(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"must be at least 1, got {value}")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", help=f"Checkpoint folder or Hugging Face Hub id [default: the bundled demo, {DEMO_MODEL}]")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int, help="Port to listen on.")
@click.option("--max-tokens", type=int, callback=_positive,
              help="Default max_tokens of a request [default: the checkpoint's max_new_tokens].")
@click.option("--prompt-cache-size", default=10, show_default=True, type=click.IntRange(min=0),
              help="Prompt KV caches kept for reuse (least recently used dropped first).")
@click.option("--prefill-step-size", default=PREFILL_STEP_SIZE, show_default=True, type=int, callback=_positive,
              help="Prompt tokens encoded per forward.")
@click.option("--max-request-bytes", default=MAX_REQUEST_BYTES, show_default=True, type=int, callback=_positive,
              help="Largest request body accepted (bigger ones get 413).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn's log level.")
def main(model, host, port, max_tokens, prompt_cache_size, prefill_step_size, max_request_bytes, log_level):
    """Serve a DiffusionGemma model with OpenAI's chat and completions API."""
    import uvicorn

    from ..loader import load
    from .app import Server, create_app
    from .scheduler import Scheduler

    try:
        dgemma, tokenizer = load(model or DEMO_MODEL)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    scheduler = Scheduler(dgemma, tokenizer, prompt_cache_size=prompt_cache_size, prefill_step_size=prefill_step_size)
    server = Server(dgemma, tokenizer, model or "mlx-dgemma-demo", scheduler, max_tokens=max_tokens,
                    max_request_bytes=max_request_bytes)
    uvicorn.run(create_app(server), host=host, port=port, log_level=log_level)


if __name__ == "__main__":
    main()
