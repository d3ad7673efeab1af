"""Several prompts answered together: one batched forward per denoising step for all of them, each
row with its own seed, so each answer is the one ``generate`` gives for that prompt alone.

    python examples/batch.py
"""

from mlx_dgemma import batch_generate, load
from mlx_dgemma.generate import DEMO_MODEL

PROMPTS = ["sort: 42 17 85 23 61", "reverse: planet", "add: 417 85", "json: name=ada age=36"]


def main():
    model, tokenizer = load(DEMO_MODEL)
    for prompt, answer in zip(PROMPTS, batch_generate(model, tokenizer, PROMPTS, seeds=[0, 1, 2, 3]).texts):
        print(f"{prompt:<24} -> {answer}")


if __name__ == "__main__":
    main()
