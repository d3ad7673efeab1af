"""Train the bundled demo model: a small DiffusionGemma that solves four checkable tasks.

    python checkpoint_tools/train_demo.py --seed 0 --threads 2 --out mlx_dgemma/demo

The model is the reference PyTorch ``DiffusionGemmaForBlockDiffusion`` from transformers (5.24.0),
so the checkpoint is by construction a real DiffusionGemma that the reference loads with
``from_pretrained`` and runs with its own ``generate()``.  PyTorch rather than MLX because (a) the
reference *is* the spec, so nothing the MLX port gets wrong can leak into the demo weights, and (b)
MLX on this Linux CPU is slow for training (netlib BLAS, slow element-wise ops).

Tasks (``mlx_dgemma/demo/tasks.py``): sort, reverse, add, json, mixed uniformly, train split only.

Tokenizer: a sentencepiece ``char`` model with byte fallback, trained on task text.  Ids 0-4 are
``<pad> <eos> <bos> <unk> <mask>``, then the Gemma-4 chat tokens ``<|turn> <turn|> <|channel>
<channel|> <|tool_response>`` and ``"\\n"`` as user-defined (single) pieces, then 256 byte pieces,
then one piece per character (~330 ids in all).  Characters rather than BPE pieces on purpose: with
merged pieces ``reverse`` would need the model to spell pieces it never sees spelled, and
``sort``/``add`` want one digit per token (``split_digits`` gives that too).  Identity
normalisation, no dummy prefix, so tokenising the rendered chat text gives exactly the ids used in
training (plus ``<bos>``, which the caller prepends as the id 2).

Sequence layout (the chat template)::

    <bos><|turn>user\\n{prompt}<turn|>\\n<|turn>model\\n<|channel>thought\\n<channel|> | answer <turn|> <pad>...

The answer starts on a canvas boundary; the answer + ``<turn|>`` is padded with ``<pad>`` to a
multiple of the canvas length C; the answer takes K = ceil((len+1)/C) canvases.

Objective (the published one), all in one batched pass per step:

* Encoder (the shared backbone, causal, with the sliding window) runs once over the whole *clean*
  sequence ``prefix + K canvases`` and writes its K/V into a plain ``DynamicCache`` (full length).
  Its final hidden states (``encoder_last_hidden_state`` is already normed by the shared final
  ``norm``) go through the tied head + softcap; next-token cross-entropy on every real token
  (prompt, answer, ``<turn|>``; not the padding): the causal-LM loss, weight 1.
* Decoder: all K canvases of an example are denoised in one call of the decoder, with a hand-made
  4-D mask that reproduces exactly what ``generate()`` lets canvas k see: the clean prefix
  (prompt + canvases 0..k-1, as committed) through the cache -- full layers all of it, sliding layers
  only its last W-1 tokens (``DynamicSlidingWindowLayer`` keeps W-1) -- plus its own C canvas
  positions bidirectionally; never other canvases.  Positions continue the prefix.
  Each canvas gets its own t ~ U(0.001, 1); each position is replaced with probability t by a token
  drawn uniformly from the whole vocabulary (uniform-state diffusion, no mask token), as
  ``generate()`` initialises/renoises.  Loss: flat cross-entropy over all C positions of every real
  canvas (padding positions inside the last canvas included, as published; canvases past an
  example's last one are not scored).
* Self-conditioning, two passes, per example with probability 0.5 (``self_conditioning_mask``): a
  first decoder pass without SC logits under ``no_grad``; the second pass gets the first pass's
  logits, detached, divided by a temperature T ~ U(t_min, t_max) = U(0.4, 0.8) -- because
  ``generate()`` feeds the *temperature-scaled* logits of the previous step (``L / T`` with T in
  [t_min, t_max]), training on the same kind of input avoids a train/inference mismatch in the
  sharpness of the SC soft embedding.  Examples with the mask off see a zero SC signal (= first
  denoising step).
* Total loss = decoder CE + 1.0 * encoder CE.

Making the signal count (a first run: accuracy moved only after ~1000 steps, half the loss on padding):
one encoder pass serves all canvases of an example; the character tokenizer puts the answer right at
the canvas start so canvases are mostly answer (padding is a minority of canvas positions except for
short add/reverse answers); batches are bucketed by canvas count so no compute goes to unscored
canvases; small batches (many optimizer steps per minute), AdamW with a high peak LR, linear warmup
and cosine decay.  The objective itself is the published flat CE (no reweighting).

Determinism: everything derives from ``--seed`` (python ``random`` for data, a torch generator for
noise, ``torch.manual_seed`` for init); torch CPU kernels are deterministic for a fixed thread count.
Quick evaluations run under ``torch.random.fork_rng`` and do not disturb training.

Output (``--out``, default ``mlx_dgemma/demo``): ``config.json``, ``model.safetensors`` (fp32),
``generation_config.json``, ``tokenizer.model``, ``tokenizer_config.json`` (chat template + special
ids), ``special_tokens_map.json``, ``training_args.json``.  The reference requires a vision
sub-config (``vision_config=None`` builds a default 16-layer tower); we keep a 1-layer, 16-wide one
whose weights are ~50 KB, so the reference loads the checkpoint with no missing keys.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time

import torch
import torch.nn.functional as F


def _load_tasks():
    # by file path: mlx_dgemma/__init__.py may import mlx, which training does not need
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mlx_dgemma", "demo", "tasks.py")
    spec = importlib.util.spec_from_file_location("mlx_dgemma_tasks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tasks = _load_tasks()

PAD, EOS, BOS, UNK, MASK = 0, 1, 2, 3, 4
CHAT_TOKENS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_response>"]

# The generation prompt ends with an empty thought channel: the demo answers without thinking. It
# keeps Gemma 4's thinking switch (enable_thinking: "<|think|>" opens the system turn, the model's turn
# is left open for a thought), which the demo was never trained on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- if thinking and messages[0]['role'] != 'system' -%}{{ '<|turn>system\n<|think|>\n<turn|>\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<|turn>' + role + '\n' }}"
    "{%- if thinking and loop.first and role == 'system' -%}{{ '<|think|>\n' }}{%- endif -%}"
    "{%- if role == 'model' -%}{{ '<|channel>thought\n<channel|>' }}{%- endif -%}"
    "{{ message['content'] | trim }}{{ '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}"
    "{%- if not thinking -%}{{ '<|channel>thought\n<channel|>' }}{%- endif -%}{%- endif -%}"
)


def render_prompt(prompt: str, system: str | None = None) -> str:
    """The chat-template text of a one-turn conversation with the generation prompt (no ``<bos>``)."""
    s = ""
    if system:
        s += f"<|turn>system\n{system}<turn|>\n"
    return s + f"<|turn>user\n{prompt}<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"


# ----------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(out_dir: str, seed: int) -> str:
    import sentencepiece as spm

    rng = random.Random(seed * 1000 + 7)
    lines = tasks.corpus(rng, 300)
    lines += [
        render_prompt("x", "you are a helpful assistant"),
        tasks.LETTERS,
        tasks.LETTERS.upper(),
        "0123456789",
        "{}[]\":,.=-+_!?'()/ ",
        "system user model thought",
    ]
    prefix = os.path.join(out_dir, "tokenizer")
    cwd = os.getcwd()
    os.chdir(out_dir)  # a relative model_prefix: the trainer spec stored in the model then has no temp path
    try:
        _train_spm(spm, lines)
    finally:
        os.chdir(cwd)
    os.remove(prefix + ".vocab")
    return prefix + ".model"


def _train_spm(spm, lines):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix="tokenizer",
        model_type="char",
        vocab_size=512,
        hard_vocab_limit=False,
        character_coverage=1.0,
        pad_id=PAD,
        eos_id=EOS,
        bos_id=BOS,
        unk_id=UNK,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        control_symbols=["<mask>"],
        user_defined_symbols=CHAT_TOKENS + ["\n"],
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        minloglevel=2,
    )


class Tok:
    def __init__(self, model_file: str):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.sp.get_piece_size()
        ids = {p: self.sp.piece_to_id(p) for p in ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + CHAT_TOKENS}
        assert [ids[p] for p in ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]] == [0, 1, 2, 3, 4], ids
        self.ids = ids
        self.turn_end = ids["<turn|>"]
        self.tool_response = ids["<|tool_response>"]
        for p in CHAT_TOKENS + ["\n"]:
            assert len(self.sp.encode(p)) == 1, p

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


def answer_from_ids(tok: Tok, new_ids, stop_ids) -> str:
    """Cut the generated ids at the first stop id, decode, strip any thought-channel scaffolding."""
    out = []
    for i in new_ids:
        i = int(i)
        if i in stop_ids:
            break
        out.append(i)
    text = tok.decode([i for i in out if i != PAD])
    if "<channel|>" in text:
        text = text.split("<channel|>", 1)[1]
    return text.strip()


# ----------------------------------------------------------------------------------------------
# model


# The demo's context: training prompts are short, but RoPE takes any position, and chat UIs send long
# prompts of their own (Open WebUI's title and follow-up requests reach 1,000-1,600 demo tokens).
CONTEXT = 8192


def build_config(args, vocab_size: int):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig

    n = args.layers
    layer_types = [
        "full_attention" if (i + 1) % args.full_every == 0 or i == n - 1 else "sliding_attention" for i in range(n)
    ]
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=n,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        global_head_dim=args.global_head_dim,
        num_global_key_value_heads=args.global_kv_heads,
        layer_types=layer_types,
        sliding_window=args.sliding_window,
        num_experts=args.experts,
        top_k_experts=args.top_k,
        max_position_embeddings=CONTEXT,
        use_bidirectional_attention="vision",
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    text.final_logit_softcapping = 30.0
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        position_embedding_size=16,
    )
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=args.canvas,
        image_token_id=vocab_size,
        boi_token_id=vocab_size + 1,
        eoi_token_id=vocab_size + 2,
    )


def softcap(model, h):
    logits = model.lm_head(h).float()
    c = model.final_logit_softcapping
    return torch.tanh(logits / c) * c


# ----------------------------------------------------------------------------------------------
# data


def make_example(tok: Tok, task: str, rng: random.Random, C: int, split="train"):
    prompt, answer = tasks.make_instance(task, rng, split)
    prefix = [BOS] + tok.encode(render_prompt(prompt))
    ans = tok.encode(answer) + [tok.turn_end]
    K = (len(ans) + C - 1) // C
    return prefix, ans + [PAD] * (K * C - len(ans)), K, len(ans)


class Batches:
    """Deterministic stream of batches, bucketed by canvas count (no compute on unscored canvases)."""

    def __init__(self, tok, C, batch, seed, weights):
        self.tok, self.C, self.B = tok, C, batch
        self.rng = random.Random(seed)
        self.weights = weights
        self.queues: dict[int, list] = {}

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            task = self.rng.choices(tasks.TASKS, weights=self.weights)[0]
            ex = make_example(self.tok, task, self.rng, self.C)
            q = self.queues.setdefault(ex[2], [])
            q.append(ex)
            if len(q) == self.B:
                self.queues[ex[2]] = []
                return collate(q, self.C)


def collate(examples, C):
    B = len(examples)
    P = max(len(e[0]) for e in examples)
    K = examples[0][2]
    L = P + K * C
    ids = torch.full((B, L), PAD, dtype=torch.long)
    npad = torch.zeros(B, dtype=torch.long)
    enc_target_mask = torch.zeros(B, L, dtype=torch.bool)  # position i predicts ids[i+1]
    for b, (prefix, canv, _, n_ans) in enumerate(examples):
        n = P - len(prefix)
        npad[b] = n
        ids[b, n:P] = torch.tensor(prefix)
        ids[b, P:] = torch.tensor(canv)
        enc_target_mask[b, n : P + n_ans - 1] = True  # targets up to and including <turn|>
    return ids, npad, P, K, enc_target_mask


def build_masks(B, P, K, C, W, npad):
    """4-D boolean masks (True = attend) for the encoder (causal) and the decoder (canvas k -> prefix + canvas k)."""
    L = P + K * C
    idx = torch.arange(L)
    valid_key = idx[None, :] >= npad[:, None]  # [B, L]
    causal = idx[None, :] <= idx[:, None]  # [q, k]
    window = idx[None, :] > idx[:, None] - W
    eye = torch.eye(L, dtype=torch.bool)
    enc_full = (causal[None] & valid_key[:, None, :]) | eye[None]
    enc_slide = (causal[None] & window[None] & valid_key[:, None, :]) | eye[None]

    q_canvas = torch.arange(K * C) // C  # canvas index of each decoder query
    start = P + q_canvas * C  # the prefix length canvas k sees
    cache_full = (idx[None, :] < start[:, None])[None] & valid_key[:, None, :]  # [B, KC, L]
    cache_slide = cache_full & (idx[None, :] >= (start[:, None] - (W - 1)))[None]
    own = (q_canvas[:, None] == q_canvas[None, :])[None].expand(B, -1, -1)
    dec_full = torch.cat([cache_full, own], dim=-1)
    dec_slide = torch.cat([cache_slide, own], dim=-1)
    enc = {"full_attention": enc_full[:, None], "sliding_attention": enc_slide[:, None]}
    dec = {"full_attention": dec_full[:, None], "sliding_attention": dec_slide[:, None]}
    return enc, dec


def draw_noise(B, K, C, V, gen, args):
    """The random draws of one step: noise level per canvas, renoised positions and their uniform
    tokens, the self-conditioning choice per example and its temperature."""
    t = torch.rand(B, K, 1, generator=gen) * (1 - 0.001) + 0.001
    replace = (torch.rand(B, K, C, generator=gen) < t).view(B, K * C)
    tokens = torch.randint(0, V, (B, K * C), generator=gen)
    sc_mask = torch.rand(B, generator=gen) < args.sc_prob
    temp = torch.rand(B, 1, 1, generator=gen) * (args.t_max - args.t_min) + args.t_min
    return {"t": t, "replace": replace, "tokens": tokens, "sc_mask": sc_mask, "temp": temp}


def objective(model, batch, noise, C, W):
    """Decoder CE, encoder CE and the decoder's logits of one batch under the given noise draws."""
    from transformers import DynamicCache

    ids, npad, P, K, enc_tmask = batch
    B, L = ids.shape
    enc_mask, dec_mask = build_masks(B, P, K, C, W, npad)
    pos = (torch.arange(L)[None, :] - npad[:, None]).clamp(min=0)

    cache = DynamicCache()
    enc_out = model.model.encoder(input_ids=ids, attention_mask=enc_mask, position_ids=pos, cache=cache)
    enc_logits = softcap(model, enc_out.last_hidden_state[:, :-1])
    tgt = ids[:, 1:]
    m = enc_tmask[:, :-1]
    enc_loss = F.cross_entropy(enc_logits[m], tgt[m])

    clean = ids[:, P:]
    noisy = torch.where(noise["replace"], noise["tokens"], clean)
    dpos = pos[:, P:]
    sc_mask = noise["sc_mask"]
    sc_logits = None
    if sc_mask.any():
        with torch.no_grad():
            h0 = model.model.decoder(
                decoder_input_ids=noisy, cache=cache, decoder_attention_mask=dec_mask, decoder_position_ids=dpos
            ).last_hidden_state
            sc_logits = (softcap(model, h0) / noise["temp"]).detach()
    h = model.model.decoder(
        decoder_input_ids=noisy,
        cache=cache,
        self_conditioning_logits=sc_logits,
        self_conditioning_mask=sc_mask if sc_logits is not None else None,
        decoder_attention_mask=dec_mask,
        decoder_position_ids=dpos,
    ).last_hidden_state
    logits = softcap(model, h)
    dec_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), clean.reshape(-1))
    return dec_loss, enc_loss, logits


