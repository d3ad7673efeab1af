"""Where diffusion beats autoregression on this device, and predictions for others.

    python -m mlx_dgemma.bench --model PATH [--json FILE] [--plot FILE.png]

Measures prefill tok/s, autoregressive tok/s, the denoising step time per canvas length, and real
sampler runs at several steps per 256-canvas (early stop off); prints the crossover, the profile
beside the forwards auto then ran (what the engine observed), and the roofline predictions for known
Apple and NVIDIA devices (see policy/roofline.py for the model behind them).
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # a command-line process: the fast BLAS before mlx.core loads

import json
import time
from pathlib import Path

import click

from . import cpu_threads
from .cli import command_line, several_values
from .engine.policy import (
    CANVAS_LENGTHS,
    PLANNERS,
    Acceptance,
    AutoPlanner,
    LiveProfile,
    Profile,
    best_draft,
    measure,
    predicted_table,
    time_canvas,
)
from .validate import at_least, option, writable_file

STEPS = (2, 4, 8, 16, 32, 48)


def run(model, tokenizer, prefix: int = 64, steps_list=STEPS, measured_steps=(4, 8), repeats: int = 2) -> dict:
    """All bench figures as one JSON-ready dict.

    Diffusion tok/s at each steps-per-canvas is 256 / (steps · step time), the step time measured
    on 3-step sampler canvases; whole canvases at ``measured_steps`` check it (``sampler_check``).
    """
    import mlx.core as mx

    canvas = 256
    mx.reset_peak_memory()
    profile = measure(model, prefix=prefix, canvases=CANVAS_LENGTHS, repeats=repeats)
    cache = model.make_cache()
    model.encode(mx.random.randint(3, model.config.vocab_size, (1, prefix), key=mx.random.key(1)), cache)
    check = {}
    for steps in measured_steps:
        seconds = min(time_canvas(model, cache, steps, canvas) for _ in range(repeats))
        check[steps] = {"measured_tok_s": canvas / seconds, "from_step_time_tok_s": profile.diffusion_tok_s(steps)}
    return {
        "device": profile.device,
        "dtype": profile.dtype,
        "blas": fast_blas.describe(),
        "cpu_threads": cpu_threads.free_cores(),  # the split the last profile point ran at (cpu_threads.py)
        "prefix_tokens": prefix,
        "prefill_tok_s": profile.prefill_tok_s,
        "ar_tok_s": profile.ar_tok_s,
        "step_s_by_canvas": profile.step_s_by_canvas,
        "diffusion_tok_s_by_steps": {s: profile.diffusion_tok_s(s, canvas) for s in steps_list},
        "crossover_steps": profile.crossover_steps(canvas),
        "sampler_check": check,
        "verify_s_by_length": profile.verify_s_by_length,
        "verified": verified_figures(model, tokenizer, profile, prefix),
        "observed": observed_figures(model, tokenizer, profile, prefix),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "predicted": predicted_table(),
    }


def verified_figures(model, tokenizer, profile: Profile, prefix: int = 64, tokens: int = 64) -> dict:
    """Verified drafting on this device: the draft length and steps the policy picks from the profile
    at the demo's acceptance (and at half of it), their predicted tok/s, and one measured greedy run
    through the engine of up to ``tokens`` tokens after a random prompt (tokens per round, per forward,
    tok/s: a random checkpoint's drafts are rarely kept, a trained model's acceptance is what eval's
    verified rows show)."""
    import mlx.core as mx

    from .api import stream_generate

    canvas = model.config.canvas_length
    out = {}
    for key, acceptance in (("demo_acceptance", Acceptance()), ("half_acceptance", Acceptance.scaled(0.5))):
        length, steps, tok_s = best_draft(profile, acceptance, canvas)
        out[key] = {
            "draft_length": length,
            "draft_steps": steps,
            "predicted_tok_s": tok_s,
            "tokens_per_round": acceptance.tokens_per_round(steps, length),
        }
    length, steps = out["demo_acceptance"]["draft_length"], out["demo_acceptance"]["draft_steps"]
    ids = mx.random.randint(3, model.config.vocab_size, (prefix,), key=mx.random.key(4)).tolist()

    def run_once():
        return list(
            stream_generate(
                model, tokenizer, ids, tokens, policy="verified", draft_length=length, draft_steps=steps, seed=0
            )
        )

    run_once()  # warm-up
    rounds = run_once()
    made = rounds[-1].generation_tokens
    out["measured"] = {
        "draft_length": length,
        "draft_steps": steps,
        "tokens": made,
        "tokens_per_round": made / len(rounds),
        "tokens_per_forward": made / sum(r.steps for r in rounds),
        "tok_s": rounds[-1].generation_tps,
    }
    return out


def observed_figures(model, tokenizer, profile: Profile, prefix: int = 64, answers: int = 3, tokens: int = 64) -> dict:
    """The profile beside what the engine observed: ``answers`` auto generations of up to ``tokens``
    after a random prompt, planned from ``profile`` kept live (``LiveProfile``; not cached), and per
    point the seconds measured, the seconds the forwards auto ran took (their lower quartile, at the profile's
    prefix) and how many canvases, blocks or rounds observed it; with the kinds each answer ran in."""
    import mlx.core as mx

    from .api import stream_generate

    live = LiveProfile(profile)
    PLANNERS.set(model, AutoPlanner(model.generation_config, model.config.canvas_length, profile, live=live))
    ids = mx.random.randint(3, model.config.vocab_size, (prefix,), key=mx.random.key(5)).tolist()
    ran = []
    try:
        for seed in range(answers):
            plans = {}  # each canvas, block or round's plan, once
            for r in stream_generate(model, tokenizer, ids, tokens, policy="auto", profile=profile, seed=seed):
                plans.setdefault(id(r.plan), r.plan)
            ran.append([plan.predicted[0] for plan in plans.values() if plan.predicted])
    finally:
        PLANNERS.set(model, None)
    points = [
        {"kind": kind, "length": n, "profile_s": s, "observed_s": seen, "observations": count}
        for kind, n, s, seen, count in live.report()
    ]
    return {"points": points, "ran": ran}


def prefix_sweep(model, prefixes, repeats: int = 2, canvas: int = 256, steps: int = 3) -> dict:
    """Per prompt length: chunked prefill tokens/s, the time of one ``canvas``-position sampler
    step after that prefix, and the peak memory of both."""
    import mlx.core as mx

    from .generate import prefill

    canvas = min(canvas, model.config.canvas_length)
    out = {"step_ms_by_prefix": {}, "prefill_tok_s_by_prefix": {}, "peak_memory_gb_by_prefix": {}}
    for prefix in prefixes:
        if prefix + canvas > model.config.max_position_embeddings:
            raise click.ClickException(
                f"--prefix {prefix} and a {canvas}-token canvas exceed the model's context "
                f"of {model.config.max_position_embeddings}"
            )
        ids = mx.random.randint(3, model.config.vocab_size, (1, prefix), key=mx.random.key(1))
        mx.eval(ids)
        mx.reset_peak_memory()
        best = float("inf")
        for _ in range(repeats):
            cache = model.make_cache()
            start = time.perf_counter()
            prefill(model, ids, cache)
            best = min(best, time.perf_counter() - start)
        time_canvas(model, cache, 1, canvas)  # warm-up for this shape
        step = min(time_canvas(model, cache, steps, canvas) for _ in range(repeats)) / steps
        out["step_ms_by_prefix"][prefix] = step * 1e3
        out["prefill_tok_s_by_prefix"][prefix] = prefix / best
        out["peak_memory_gb_by_prefix"][prefix] = mx.get_peak_memory() / 1e9
    return out


def step_breakdown(model, canvas: int = 256, prefix: int = 64, repeats: int = 3) -> dict[str, float]:
    """Seconds per denoising step spent in each part, each timed alone at ``canvas`` positions."""
    import mlx.core as mx

    from .engine.sampler import MxRandom, accept_mask, tempered_distribution

    cfg = model.config
    cache = model.make_cache()
    model.encode(mx.random.randint(3, cfg.vocab_size, (1, prefix), key=mx.random.key(1)), cache)
    ids = mx.random.randint(0, cfg.vocab_size, (1, canvas), key=mx.random.key(2))
    x = mx.random.normal((1, canvas, cfg.hidden_size), key=mx.random.key(3))
    view = cache.canvas_view(canvas)  # laid out once per canvas, as the sampler does
    logits = model.denoise(ids, view)
    decoder, layers, rng = model.model.decoder, model.layers, MxRandom(0)
    _, probs, _, _ = tempered_distribution(logits, mx.array(0.8))

    def attention():
        outs = []
        view.set_active(None)
        for layer, layer_view, mask in zip(layers, view.layers, view.masks):
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), view.positions)
            k, v = layer_view.update_and_fetch(k, v)
            outs.append(layer.post_attention_layernorm(layer.self_attn.attend(q, k, v, mask)))
        return outs

    def dense_mlp():
        return [layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(x))) for layer in layers]

    def experts():
        outs = []
        for layer in layers:
            idx, w = layer.router(x)
            outs.append(layer.post_feedforward_layernorm_2(layer.experts(layer.pre_feedforward_layernorm_2(x), idx, w)))
        return outs

    def head():
        return model.head(decoder.norm(x))

    def self_conditioning():
        from .model.diffusion_gemma import soft_embed

        return decoder.self_conditioning(model.embed(ids), soft_embed(decoder.embed_tokens, probs))

    def sampler():
        scaled, p, entropy, argmax = tempered_distribution(logits, mx.array(0.8))
        accepted = accept_mask(entropy, 0.1)
        return mx.where(accepted, rng.categorical(p), rng.renoise((1, canvas), cfg.vocab_size)), scaled, argmax

    def whole_step():
        return model.denoise(ids, view, logits, probs)

    parts = dict(
        attention=attention,
        experts=experts,
        dense_mlp=dense_mlp,
        head=head,
        self_conditioning=self_conditioning,
        sampler=sampler,
        whole_forward=whole_step,
    )
    return {name: _best_time(fn, repeats) for name, fn in parts.items()}


def _best_time(fn, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best


def format_report(r: dict) -> str:
    lines = [
        f"device {r['device']}, {r['dtype']}, BLAS: {r['blas']}, {r['cpu_threads']} CPU thread(s)",
        f"prefill {r['prefill_tok_s']:.1f} tok/s   autoregressive {r['ar_tok_s']:.2f} tok/s   "
        f"crossover {r['crossover_steps']:.2f} steps per 256-canvas",
        "canvas  step ms   (per token ms)",
    ]
    for c, s in sorted(r["step_s_by_canvas"].items()):
        lines.append(f"{c:>6}  {s * 1e3:8.1f}   {s * 1e3 / c:8.2f}")
    lines.append("steps/canvas  diffusion tok/s  vs AR")
    for s, tps in sorted(r["diffusion_tok_s_by_steps"].items()):
        lines.append(f"{s:>12}  {tps:15.2f}  {tps / r['ar_tok_s']:5.2f}x")
    for s, c in sorted(r["sampler_check"].items()):
        lines.append(
            f"sampler run, {s} steps: {c['measured_tok_s']:.2f} tok/s measured vs "
            f"{c['from_step_time_tok_s']:.2f} from step time"
        )
    v = r["verified"]
    for key, what in (("demo_acceptance", "the demo's acceptance"), ("half_acceptance", "half of it")):
        d = v[key]
        lines.append(
            f"verified drafting predicted at {what}: drafts of {d['draft_length']} in {d['draft_steps']} "
            f"step(s), {d['tokens_per_round']:.1f} tokens per round, {d['predicted_tok_s']:.2f} tok/s "
            f"({d['predicted_tok_s'] / r['ar_tok_s']:.2f}x AR)"
        )
    m = v["measured"]
    lines.append(
        f"verified drafting measured (this checkpoint's own acceptance, {m['tokens']} tokens): drafts of "
        f"{m['draft_length']} in {m['draft_steps']} step(s), {m['tokens_per_round']:.2f} tokens per round, "
        f"{m['tokens_per_forward']:.2f} per forward, {m['tok_s']:.2f} tok/s"
    )
    lines.append("the profile beside the forwards auto ran (ms; observed: lower quartile, at the profile's prefix)")
    lines.append(f"{'kind':<7} {'length':>6} {'profile':>9} {'observed':>9} {'ratio':>6} {'runs':>5}")
    for p in r["observed"]["points"]:
        seen = p["observed_s"]
        observed = f"{seen * 1e3:9.2f} {seen / p['profile_s']:5.2f}x" if seen else f"{'-':>9} {'':>6}"
        lines.append(f"{p['kind']:<7} {p['length']:>6} {p['profile_s'] * 1e3:9.2f} {observed} {p['observations']:>5}")
    lines.append("auto ran: " + "; ".join(", ".join(ran) or "-" for ran in r["observed"]["ran"]))
    lines.append(
        "predicted for google/diffusiongemma-26B-A4B-it (16 steps/canvas; roofline, see policy/roofline.py; verified "
        "at the demo's acceptance and at half of it, best draft length L and steps k):"
    )
    lines.append(
        f"{'device':<10} {'AR tok/s':>9} {'diffusion':>10} {'speedup':>8} {'verified':>9} {'L/k':>6} "
        f"{'half':>7} {'L/k':>6}"
    )
    for name, p in r["predicted"].items():
        lines.append(
            f"{name:<10} {p['ar_tok_s']:9.1f} {p['diffusion_tok_s']:10.1f} {p['speedup']:7.2f}x "
            f"{p['verified_tok_s']:9.1f} {p['verified_length']:>3}/{p['verified_steps']} "
            f"{p['verified_half_tok_s']:7.1f} {p['verified_half_length']:>3}/{p['verified_half_steps']}"
        )
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    """Speedup over AR against canvas length, one line per steps-per-canvas, measured and predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = Profile(
        r["device"],
        "measured",
        {int(k): v for k, v in r["step_s_by_canvas"].items()},
        1 / r["ar_tok_s"],
        r["prefill_tok_s"],
    )
    from .engine.policy import predict

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (title, p) in zip(
        axes, [(f"measured: {r['device']} ({r['dtype']})", profile), ("predicted: M4 Max vs H100 (26B-A4B)", None)]
    ):
        lengths = sorted(profile.step_s_by_canvas)
        if p is not None:
            for steps in (4, 8, 16, 48):
                ax.plot(
                    lengths,
                    [c / (steps * p.step_s(c)) / p.ar_tok_s for c in lengths],
                    marker="o",
                    label=f"{steps} steps/canvas",
                )
        else:
            for name, style in (("M4 Max", "-"), ("H100", "--")):
                q = predict(name)
                for steps in (4, 16, 48):
                    ax.plot(
                        lengths,
                        [c / (steps * q.step_s(c)) / q.ar_tok_s for c in lengths],
                        style,
                        marker="o",
                        label=f"{name}, {steps} steps",
                    )
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("canvas length (tokens)")
        ax.set_ylabel("diffusion tok/s ÷ autoregressive tok/s")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", "model_path", required=True, help="Checkpoint folder or Hub id.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=option(writable_file),
    help="Write the figures here.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=option(writable_file),
    help="Write a PNG plot here.",
)
@click.option(
    "--prefix",
    cls=several_values(),
    type=int,
    multiple=True,
    default=[64],
    show_default=True,
    callback=option(lambda values, name: [at_least(1)(v, name) for v in values]),
    help="Prompt tokens before the canvas; several (--prefix 64 1024 8192) add a sweep over prompt lengths.",
)
@click.option(
    "--repeats", default=2, show_default=True, callback=option(at_least(1)), help="Timed repeats (best is kept)."
)
@click.option("--breakdown", is_flag=True, help="Only time each part of a 256-position step.")
@command_line
def main(model_path, json_path, plot_path, prefix, repeats, breakdown):
    from .errors import CheckpointError
    from .loader import load

    try:
        model, tokenizer = load(model_path)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    prefixes = list(prefix)
    if breakdown:
        parts = step_breakdown(model, prefix=prefixes[0], repeats=repeats)
        for name, seconds in parts.items():
            click.echo(f"{name:<18} {seconds * 1e3:9.1f} ms")
        if json_path:
            json_path.write_text(json.dumps(parts, indent=2))
        return
    report = run(model, tokenizer, prefix=prefixes[0], repeats=repeats)
    click.echo(format_report(report))
    if len(prefixes) > 1:
        report.update(prefix_sweep(model, prefixes, repeats))
        click.echo("prefix  prefill tok/s  step ms (256 positions)  peak GB")
        for p in prefixes:
            click.echo(
                f"{p:>6}  {report['prefill_tok_s_by_prefix'][p]:>13.1f}  {report['step_ms_by_prefix'][p]:>23.1f}"
                f"  {report['peak_memory_gb_by_prefix'][p]:>7.3f}"
            )
    if json_path:
        json_path.write_text(json.dumps(report, indent=2))
    if plot_path:
        plot(report, plot_path)
        click.echo(f"plot: {plot_path}")


if __name__ == "__main__":
    main()
