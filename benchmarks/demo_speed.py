"""Speed against accuracy on the demo tasks: our policies and settings beside mlx-vlm's stock engine.

The bundled demo model (converted to the mlx-vlm layout for the peer), the same fresh instances
(tasks.py evaluation split) and the same chat-template prompt ids for every engine. mlx-vlm 0.7.10
runs ``stream_diffusion_generate`` with its defaults ("stock": confidence-threshold sampler,
argmax denoiser, adaptive canvas); ours runs each setting in the table. Per engine: accuracy per
task, denoising steps and (ours) canvas positions computed per instance, and answer tokens per
second (tokens up to and including the first stop id, per second of wall time with the prompt's
prefill, summed over all instances). Settings run one after the other
per instance, so machine noise hits them alike; read the ratios.

    python benchmarks/demo_speed.py --peer-python .peer-venv/bin/python -n 25
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"

# name -> stream_generate arguments, or sampler settings replacing the generation config's values;
# "fast" is the policy as shipped, the others its ingredients and neighbours.
SETTINGS = {
    "reference": {},
    "freeze after 1": {"freeze_after": 1},
    "freeze after 2": {"freeze_after": 2},
    "freeze after 3": {"freeze_after": 3},
    "bound x2": {"entropy_bound": 0.2},
    "steps 12": {"steps": 12},
    "stability 0": {"stability_threshold": 0},
    "stab 0, conf 0.05": {"stability_threshold": 0, "confidence_threshold": 0.05},
    "stab 0, bound x2": {"stability_threshold": 0, "entropy_bound": 0.2},
    "fast": {"policy": "fast"},
}
SAMPLER_ONLY = {"stability_threshold", "confidence_threshold"}


def generate_arguments(name: str, generation_config) -> dict:
    from mlx_dgemma.engine.sampler import SamplerSettings

    setting = dict(SETTINGS[name])
    if SAMPLER_ONLY & set(setting):
        return {"settings": SamplerSettings.from_generation_config(generation_config, **setting), "policy": "reference"}
    return setting


def peer_main(checkpoint: str, cases_file: str) -> None:
    """In mlx-vlm's venv: every case through its engine with stock settings; prints JSON."""
    import mlx.core as mx
    from mlx_vlm.generate.diffusion import stream_diffusion_generate
    from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
    from mlx_vlm.utils import StoppingCriteria, load_config, load_model
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    config = load_config(Path(checkpoint))
    vocab = config["text_config"]["vocab_size"]
    # Ids are all that cross over; our tokenizer decodes them afterwards.
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words)
    tokenizer.detokenizer = NaiveStreamingDetokenizer(tokenizer)
    cases = json.loads(Path(cases_file).read_text())
    tokenizer.stopping_criteria = StoppingCriteria(cases["stop_ids"], tokenizer)
    model = load_model(Path(checkpoint))
    out = []
    for i, ids in enumerate([cases["prompts"][0]] + cases["prompts"]):  # the first run warms up
        mx.random.seed(i)
        start = time.perf_counter()
        tokens, finish = [], None
        for r in stream_diffusion_generate(
            model,
            tokenizer,
            tokenizer,
            mx.array([ids]),
            None,
            None,
            max_tokens=cases["max_tokens"],
            skip_special_token_ids=[],
        ):
            if r.finish_reason is not None:
                finish = r.finish_reason
            elif not r.is_draft and not r.diffusion_block_complete and r.token is not None:
                tokens.append(int(r.token))
            steps = r.diffusion_denoising_steps
        out.append(
            {
                "tokens": tokens + (cases["stop_ids"][:1] if finish == "stop" else []),
                "seconds": time.perf_counter() - start,
                "steps": steps,
            }
        )
    print(json.dumps(out[1:]))


class CountingModel:
    """The model, counting the canvas positions each denoising forward computes."""

    def __init__(self, model):
        self.model, self.positions, self.forwards = model, 0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def denoise(self, canvas, *args, **kwargs):
        self.positions += canvas.shape[-1]
        self.forwards += 1
        return self.model.denoise(canvas, *args, **kwargs)


@dataclass
class Tally:
    correct: dict
    total: dict
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    positions: int = 0  # canvas positions computed, all forwards

    def add(self, task, ok, tokens, seconds, steps, positions=0):
        self.correct[task] = self.correct.get(task, 0) + ok
        self.total[task] = self.total.get(task, 0) + 1
        self.tokens += tokens
        self.seconds += seconds
        self.steps += steps
        self.positions += positions

    def accuracy(self, task=None):
        if task:
            return self.correct[task] / self.total[task]
        return sum(self.correct.values()) / sum(self.total.values())


