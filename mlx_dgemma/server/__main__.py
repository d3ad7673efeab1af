"""``python -m mlx_dgemma.server``: serve a model (the bundled demo without --model) over OpenAI's,
Anthropic's and Ollama's APIs.

SIGTERM or Ctrl-C: no new connections; requests in flight get ``--shutdown-grace`` seconds to finish,
then end with a 503 ("shutting down") and the process exits. A second signal exits at once."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import click

from ..cli import kv_cache_options, sampling_options
from ..demo import DEMO_MODEL
from ..options import MAX_PREFILL_STEP_SIZE, PREFILL_STEP_SIZE, KVQuantization
from ..validate import MAX_STEPS, shown_json
from .app import MAX_IMAGES, MAX_REQUEST_BYTES, MAX_REQUEST_PIXELS
from .routes import ALLOWED_ORIGINS, create_app

SHUTDOWN_GRACE = 3.0  # seconds requests in flight get to finish after SIGTERM
POSITIVE = click.IntRange(min=1)
# The chat template's arguments the server sets itself for every request (and the renderer's own).
OWN_TEMPLATE_ARGS = ("messages", "add_generation_prompt", "tools", "tokenize", "bos_token", "template")
SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "min_p": "--min-p", "top_k": "--top-k"}


def _chat_template_args(context, parameter, value: str) -> dict:
    try:
        args = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(args, dict):
        raise click.BadParameter(f"must be a JSON object such as '{{\"enable_thinking\": true}}', not {value[:40]}")
    if own := [name for name in OWN_TEMPLATE_ARGS if name in args]:
        raise click.BadParameter(f"{own[0]} is set by each request; leave it out")
    if not isinstance(args.get("enable_thinking", False), bool):
        raise click.BadParameter(f"enable_thinking must be true or false, not {shown_json(args['enable_thinking'])}")
    return args


def _chat_template(context, parameter, value: str | None) -> str | None:
    """mlx-lm's rule: a path names a file holding the template; any other value is the template itself
    (one without a Jinja tag or expression is taken for a path that names no file)."""
    if value is None:
        return None
    try:
        is_file = "\n" not in value and Path(value).expanduser().is_file()
    except (OSError, ValueError):  # (a name too long for the filesystem, a NUL)
        is_file = False
    if is_file:
        try:
            return Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.BadParameter(f"cannot read {value}: {e}") from None
    if "{{" not in value and "{%" not in value:
        raise click.BadParameter(f"no file {value[:100]}, and as a template it has no {{{{ }}}} or {{% %}}")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", help=f"Checkpoint folder or Hugging Face Hub id [default: the bundled demo, {DEMO_MODEL}]")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option(
    "--allowed-origins",
    default=",".join(ALLOWED_ORIGINS),
    callback=lambda c, p, v: [origin.strip() for origin in v.split(",") if origin.strip()],
    help="Comma-separated origins whose browser pages may call the server (CORS), besides local ones "
    "(localhost, 127.0.0.1, [::1], 0.0.0.0 at any port); * lets a page of any site read every answer "
    "[default: local origins alone].",
)
@click.option("--adapter-path", help="Adapters of a fine-tuning run (python -m mlx_dgemma.lora) to apply.")
@sampling_options
@click.option(
    "--chat-template",
    default=None,
    callback=_chat_template,
    help="A chat template (Jinja, as in a Hugging Face tokenizer_config.json) in place of the checkpoint's: "
    "a file's path, or the template itself.",
)
@click.option(
    "--chat-template-args",
    default="{}",
    show_default=True,
    callback=_chat_template_args,
    help="JSON object of arguments for the chat template, e.g. '{\"enable_thinking\": true}' (thinking "
    "on unless a request turns it off).",
)
@click.option(
    "--max-tokens", type=POSITIVE, help="Default max_tokens of a request [default: the checkpoint's max_new_tokens]."
)
@click.option(
    "--max-steps",
    default=MAX_STEPS,
    show_default=True,
    type=click.IntRange(1, MAX_STEPS),
    help="Most denoising steps a request may ask for (each is a forward of the decoder).",
)
@click.option(
    "--prompt-cache-size",
    default=10,
    show_default=True,
    type=click.IntRange(min=0),
    help="Prompt KV caches kept for reuse (least recently used dropped first).",
)
@click.option(
    "--prefill-step-size",
    default=PREFILL_STEP_SIZE,
    show_default=True,
    type=click.IntRange(1, MAX_PREFILL_STEP_SIZE),
    help="Prompt tokens encoded per forward.",
)
@kv_cache_options
@click.option(
    "--max-request-bytes",
    default=MAX_REQUEST_BYTES,
    show_default=True,
    type=POSITIVE,
    help="Largest request body accepted (bigger ones get 413).",
)
@click.option(
    "--max-images",
    default=MAX_IMAGES,
    show_default=True,
    type=click.IntRange(min=0),
    help="Image parts accepted in one request.",
)
@click.option(
    "--max-image-pixels",
    default=MAX_REQUEST_PIXELS,
    show_default=True,
    type=POSITIVE,
    help="Pixels of a request's images together (read from their headers before decoding).",
)
@click.option(
    "--allowed-image-dir",
    type=click.Path(exists=True, file_okay=False, resolve_path=True),
    help="Folder whose image and video files an image_url or video_url may name by path or file:// URL "
    "[default: none; only data URLs].",
)
@click.option(
    "--shutdown-grace",
    default=SHUTDOWN_GRACE,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds requests in flight get to finish after SIGTERM before they end with a 503.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"], case_sensitive=False),
    help="Log level: info logs each request uvicorn answers and each refusal with its reason and the "
    "field behind it, debug each request's body in outline as it arrives.",
)
@click.option(
    "--ignore-memory-check",
    is_flag=True,
    help="Load the model even where the weights, a canvas and one "
    "answer's KV cache need more memory than the device can give.",
)
def main(
    model,
    host,
    port,
    allowed_origins,
    adapter_path,
    temperature,
    top_p,
    min_p,
    top_k,
    chat_template,
    chat_template_args,
    max_tokens,
    max_steps,
    prompt_cache_size,
    prefill_step_size,
    kv_bits,
    kv_group_size,
    quantized_kv_start,
    max_request_bytes,
    max_images,
    max_image_pixels,
    allowed_image_dir,
    shutdown_grace,
    log_level,
    ignore_memory_check,
):
    """Serve a DiffusionGemma model over OpenAI's (chat, completions, Responses), Anthropic's and Ollama's APIs."""
    import uvicorn

    from ..loader import load
    from ..memory import check_memory
    from ..tokenizer import render_chat_template
    from . import request_log
    from .api import BadRequest
    from .app import Limits, Server
    from .heap import keep_large_blocks_mapped
    from .scheduler import Scheduler

    kv = None if kv_bits is None else KVQuantization(kv_bits, kv_group_size, quantized_kv_start)
    try:
        if not ignore_memory_check:
            check_memory(model or DEMO_MODEL, max_tokens=max_tokens, kv_bits=kv_bits)
        dgemma, tokenizer = load(model or DEMO_MODEL, adapter_path=adapter_path)
        if chat_template is not None:
            try:
                render_chat_template(chat_template, [{"role": "user", "content": "x"}])  # (within RENDER_SECONDS)
            except Exception as e:  # (jinja's syntax and render errors and the render's limits, whatever their class)
                raise ValueError(
                    f"--chat-template cannot render a conversation: {' '.join(str(e).split())[:200]}"
                ) from None
            tokenizer.chat_template = chat_template
        if chat_template_args.get("enable_thinking") and not tokenizer.renders_thinking:
            raise ValueError(
                "--chat-template-args: this model's chat template has no thinking switch "
                "(enable_thinking); leave it out"
            )
        if kv is not None:
            kv.check([dgemma.config.layer_head_dim(i) for i in range(dgemma.config.num_hidden_layers)])
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    keep_large_blocks_mapped()
    scheduler = Scheduler(
        dgemma, tokenizer, prompt_cache_size=prompt_cache_size, prefill_step_size=prefill_step_size, kv_quantization=kv
    )
    limits = Limits(max_tokens, max_request_bytes, max_images, max_image_pixels, allowed_image_dir, max_steps)
    options = {
        name: value
        for name, value in dict(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k).items()
        if value is not None
    }
    try:
        server = Server(dgemma, tokenizer, model or "mlx-dgemma-demo", scheduler, limits, options, chat_template_args)
    except BadRequest as e:  # a default a request could not send either (--temp 3: over OpenAI's 2)
        raise click.ClickException(f"{SAMPLING_FLAGS.get(e.param, e.param)}: {e}") from None

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit:  # the second signal
                os._exit(128 + sig)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            import asyncio

            asyncio.get_running_loop().call_later(shutdown_grace, scheduler.close)  # in-flight requests: 503
            await super().shutdown(sockets)

    # The server's own log (request_log.py) beside uvicorn's: refusals at info, every request at debug.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    request_log.log.addHandler(handler)
    request_log.log.setLevel(log_level.upper())
    app = create_app(server, allowed_origins, bind_host=host)
    Uvicorn(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()
    # MLX 0.32 can abort at interpreter exit once a thread that ran attention on the CPU has ended:
    # everything is answered and closed by now, so the process ends here.
    os._exit(0)


if __name__ == "__main__":
    main()
