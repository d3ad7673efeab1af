"""What sharding the experts over ranks costs and buys (mlx_dgemma/distributed.py).

Measured, one process and then two ranks over the ring backend on loopback (same checkpoint):

    python benchmarks/distributed_cost.py --model CK
    mlx.launch -n 2 --backend ring --python "$(which python)" benchmarks/distributed_cost.py --model CK

prints per rank the model's weight bytes and MLX active memory after loading, the time of one
denoising forward (a canvas after a prefix) and of one AR token, and the time of the all_sums that
forward makes (one per MoE layer, [tokens · top_k, hidden] in the activation dtype) timed alone, as
a fraction of the forward. CK: ``python -m checkpoint_tools.random_checkpoint CK --preset many-experts``
(experts 85% of the weights), or any checkpoint.

Predicted, for the released model on N Macs over Thunderbolt 5 (the roofline of policy/roofline.py: every
rank runs attention, dense MLP, router and head whole and 1/N of the experts, plus the all_sums):

    python benchmarks/distributed_cost.py --predict [--link-gbps 80 --link-efficiency 0.5 --latency-us 30]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dgemma import fast_blas  # noqa: E402

fast_blas.load()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_dgemma import distributed, loader  # noqa: E402
from mlx_dgemma.engine.policy import KNOWN_DEVICES, RELEASED, Cost, forward_cost, predicted_seconds  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model_path: Path, prefix: int, repeats: int) -> None:
    group = distributed.init()
    sharded = group.size() > 1
    model = distributed.load_shard(model_path, group) if sharded else loader.load_model(model_path)
    cfg = model.config
    weight_mb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e6
    active_mb = mx.get_active_memory() / 1e6
    ids = mx.random.randint(3, cfg.vocab_size, (1, prefix), key=mx.random.key(0))
    cache = model.make_cache()
    model.encode(ids, cache)
    mx.eval(cache.state())
    canvas = mx.random.randint(3, cfg.vocab_size, (1, cfg.canvas_length), key=mx.random.key(1))
    view = cache.canvas_view(cfg.canvas_length)
    step_s = median_time(lambda: mx.eval(model.denoise(canvas, view)), repeats)

    def ar_token():
        c = model.make_cache()
        model.encode(ids[:, :-1], c)
        mx.eval(c.state())
        start = time.perf_counter()
        mx.eval(model.next_token_logits(ids[:, -1:], c))
        return time.perf_counter() - start

    ar_token()
    ar_s = statistics.median(ar_token() for _ in range(repeats))
    line = (
        f"rank {group.rank()}/{group.size()}: weights {weight_mb:.1f} MB, active memory {active_mb:.1f} MB; "
        f"denoising forward ({cfg.canvas_length} positions after {prefix}) {step_s * 1e3:.1f} ms, "
        f"AR token {ar_s * 1e3:.2f} ms"
    )
    if sharded:
        dtype = model.embed(ids[:, :1]).dtype  # the activations' dtype, which the all_sums carry

        def all_sums(tokens: int):
            y = mx.zeros((tokens * cfg.top_k_experts, cfg.hidden_size), dtype)
            for _ in range(cfg.num_hidden_layers):
                y = mx.distributed.all_sum(y, group=group)
            mx.eval(y)

        step_comm = median_time(lambda: all_sums(cfg.canvas_length), repeats)
        ar_comm = median_time(lambda: all_sums(1), repeats)
        line += (
            f"; all_sums alone: {step_comm * 1e3:.1f} ms per forward ({100 * step_comm / step_s:.0f}%), "
            f"{ar_comm * 1e3:.2f} ms per AR token ({100 * ar_comm / ar_s:.0f}%)"
        )
    print(line, flush=True)


def sharded_cost(cfg, tokens: int, prefix: int, bits: float, denoise: bool, ranks: int) -> Cost:
    """One rank's share of a forward: everything but the experts whole, the experts' FLOPs and
    bytes divided by the number of ranks (contiguous even shares, routing assumed balanced)."""
    whole = forward_cost(cfg, tokens, prefix, bits, denoise)
    without = forward_cost(dataclasses.replace(cfg, moe_intermediate_size=0), tokens, prefix, bits, denoise)
    return Cost(
        without.flops + (whole.flops - without.flops) / ranks, without.bytes + (whole.bytes - without.bytes) / ranks
    )


def all_sum_seconds(cfg, tokens: int, ranks: int, gbps: float, efficiency: float, latency_us: float) -> float:
    """One forward's all_sums: per MoE layer [tokens · top_k, hidden] bf16, a ring all-reduce
    (each rank sends and receives 2 (N-1)/N of it, in 2 (N-1) hops)."""
    if ranks == 1:
        return 0.0
    nbytes = tokens * cfg.top_k_experts * cfg.hidden_size * 2
    per_layer = 2 * (ranks - 1) / ranks * nbytes / (gbps / 8 * 1e9 * efficiency) + 2 * (ranks - 1) * latency_us * 1e-6
    return cfg.num_hidden_layers * per_layer


def predict(args) -> None:
    cfg, bits, prefix, canvas = RELEASED, args.bits, 512, 256
    print(
        f"google/diffusiongemma-26B-A4B-it at {bits:g} bits per weight, {args.steps} steps per "
        f"{canvas}-canvas, {prefix}-token prefix; Thunderbolt 5 {args.link_gbps:g} Gb/s at "
        f"{args.link_efficiency:.0%} ({args.link_gbps / 8 * args.link_efficiency:.1f} GB/s), "
        f"{args.latency_us:g} µs per hop; all_sum per layer: {canvas}·{cfg.top_k_experts}·{cfg.hidden_size}·2 B = "
        f"{canvas * cfg.top_k_experts * cfg.hidden_size * 2 / 1e6:.1f} MB per step, "
        f"{cfg.top_k_experts * cfg.hidden_size * 2 / 1e3:.0f} kB per AR token\n"
    )
    print("| Macs | AR tok/s | diffusion tok/s | comm share of a step | GB of weights per Mac |")
    print("|---|---:|---:|---:|---:|")
    for name in args.devices:
        device = KNOWN_DEVICES[name]
        for ranks in (1, 2, 4):
            link = (args.link_gbps, args.link_efficiency, args.latency_us)
            step_comm = all_sum_seconds(cfg, canvas, ranks, *link)
            step = (
                predicted_seconds(device, sharded_cost(cfg, canvas, prefix, bits, True, ranks), cfg.num_hidden_layers)
                + step_comm
            )
            ar = predicted_seconds(
                device, sharded_cost(cfg, 1, prefix, bits, False, ranks), cfg.num_hidden_layers
            ) + all_sum_seconds(cfg, 1, ranks, *link)
            gb = sharded_cost(cfg, 1 << 20, 0, bits, False, ranks).bytes / 1e9  # every expert touched
            print(
                f"| {ranks} × {name} | {1 / ar:.1f} | {canvas / (args.steps * step):.1f} | "
                f"{100 * step_comm / step:.1f}% | {gb:.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder to measure")
    parser.add_argument("--prefix", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--predict", action="store_true", help="the roofline prediction for Macs over Thunderbolt 5")
    parser.add_argument("--devices", nargs="+", default=["M4 Max", "M3 Ultra", "M4 Pro"])
    parser.add_argument("--steps", type=float, default=16)
    parser.add_argument(
        "--bits", type=float, default=4.5, help="bits per weight: 4.5 = the 4-bit mixed recipe, 16 = bf16"
    )
    parser.add_argument("--link-gbps", type=float, default=80.0)
    parser.add_argument("--link-efficiency", type=float, default=0.5)
    parser.add_argument("--latency-us", type=float, default=30.0)
    args = parser.parse_args()
    if args.predict:
        predict(args)
    elif args.model:
        measure(args.model, args.prefix, args.repeats)
    else:
        parser.error("give --model CK to measure, or --predict")


if __name__ == "__main__":
    main()
