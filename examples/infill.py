"""Infilling: the text before the gap goes to the encoder, the text after it is clamped at the end of
the canvas, and the model writes what fits between them.

    python examples/infill.py
"""

from mlx_dgemma import infill, load
from mlx_dgemma.generate import DEMO_MODEL


def main():
    model, tokenizer = load(DEMO_MODEL)
    # The conversation up to the answer is the prefix (the demo model only answers in chat form).
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "sort: 42 17 85 23 61"}], add_generation_prompt=True, tokenize=False
    )
    middle = infill(model, tokenizer, prefix=chat + "17 ", suffix=" 85", max_fill=8, seed=0)
    print(f"17 [{middle}] 85")


if __name__ == "__main__":
    main()
