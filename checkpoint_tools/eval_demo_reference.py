"""Evaluate the bundled demo checkpoint with the *reference* (transformers) DiffusionGemma.

    python checkpoint_tools/eval_demo_reference.py --model mlx_dgemma/demo --n 50

Loads the checkpoint with ``DiffusionGemmaForBlockDiffusion.from_pretrained``, runs the reference
``generate()`` with the checkpoint's own generation_config (the default settings) on N fresh
instances per task from the eval split of ``mlx_dgemma/demo/tasks.py`` (never in the training set),
decodes (cut at the first stop id, strip thought scaffolding) and prints accuracy per task, the
median / mean denoising steps per canvas (counted with a streamer: ``put_draft`` is called once per
step) against the step limit, and the mean ``tokens_per_forward`` that generate returns.
Instance i of a run uses ``torch.manual_seed(seed + i)``, so results are reproducible.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_demo as T  # noqa: E402

tasks = T.tasks


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(here, "..", "mlx_dgemma", "demo"))
    ap.add_argument("--n", type=int, default=50, help="instances per task")
    ap.add_argument("--seed", type=int, default=1234, help="seed for the eval instances and the sampler")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tasks", default=",".join(tasks.TASKS))
    ap.add_argument("--show", type=int, default=2, help="print this many examples per task (plus all failures if -v)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.model).eval()
    tok = T.Tok(os.path.join(args.model, "tokenizer.model"))
    gc = model.generation_config
    print(
        f"model {os.path.abspath(args.model)}: canvas {model.config.canvas_length}, "
        f"max_denoising_steps {gc.max_denoising_steps}, max_new_tokens {gc.max_new_tokens}, "
        f"entropy_bound {gc.sampler_config.entropy_bound}, eos {gc.eos_token_id}"
    )
    rng = random.Random(args.seed)
    all_steps, all_tpf, summary = [], [], {}
    t0 = time.time()
    for task in args.tasks.split(","):
        ok, steps, tpf = 0, [], []
        for i in range(args.n):
            prompt, answer = tasks.make_instance(task, rng, "eval")
            text, s, t = T.run_generate(model, tok, prompt, seed=args.seed + i)
            good = tasks.check(task, prompt, text)
            ok += good
            steps += s
            tpf.append(t)
            if i < args.show or (args.verbose and not good):
                print(
                    f"  [{task}] {prompt!r} -> {text!r} {'ok' if good else 'WRONG (want ' + repr(answer) + ')'}"
                    f" steps/canvas {s}"
                )
        summary[task] = ok / args.n
        all_steps += steps
        all_tpf += tpf
        print(
            f"{task:8s} accuracy {ok}/{args.n} = {ok / args.n:.1%}  median steps/canvas "
            f"{statistics.median(steps):g} (mean {statistics.mean(steps):.2f}, max {max(steps)}, "
            f"limit {gc.max_denoising_steps})  tokens/forward {statistics.mean(tpf):.2f}",
            flush=True,
        )
    print(
        f"overall: median steps/canvas {statistics.median(all_steps):g} of limit {gc.max_denoising_steps}, "
        f"mean tokens/forward {statistics.mean(all_tpf):.2f}, {time.time() - t0:.0f}s"
    )
    return summary


if __name__ == "__main__":
    main()
