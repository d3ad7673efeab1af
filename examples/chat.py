"""A multi-turn chat with ``stream_generate``: each turn's messages go through the checkpoint's chat
template, the answer streams in as canvases commit, and it joins the conversation for the next turn.

    python examples/chat.py                 # a scripted conversation with the bundled demo model
    python examples/chat.py --interactive   # type your own turns (an empty line ends)

The bundled demo model was trained on single questions, so it answers later turns of a
conversation less well than first ones; a real checkpoint is trained for conversations.
"""

import argparse

from mlx_dgemma import load, stream_generate

SCRIPT = ["sort: 42 17 85 23 61", "reverse: planet", "add: 417 85"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint folder or Hub id (default: the bundled demo)")
    parser.add_argument("--interactive", action="store_true")
    args = parser.parse_args()

    model, tokenizer = load(args.model) if args.model else load_demo()
    messages = []
    turns = iter(lambda: input("you> "), "") if args.interactive else iter(SCRIPT)
    for user in turns:
        if not args.interactive:
            print(f"you> {user}")
        messages.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        print("model> ", end="", flush=True)
        answer = ""
        for response in stream_generate(model, tokenizer, ids, max_tokens=96, seed=0):
            print(response.text, end="", flush=True)  # one piece per committed canvas
            answer += response.text
        print(f"   [{response.generation_tokens} tokens, {response.generation_tps:.0f} tok/s]")
        messages.append({"role": "assistant", "content": answer})


def load_demo():
    from mlx_dgemma.generate import DEMO_MODEL

    return load(DEMO_MODEL)


if __name__ == "__main__":
    main()
