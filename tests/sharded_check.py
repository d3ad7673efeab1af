"""Launched by tests/test_distributed.py under ``mlx.launch``: every rank loads a checkpoint whole
and sharded, runs the batch engine, a template and a JSON schema on both, and rank 0 prints one
JSON line of what it saw (the test compares)."""

import json
import sys
from pathlib import Path

import mlx.core as mx  # noqa: E402  (after mlx_dgemma: its BLAS first)

from mlx_dgemma import batch_generate, distributed, generate, json_template, load

group = distributed.init()
folder = Path(sys.argv[1])
whole, tokenizer = load(folder)
part, _ = distributed.sharded_load(folder, group)
prompts = ["sort: 42 17 85 23 61", "reverse: a b c d e", "json: name=ada age=36"]
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "age"],
}
out = {"ranks": group.size(), "experts": [part.layers[0].experts.shard.start, part.layers[0].experts.shard.stop]}
for name, model in (("whole", whole), ("sharded", part)):
    out[name] = {
        "batch": batch_generate(model, tokenizer, prompts, 64, seeds=[1, 2, 3]).texts,
        "batch_ar": batch_generate(model, tokenizer, prompts, 64, seeds=[1, 2, 3], policy="ar").texts,
        "template": generate(model, tokenizer, prompts[0], template="17 {{fill:8}} 85", seed=4),
        "schema": generate(model, tokenizer, prompts[2], template=json_template(tokenizer, schema), seed=5),
        "no_seed": generate(model, tokenizer, prompts[1], max_tokens=32) if name == "sharded" else None,
    }
mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
if group.rank() == 0:
    print(json.dumps(out), flush=True)