def train_step(model, batch, args, gen, V):
    ids, _, _, K, _ = batch
    noise = draw_noise(ids.shape[0], K, args.canvas, V, gen, args)
    dec_loss, enc_loss, logits = objective(model, batch, noise, args.canvas, args.sliding_window)
    with torch.no_grad():
        acc = (logits.argmax(-1) == ids[:, batch[2] :]).float().mean()
    return dec_loss, enc_loss, acc, ids.shape[0] * (ids.shape[1] + K * args.canvas)


# ----------------------------------------------------------------------------------------------
# generation helpers (reference generate)


def gen_config(args, tok):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    return DiffusionGemmaGenerationConfig(
        max_new_tokens=args.max_new_tokens,
        max_denoising_steps=args.max_denoising_steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=args.entropy_bound),
        t_min=args.t_min,
        t_max=args.t_max,
        stability_threshold=1,
        confidence_threshold=0.005,
        bos_token_id=BOS,
        eos_token_id=[EOS, tok.turn_end, tok.tool_response],
        pad_token_id=PAD,
    )


class StepCounter:
    """A streamer that counts denoising steps per canvas (``put_draft`` is called after every step)."""

    def __init__(self):
        self.steps, self.cur, self.started = [], 0, False

    def put(self, value):
        if not self.started:  # the prompt
            self.started = True
            return
        self.steps.append(self.cur)
        self.cur = 0

    def put_draft(self, value):
        self.cur += 1

    def end(self):
        pass


