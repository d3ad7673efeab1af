"""The command line of generation (the mlx-dgemma script): its flags become one
``options.GenerationArgs``, and text appears as each canvas, block or round commits::

    python -m mlx_dgemma.generate --prompt "sort: 42 17 85 23 61" --view

The Python API is api.py (with the engine: engine/resolve.py, engine/request.py, engine/batch.py); its
names are importable from here too, as ``from mlx_dgemma.generate import stream_generate``.
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # a command-line process: the fast BLAS before mlx.core loads

import contextlib
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

import click

from .api import (
    GenerationResponse,
    drafted_json_template,
    generate,
    infill,
    statistics,
    stream_from_args,
    stream_generate,
)
from .cli import command_line, kv_cache_options, sampling_options, several_values
from .demo import DEMO_MODEL
from .engine.batch import prefill
from .engine.policy import POLICIES, Plan
from .engine.request import PreparedRequest, generation_device, plan, prepare
from .engine.resolve import check_prompt_fits, check_template_fits, generation_config, prompt_ids, resolve
from .model.images import load_image
from .model.video import VideoProcessorConfig, load_video
from .options import PREFILL_STEP_SIZE, GenerationArgs, SamplingArgs, check_prefill_step_size, check_schedule_scale
from .structured.template import TemplateError, parse_template
from .validate import (
    MAX_STEPS,
    PromptError,
    at_least,
    check_entropy_bound,
    check_request,
    check_seed,
    check_steps,
    check_temperature,
    check_text,
    decode_utf8,
    option,
    shown,
)

__all__ = [
    "GenerationResponse",
    "PreparedRequest",
    "PREFILL_STEP_SIZE",
    "PromptError",
    "check_prompt_fits",
    "check_template_fits",
    "drafted_json_template",
    "generate",
    "generation_device",
    "infill",
    "main",
    "plan",
    "prefill",
    "prepare",
    "prompt_ids",
    "resolve",
    "stream_generate",
]

DEFAULT_PROMPT = "sort: 42 17 85 23 61"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", help=f"Checkpoint folder or Hugging Face Hub id [default: the bundled demo, {DEMO_MODEL}]")
@click.option(
    "--prompt", "-p", default=DEFAULT_PROMPT, show_default=True, help="Message to the model; '-' reads stdin."
)
@click.option("--system-prompt", help="System message for the chat template.")
@click.option(
    "--max-tokens",
    "-m",
    type=int,
    callback=option(at_least(1)),
    help="Most tokens to print (computed in whole canvases) [default: the checkpoint's max_new_tokens].",
)
@click.option(
    "--steps",
    type=int,
    callback=option(check_steps),
    help=f"Most denoising steps per canvas, 1 to {MAX_STEPS} [default: the checkpoint's].",
)
@click.option(
    "--entropy-bound",
    type=float,
    callback=option(check_entropy_bound),
    help="Entropy bound of the sampler's acceptance (nats).",
)
@click.option(
    "--temp-min", type=float, callback=option(check_temperature), help="Temperature at the last denoising step."
)
@click.option(
    "--temp-max", type=float, callback=option(check_temperature), help="Temperature at the first denoising step."
)
@click.option(
    "--seed", type=int, callback=option(check_seed), help="Seed of the sampler's random draws (0 to 2**64 - 1)."
)
@click.option("--ignore-chat-template", is_flag=True, help="Give the prompt to the model as it is.")
@click.option(
    "--think",
    is_flag=True,
    help="Thinking on (the chat template's switch): the thought goes to stderr as it comes, the answer to stdout.",
)
@click.option(
    "--verbose",
    type=click.BOOL,
    is_flag=False,
    flag_value=True,
    default=False,
    metavar="[BOOL]",
    help="Print statistics after the text: --verbose alone or True, or False (mlx-lm's syntax; T, F, "
    "yes, no, 1, 0 too) [default: False].",
)
@click.option("--view", is_flag=True, help="Show each canvas settling, step by step.")
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default="reference",
    show_default=True,
    help="reference: the generation config; auto: the policy this device runs fastest (measured once, "
    "cached; re-chosen as it generates); fast: settled positions no longer computed, trimmed last "
    "canvas; ar: autoregressive; verified: the decoder drafts, the encoder verifies (AR's output).",
)
@click.option(
    "--draft-length",
    type=int,
    callback=option(at_least(1)),
    help="verified: canvas positions per draft, the known next token included [default: the policy's].",
)
@click.option(
    "--draft-steps",
    type=int,
    callback=option(check_steps),
    help="verified: denoising steps per draft [default: the policy's].",
)
@sampling_options
@click.option(
    "--schedule-scale",
    type=float,
    callback=option(check_schedule_scale),
    help="Factor on the denoising temperature schedule (--temp-min/--temp-max or the checkpoint's).",
)
@click.option(
    "--template",
    "template_file",
    type=click.Path(dir_okay=False),
    help="File with the answer's layout: fixed text and {{fill:N}} holes the model fills "
    "(the file's final newline is not part of it).",
)
@click.option(
    "--prefill-step-size",
    type=int,
    default=PREFILL_STEP_SIZE,
    show_default=True,
    callback=option(check_prefill_step_size),
    help="Prompt tokens encoded per forward (bounds the prefill's peak memory).",
)
@kv_cache_options
@click.option(
    "--schema",
    "schema_file",
    type=click.Path(dir_okay=False),
    help="JSON schema file: the answer is JSON of this schema (structure fixed, values filled in "
    "holes sized by a free draft generated first).",
)
@click.option("--adapter-path", help="Adapters of a fine-tuning run (python -m mlx_dgemma.lora) to apply.")
@click.option(
    "--extra-eos-token",
    "extra_eos_tokens",
    multiple=True,
    metavar="TOKEN",
    help="A token that ends the answer as the checkpoint's end tokens do: one token's text, or a "
    "special token's name (repeatable).",
)
@click.option(
    "--trust-remote-code", is_flag=True, help="Accepted as mlx-lm takes it; no code from the checkpoint runs here."
)
@click.option(
    "--image",
    "image_files",
    cls=several_values(),
    multiple=True,
    metavar="PATH...",
    help="Images to go with the prompt (a checkpoint with a vision tower).",
)
@click.option(
    "--video",
    "video_files",
    cls=several_values(),
    multiple=True,
    metavar="PATH...",
    help="Videos to go with the prompt, after the images: their sampled frames, with their times (docs/vision.md).",
)
@click.option(
    "--video-fps",
    type=float,
    default=None,
    help="Frames per second sampled from each video, up to its frame limit [default: the checkpoint's, else evenly].",
)
@click.option(
    "--ignore-memory-check",
    is_flag=True,
    help="Load the model even where it needs more memory than the device can give (see docs/quantization.md).",
)
@command_line
def main(**flags):
    """Generate text with a DiffusionGemma model; text appears as each canvas is committed."""
    if flags["model"] is None and not DEMO_MODEL.is_dir():
        raise click.ClickException(f"the bundled demo model is not in {DEMO_MODEL}; pass --model PATH")
    if flags["template_file"] and flags["schema_file"]:
        raise click.ClickException("give --template or --schema, not both")
    if flags["extra_eos_tokens"] and (flags["schema_file"] or flags["template_file"]):
        raise click.ClickException(
            "--extra-eos-token ends free text; a schema's or template's answer ends where its layout does: drop one"
        )
    if flags["think"] and flags["schema_file"]:
        raise click.ClickException(
            "a schema lays the answer out from its first token and leaves no room for a "
            "thought; drop --think or --schema"
        )
    if flags["video_fps"] is not None and not flags["video_files"]:
        raise click.ClickException("--video-fps samples the frames of a --video; give one")
    if flags["system_prompt"] is not None and flags["ignore_chat_template"]:
        raise click.ClickException(
            "--system-prompt needs the chat template: drop --ignore-chat-template or put the system text in --prompt"
        )
    from . import distributed

    group = watchdog = None
    if distributed.launched():  # under mlx.launch: one model over every rank; rank 0 prints
        try:
            group = distributed.init()
        except distributed.DistributedError as e:
            raise click.ClickException(str(e)) from None
        if group.size() > 1:
            watchdog = distributed.Watchdog(group.rank(), distributed.timeout_seconds())
            if group.rank() != 0:
                sys.stdout, flags["view"], flags["verbose"] = open(os.devnull, "w"), False, False
        else:
            group = None
    try:
        with watchdog.watching() if watchdog else contextlib.nullcontext():
            responses, canvas_view = _generate_cli(flags, group, watchdog)
    except ValueError as e:  # bad input: checkpoint, prompt or settings; the message says which
        raise click.ClickException(str(e)) from None
    except distributed.DistributedError as e:
        raise click.ClickException(str(e)) from None
    except RuntimeError as e:  # a collective whose peer is gone
        if group is None or (reason := distributed.lost_peer(e)) is None:
            raise
        raise click.ClickException(f"rank {group.rank()}: lost the connection to another rank ({reason})") from None
    if canvas_view:
        canvas_view.close()
    else:
        click.echo()
    if flags["verbose"]:
        click.echo(statistics(responses))
        choices = {id(r.plan): r.plan for r in responses if r.plan.predicted}  # one per canvas, block or round
        if choices:
            click.echo("auto, canvas by canvas, block by block, round by round:")
            click.echo("\n".join(f"  {i}. {plan.choice()}" for i, plan in enumerate(choices.values(), 1)))


def _plan_key(plan: Plan) -> tuple:
    return plan.mode, plan.settings.freeze_after, plan.draft_length, plan.draft_steps


def generation_args(flags: dict, images: list | None) -> GenerationArgs:
    """The flags as the API's options (each option's flag has its name)."""
    sampling = SamplingArgs(**{f.name: flags[f.name] for f in fields(SamplingArgs) if f.name in flags})
    own = {f.name: flags[f.name] for f in fields(GenerationArgs) if f.name in flags}
    return GenerationArgs(**own, chat_template=not flags["ignore_chat_template"], images=images, sampling=sampling)


def _read_prompt(flags: dict) -> str:
    prompt = flags["prompt"]
    if prompt == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        prompt = decode_utf8(stdin.read(), "the prompt on stdin") if stdin else sys.stdin.read()
    check_text(prompt, "--prompt")
    if flags["system_prompt"] is not None:
        check_text(flags["system_prompt"], "--system-prompt")
    check_request(prompt, flags["max_tokens"] or 1, flags["seed"], flags["system_prompt"])  # before the model loads
    return prompt


def _read_videos(flags: dict) -> tuple[list | None, int]:
    """The ``--video`` clips, decoded at the checkpoint's video settings before its weights load (a bad
    file fails first), and the most tokens their frames take (for the memory check)."""
    if not flags["video_files"]:
        return None, 0
    from .loader import checkpoint_folder

    config = VideoProcessorConfig.from_folder(checkpoint_folder(flags["model"] or DEMO_MODEL))
    clips = [load_video(path, config, flags["video_fps"]) for path in flags["video_files"]]
    return clips, sum(clip.most_tokens(config) for clip in clips)


def _token(tokenizer, text: str) -> int:
    """The id of the token ``text`` names: a special token's name (``<turn|>``), or one token's text."""
    if (special := tokenizer.token_id(text)) is not None:
        return special
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"--extra-eos-token {shown(text)} is {len(ids)} tokens, not one; give one token's text "
            "or a special token's name"
        )
    return ids[0]


def _load(flags: dict, group, watchdog):
    from . import distributed
    from .loader import load

    model, adapter_path = flags["model"] or DEMO_MODEL, flags["adapter_path"]
    if group is None:
        return load(model, adapter_path=adapter_path)
    if adapter_path:
        raise ValueError("adapters are not applied to a sharded model yet; merge them first: python -m mlx_dgemma.fuse")
    return distributed.sharded_load(model, group, watchdog)


def _generate_cli(flags: dict, group, watchdog):
    """The CLI's work on one rank: the model (or this rank's share of it), the text as it commits."""
    from dataclasses import replace

    from .memory import check_memory
    from .view import TerminalView

    prompt = _read_prompt(flags)
    images = [load_image(path) for path in flags["image_files"]] or None  # bad files fail before the model loads
    videos, frame_tokens = _read_videos(flags)
    if not flags["ignore_memory_check"]:
        ranks = group.size() if group else 1
        check_memory(flags["model"] or DEMO_MODEL, prompt, flags["max_tokens"], ranks, flags["kv_bits"], frame_tokens)
    dgemma, tokenizer = _load(flags, group, watchdog)
    defaults = generation_config(dgemma, tokenizer)
    if flags["extra_eos_tokens"]:  # (this process's model: every generation here reads its stop ids from it)
        extra = [_token(tokenizer, text) for text in flags["extra_eos_tokens"]]
        defaults = dgemma.generation_config = replace(
            defaults, eos_token_id=[*defaults.eos_token_id, *(i for i in extra if i not in defaults.eos_token_id)]
        )
    args = replace(generation_args(flags, images), videos=videos)
    limit = dgemma.config.max_position_embeddings
    layout = _read_template(tokenizer, flags["template_file"], flags["schema_file"], limit)
    template, schema = (None, layout) if flags["schema_file"] else (layout, None)
    canvas_view = TerminalView(tokenizer, flags["steps"] or defaults.max_denoising_steps) if flags["view"] else None
    args = replace(args, template=template, schema=schema, on_step=canvas_view.step if canvas_view else None)
    responses, thinking = [], False  # thinking: a thought is on stderr, its line not yet ended
    thoughts = group is None or group.rank() == 0  # (rank 0 prints; the others' stdout is /dev/null)
    for response in stream_from_args(dgemma, tokenizer, prompt, args):
        if flags["verbose"] and (not responses or _plan_key(response.plan) != _plan_key(responses[-1].plan)):
            click.echo(response.plan.explain(), err=True)  # auto may re-plan between canvases/rounds
        if canvas_view:
            canvas_view.commit(response.text)
        else:
            if response.thought and thoughts:
                sys.stderr.write(response.thought)
                thinking = True
            if thinking and (response.text or response.finish_reason):  # the answer starts on a line of its own
                sys.stderr.write("\n")
                thinking = False
            sys.stderr.flush()
            sys.stdout.write(response.text)
            sys.stdout.flush()
        responses.append(response)
    return responses, canvas_view


def _read_template(tokenizer, template_file: str | None, schema_file: str | None, limit: int):
    """The --template file's template, or the --schema file's schema (checked as the request is
    resolved); ``limit`` is the model's context, which no template can outgrow."""
    path = template_file or schema_file
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TemplateError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise TemplateError(
            f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
    if template_file:
        return parse_template(tokenizer, text.removesuffix("\n"), limit=limit)  # the newline that ends the file
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TemplateError(f"{path} is not JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise TemplateError(f"{path} is nested too deeply to read; flatten the schema") from None
    except ValueError:  # (an integer past Python's digit limit, whose message is advice for Python code)
        raise TemplateError(
            f"{path} holds an integer of more than {sys.get_int_max_str_digits()} digits, which "
            "cannot be read; write it as a number of fewer digits"
        ) from None


if __name__ == "__main__":
    main()