def answer_tokens(tokens: list[int], stop_ids) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-python", help="Python of a venv with mlx-vlm 0.7.10 (omit to skip the peer)")
    p.add_argument("-n", type=int, default=25, help="fresh instances per task")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--out", type=Path)
    p.add_argument("--peer", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peer:
        peer_main(*a.peer)
        return

    import mlx_dgemma  # noqa: F401  (fast BLAS before mlx.core)
    from mlx_dgemma import fast_blas, load, stream_generate
    from mlx_dgemma.convert import convert
    from mlx_dgemma.demo.scores import instances
    from mlx_dgemma.demo.tasks import TASKS, check
    from mlx_dgemma.generate import DEMO_MODEL, prompt_ids

    model, tokenizer = load(DEMO_MODEL)
    counting = CountingModel(model)
    stop_ids = set(model.generation_config.eos_token_id)
    max_tokens = model.generation_config.max_new_tokens
    cases = [(task, prompt) for task in TASKS for prompt, _ in instances(task, a.n, a.seed)]
    ids = [prompt_ids(tokenizer, prompt) for _, prompt in cases]
    tallies: dict[str, Tally] = {}

    if a.peer_python:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = Path(tmp) / "demo-mlx-vlm"
            convert(str(DEMO_MODEL), str(checkpoint), dtype="float32")
            cases_file = Path(tmp) / "cases.json"
            cases_file.write_text(json.dumps({"prompts": ids, "stop_ids": sorted(stop_ids), "max_tokens": max_tokens}))
            env = dict(os.environ, LD_PRELOAD=OPENBLAS, HF_HUB_OFFLINE="1")
            if family := fast_blas.kernel_family():
                env.setdefault("OPENBLAS_CORETYPE", family)
            run = subprocess.run(
                [a.peer_python, __file__, "--peer", str(checkpoint), str(cases_file)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            peer = json.loads(run.stdout.strip().splitlines()[-1])
        tally = tallies["mlx-vlm stock"] = Tally({}, {})
        for (task, prompt), r in zip(cases, peer):
            tokens = answer_tokens(r["tokens"], stop_ids)
            tally.add(
                task,
                check(task, prompt, tokenizer.decode_clean(tokens, stop_ids)),
                len(tokens),
                r["seconds"],
                r["steps"],
            )

    list(stream_generate(model, tokenizer, ids[0], seed=0))  # warm-up
    arguments = {name: generate_arguments(name, model.generation_config) for name in a.settings}
    for name in a.settings:
        tallies[name] = Tally({}, {})
    for i, ((task, prompt), prompt_tokens) in enumerate(zip(cases, ids)):
        for name in a.settings:
            counting.positions = 0
            start = time.perf_counter()
            responses = list(
                stream_generate(counting, tokenizer, prompt_tokens, seed=a.seed * 100003 + i, **arguments[name])
            )
            seconds = time.perf_counter() - start
            tokens = answer_tokens([t for r in responses for t in r.tokens], stop_ids)
            text = "".join(r.text for r in responses)
            tallies[name].add(
                task,
                check(task, prompt, text),
                len(tokens),
                seconds,
                sum(r.steps for r in responses),
                counting.positions,
            )

    base = tallies.get("mlx-vlm stock") or tallies[a.settings[0]]
    base_name = "mlx-vlm stock" if "mlx-vlm stock" in tallies else a.settings[0]
    print(f"demo model, {a.n} fresh instances per task (seed {a.seed}), {fast_blas.describe()}")
    head = f"{'engine / setting':<18}" + "".join(f"{t:>9}" for t in TASKS)
    print(head + f"{'all':>8}{'steps':>7}{'positions':>10}{'tok/s':>8}  vs {base_name}")
    base_speed = base.tokens / base.seconds
    for name, t in tallies.items():
        speed = t.tokens / t.seconds
        positions = f"{t.positions / len(cases):10.0f}" if t.positions else f"{'':>10}"
        print(
            f"{name:<18}"
            + "".join(f"{t.accuracy(task):9.0%}" for task in TASKS)
            + f"{t.accuracy():8.1%}{t.steps / len(cases):7.1f}{positions}{speed:8.1f}  {speed / base_speed:5.2f}x"
        )
    if a.out:
        a.out.write_text(json.dumps({k: vars(v) for k, v in tallies.items()}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