@torch.no_grad()
def run_generate(model, tok, prompt: str, seed: int):
    stop = {EOS, tok.turn_end, tok.tool_response}
    ids = torch.tensor([[BOS] + tok.encode(render_prompt(prompt))])
    counter = StepCounter()
    torch.manual_seed(seed)
    out = model.generate(ids, streamer=counter)
    new = out.sequences[0, ids.shape[1] :].tolist()
    return answer_from_ids(tok, new, stop), counter.steps, float(out.tokens_per_forward[0])


def quick_eval(model, tok, n, seed):
    model.eval()
    rng = random.Random(10_000 + seed)
    res, steps = {}, []
    with torch.random.fork_rng():
        for task in tasks.TASKS:
            ok = 0
            for i in range(n):
                p, _ = tasks.make_instance(task, rng, "eval")
                text, s, _ = run_generate(model, tok, p, seed=i)
                ok += tasks.check(task, p, text)
                steps += s
            res[task] = ok / n
    model.train()
    steps.sort()
    return res, (steps[len(steps) // 2] if steps else 0)


# ----------------------------------------------------------------------------------------------
# saving


def save(model, tok_file, args, tok, out_dir, info):
    import shutil

    os.makedirs(out_dir, exist_ok=True)
    model.generation_config = gen_config(args, tok)
    model.save_pretrained(out_dir)
    shutil.copyfile(tok_file, os.path.join(out_dir, "tokenizer.model"))
    special = {
        "pad_token": "<pad>",
        "eos_token": "<eos>",
        "bos_token": "<bos>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    }
    tc = {
        "tokenizer_class": "GemmaTokenizer",
        **special,
        "pad_token_id": PAD,
        "eos_token_id": EOS,
        "bos_token_id": BOS,
        "unk_token_id": UNK,
        "mask_token_id": MASK,
        "add_bos_token": True,
        "add_eos_token": False,
        "padding_side": "left",
        "stop_token_ids": [EOS, tok.turn_end, tok.tool_response],
        "special_token_ids": {p: tok.ids[p] for p in CHAT_TOKENS},
        "sp_model_kwargs": {},
        "model_type": "char, byte_fallback, split_digits, identity normalisation, no dummy prefix",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
    with open(os.path.join(out_dir, "training_args.json"), "w") as f:
        json.dump({"args": vars(args), **info}, f, indent=2)


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mlx_dgemma", "demo")
    )
    ap.add_argument("--steps", type=int, default=2600)
    ap.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="stop early after this many minutes (0: no limit; breaks exact reproducibility)",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--task-weights", default="1,1,1,1", help="sampling weights for sort,reverse,add,json")
    ap.add_argument("--enc-loss-weight", type=float, default=1.0)
    ap.add_argument("--sc-prob", type=float, default=0.5)
    ap.add_argument(
        "--qk-norm-init", type=int, default=1, help="init q_norm/k_norm weights to head_dim**-0.25 (1) or 1.0 (0)"
    )
    # architecture
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=96)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--full-every", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--global-head-dim", type=int, default=64)
    ap.add_argument("--global-kv-heads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--sliding-window", type=int, default=32)
    ap.add_argument("--canvas", type=int, default=32)
    # generation config
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-denoising-steps", type=int, default=24)
    ap.add_argument("--entropy-bound", type=float, default=0.1)
    ap.add_argument("--t-min", type=float, default=0.4)
    ap.add_argument("--t-max", type=float, default=0.8)
    # logging
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-n", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=500)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out_dir = os.path.abspath(args.out)
    t_start = time.time()

    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tmp = tempfile.mkdtemp(prefix="dgemma_tok_")
    tok_file = train_tokenizer(tmp, args.seed)
    tok = Tok(tok_file)
    V = tok.vocab_size
    cfg = build_config(args, V)
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = DiffusionGemmaForBlockDiffusion(cfg)
    model.config._attn_implementation = "sdpa"
    if args.qk_norm_init:
        # Attention scaling is 1.0 (QK-norm): with q_norm/k_norm weights at their default 1.0 the initial
        # attention logits have std ~sqrt(head_dim), i.e. near one-hot attention to random positions, and
        # the decoder never learned to read the prompt (run 1: reverse/json outputs ignored the prompt
        # after 1500 steps).  Initialising both weights to head_dim**-0.25 gives the usual 1/sqrt(d)
        # logit scale at init; the weights stay learnable (architecture unchanged).
        with torch.no_grad():
            for layer in model.model.decoder.layers:
                a = layer.self_attn
                a.q_norm.weight.fill_(a.head_dim**-0.25)
                a.k_norm.weight.fill_(a.head_dim**-0.25)
    model.train()
    model.generation_config = gen_config(args, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {V}, layer_types {cfg.text_config.layer_types}, params {n_params / 1e6:.2f} M", flush=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    weights = [float(x) for x in args.task_weights.split(",")]
    batches = Batches(tok, args.canvas, args.batch, args.seed, weights)
    gen = torch.Generator().manual_seed(args.seed + 1)
    tok_count, t_log, agg = 0, time.time(), [0.0, 0.0, 0.0, 0]
    history = []
    step = 0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = next(batches)
        dec_loss, enc_loss, acc, ntok = train_step(model, batch, args, gen, V)
        loss = dec_loss + args.enc_loss_weight * enc_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tok_count += ntok
        agg[0] += dec_loss.item()
        agg[1] += enc_loss.item()
        agg[2] += acc.item()
        agg[3] += 1
        if (step + 1) % args.log_every == 0:
            dt = time.time() - t_log
            print(
                f"step {step + 1:5d} lr {lr_at(step):.2e} dec {agg[0] / agg[3]:.4f} enc {agg[1] / agg[3]:.4f} "
                f"canvas_acc {agg[2] / agg[3]:.3f} tok/s {tok_count / dt:.0f} elapsed {(time.time() - t_start) / 60:.1f} min",
                flush=True,
            )
            tok_count, t_log, agg = 0, time.time(), [0.0, 0.0, 0.0, 0]
        if args.eval_every and (step + 1) % args.eval_every == 0:
            te = time.time()
            res, med = quick_eval(model, tok, args.eval_n, args.seed)
            history.append({"step": step + 1, **res, "median_steps": med})
            print(
                f"  eval@{step + 1}: "
                + " ".join(f"{k} {v:.2f}" for k, v in res.items())
                + f" median_steps/canvas {med} ({time.time() - te:.0f}s)",
                flush=True,
            )
            t_log += time.time() - te
        if args.save_every and (step + 1) % args.save_every == 0:
            save(model, tok_file, args, tok, out_dir, {"steps_done": step + 1, "eval_history": history})
        if args.time_limit and (time.time() - t_start) > args.time_limit * 60:
            print(f"time limit reached at step {step + 1}", flush=True)
            break
    model.eval()
    info = {
        "steps_done": step + 1,
        "train_minutes": (time.time() - t_start) / 60,
        "eval_history": history,
        "torch": torch.__version__,
    }
    save(model, tok_file, args, tok, out_dir, info)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"saved {out_dir} ({size / 1e6:.2f} MB) after {(time.time() - t_start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
