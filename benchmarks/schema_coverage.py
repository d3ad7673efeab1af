"""JSON schemas as people write them, over a JSONSchemaBench checkout (github guidance-ai/jsonschemabench,
its ``data/``: one folder of schema files per dataset), on the bundled demo model:

- per dataset, the share of schemas this project answers (``request.prepare`` takes the request: the
  canvas template or the grammar lays the answer out) beside the share llguidance compiles with its
  own defaults, on the same tokenizer in the same run, and this project's compile time;
- on a seeded sample of the schemas, every answer under each policy checked by jsonschema with
  formats checked: validated, invalid (each one listed), unchecked (jsonschema cannot read the
  schema), refused, errors, and the finish reasons;
- what the grammar costs per token: autoregressive decoding with a schema against without one, on the
  same prompts, and the host's share of it (the mask alone, and the whole grammar rule).

    python benchmarks/schema_coverage.py jsonschemabench/data --json schema_coverage.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from mlx_dgemma import fast_blas

fast_blas.load()
import llguidance  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from jsonschema.exceptions import best_match  # noqa: E402
from jsonschema.validators import validator_for  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mlx_dgemma import load, stream_generate  # noqa: E402
from mlx_dgemma.engine.grammar_rule import GrammarRule  # noqa: E402
from mlx_dgemma.engine.request import prepare  # noqa: E402
from mlx_dgemma.generate import DEMO_MODEL  # noqa: E402
from mlx_dgemma.options import GenerationArgs  # noqa: E402
from mlx_dgemma.structured.grammar import allowed_tokens  # noqa: E402

POLICIES = ("reference", "ar", "verified", "auto")
PROMPT_CHARS = 80  # of a schema's title in its prompt


@dataclass
class Entry:
    """One schema file: its dataset, path and schema (None: the file is not JSON)."""

    dataset: str
    path: Path
    schema: object

    @property
    def prompt(self) -> str:
        """ "json: " and the schema's title, or its file's name (the demo's json task reads "json: ...")."""
        title = self.schema.get("title") if isinstance(self.schema, dict) else None
        name = title if isinstance(title, str) and title.strip() else self.path.stem
        return "json: " + " ".join(name.split())[:PROMPT_CHARS]


def read_datasets(root: Path) -> list[Entry]:
    """Every file of every folder under ``root``, by dataset and file name."""
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    entries = []
    for folder in folders:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            try:
                schema = json.loads(path.read_text())
            except (ValueError, UnicodeDecodeError):
                schema = None
            entries.append(Entry(folder.name, path, schema))
    return entries


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def coverage(model, tokenizer, entries: list[Entry], max_tokens: int) -> list[dict]:
    """Per schema: whether this project answers it (by template or grammar, in how many ms, or why
    not) and whether llguidance compiles it with its defaults, on the tokenizer the grammars use."""
    lltokenizer = prepare(model, tokenizer, "json: ", GenerationArgs(schema={}, policy="ar")).grammar.tokenizer
    rows = []
    for entry in tqdm(entries, desc="coverage", file=sys.stderr, mininterval=2):
        row = {
            "dataset": entry.dataset,
            "file": entry.path.name,
            "ours": False,
            "by": None,
            "refusal": None,
            "llguidance": False,
        }
        rows.append(row)
        if entry.schema is None:
            row["refusal"] = "not JSON"
            continue
        tic = time.perf_counter()
        try:
            job = prepare(model, tokenizer, entry.prompt, GenerationArgs(schema=entry.schema, max_tokens=max_tokens))
            row.update(ours=True, by="grammar" if job.grammar is not None else "template")
        except ValueError as e:
            row["refusal"] = str(e)
        row["ms"] = (time.perf_counter() - tic) * 1e3
        row["llguidance"] = llguidance_compiles(entry.schema, lltokenizer)
    return rows


def llguidance_compiles(schema, lltokenizer) -> bool:
    """llguidance's own verdict, with its default JSON options."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except ValueError:
        return False
    return llguidance.LLMatcher.validate_grammar(grammar, lltokenizer) == ""


def coverage_table(rows: list[dict]) -> list[dict]:
    """Per dataset and for all: schemas, shares answered (and by template), compiled by llguidance,
    the counts where only one of the two takes a schema, and this project's compile time."""
    out = []
    for name in sorted({r["dataset"] for r in rows}) + ["all"]:
        mine = [r for r in rows if name in ("all", r["dataset"])]
        times = [r["ms"] for r in mine if r["ours"]]
        n = len(mine)
        out.append(
            {
                "dataset": name,
                "schemas": n,
                "ours": sum(r["ours"] for r in mine) / n,
                "template": sum(r["by"] == "template" for r in mine) / n,
                "llguidance": sum(r["llguidance"] for r in mine) / n,
                "llguidance_only": sum(r["llguidance"] and not r["ours"] for r in mine),
                "ours_only": sum(r["ours"] and not r["llguidance"] for r in mine),
                "answer_too_long": sum("shortest answer takes" in (r["refusal"] or "") for r in mine),
                "compile_ms_p50": percentile(times, 50),
                "compile_ms_p99": percentile(times, 99),
            }
        )
    return out


def top_refusals(rows: list[dict], n: int = 10) -> list[tuple[str, int]]:
    """The most frequent refusal messages (their first 90 characters)."""
    return Counter(" ".join(r["refusal"].split())[:90] for r in rows if r["refusal"]).most_common(n)


def check_answer(schema, text: str) -> tuple[str, str | None]:
    """ "validated", or "invalid" with why, or "unchecked" when jsonschema cannot read the schema."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return "invalid", f"not JSON: {e}"
    try:
        cls = validator_for(schema)
        error = best_match(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    except Exception as e:  # noqa: BLE001 -- an odd schema can break jsonschema in many ways (bad regex, refs)
        return "unchecked", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return ("validated", None) if error is None else ("invalid", f"{error.json_path}: {error.message[:200]}")


def answer(model, tokenizer, entry: Entry, policy: str, args) -> dict:
    """One generation: its outcome (validated, invalid, unchecked, refused, error), text, tokens, finish."""
    out = {"dataset": entry.dataset, "file": entry.path.name, "policy": policy}
    responses = stream_generate(
        model,
        tokenizer,
        entry.prompt,
        max_tokens=args.max_tokens,
        schema=entry.schema,
        policy=policy,
        seed=args.seed,
        temperature=args.temperature,
    )
    text, last = "", None
    try:
        for last in responses:
            text += last.text
    except ValueError as e:
        if last is None:  # raised before any forward: the request is refused
            return {**out, "outcome": "refused", "why": " ".join(str(e).split())[:200]}
        return {**out, "outcome": "error", "why": f"{type(e).__name__}: {e}"[:300], "text": text}
    except Exception as e:  # noqa: BLE001 -- a failed generation is a figure of this benchmark, not its end
        return {**out, "outcome": "error", "why": f"{type(e).__name__}: {e}"[:300], "text": text}
    outcome, why = check_answer(entry.schema, text)
    return {
        **out,
        "outcome": outcome,
        "why": why,
        "text": text,
        "tokens": last.generation_tokens,
        "finish": last.finish_reason,
    }


def policy_table(answers: list[dict], policies) -> list[dict]:
    out = []
    for policy in policies:
        mine = [a for a in answers if a["policy"] == policy]
        counts = Counter(a["outcome"] for a in mine)
        answered = counts["validated"] + counts["invalid"] + counts["unchecked"]
        out.append(
            {
                "policy": policy,
                "schemas": len(mine),
                "answered": answered,
                "validated": counts["validated"],
                "invalid": counts["invalid"],
                "unchecked": counts["unchecked"],
                "refused": counts["refused"],
                "errors": counts["error"],
                "finish": dict(Counter(a["finish"] for a in mine if "finish" in a).most_common()),
            }
        )
    return out


def decode(
    model, tokenizer, prompt: str, schema, max_tokens: int, seed: int, temperature: float | None = None
) -> tuple[list[int], float]:
    """An autoregressive answer's tokens and its decoding seconds (after the prompt's prefill)."""
    tokens, last = [], None
    for last in stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, schema=schema, policy="ar", seed=seed, temperature=temperature
    ):
        tokens += last.tokens
    return tokens, last.generation_tokens / last.generation_tps


def grammar_cost(model, tokenizer, entries: list[Entry], args) -> dict:
    """On the first ``args.cost_schemas`` of ``entries`` that the grammar takes under ar, alternately
    with and without the schema (same prompt, max_tokens and seed): decoding ms per token each, and,
    replaying each structured answer, the ms per token of the mask alone and of the grammar rule
    (mask, choice, closing-path guard, consuming the token)."""
    vocab = model.config.vocab_size
    sums, mask_times, rule_times = Counter(), [], []
    taken = 0
    progress = tqdm(total=args.cost_schemas, desc="grammar cost", file=sys.stderr)
    for entry in entries:
        if taken == args.cost_schemas:
            break
        try:
            job = prepare(
                model,
                tokenizer,
                entry.prompt,
                GenerationArgs(schema=entry.schema, policy="ar", max_tokens=args.max_tokens),
            )
        except ValueError:
            continue
        tokens, seconds = decode(
            model, tokenizer, entry.prompt, entry.schema, args.max_tokens, args.seed, args.temperature
        )
        free_tokens, free_seconds = decode(
            model, tokenizer, entry.prompt, None, args.max_tokens, args.seed, args.temperature
        )
        sums.update(
            structured_tokens=len(tokens), structured_s=seconds, free_tokens=len(free_tokens), free_s=free_seconds
        )
        masks, rules = replay(job.grammar, tokens, vocab, args.max_tokens)
        sums.update(mask_s=sum(masks), rule_s=sum(rules))
        mask_times += masks
        rule_times += rules
        taken += 1
        progress.update()
    progress.close()
    if not taken:
        return {"schemas": 0}
    per = {
        "structured": sums["structured_s"] / sums["structured_tokens"],
        "free": sums["free_s"] / sums["free_tokens"],
        "mask": sums["mask_s"] / sums["structured_tokens"],
        "rule": sums["rule_s"] / sums["structured_tokens"],
    }
    per = {k: v * 1e3 for k, v in per.items()}
    return {
        "schemas": taken,
        "structured_tokens": sums["structured_tokens"],
        "free_tokens": sums["free_tokens"],
        "ms_per_token": per,
        "structured_over_free": per["structured"] / per["free"],
        "rule_over_free": per["rule"] / per["free"],
        "per_token_ms": {
            "mask": [percentile(mask_times, q) * 1e3 for q in (50, 99)],
            "rule": [percentile(rule_times, q) * 1e3 for q in (50, 99)],
        },
    }


def replay(grammar, tokens: list[int], vocab: int, max_tokens: int) -> tuple[list[float], list[float]]:
    """Seconds of ``allowed_tokens`` at each of ``tokens``, and of ``GrammarRule.step`` given logits that
    pick each token in turn (the host's whole work per token of a grammar row: mask, choice, the search
    for a closing path after the token)."""
    matcher, masks = grammar.matcher(), []
    for token in tokens:
        if matcher.is_stopped():
            break
        tic = time.perf_counter()
        allowed_tokens(matcher, vocab)
        masks.append(time.perf_counter() - tic)
        matcher.consume_token(token)
    rule, rules = GrammarRule(grammar, vocab, max_tokens), []
    for token in tokens:
        logits = mx.zeros((vocab,)).at[token].add(1.0)
        mx.eval(logits)
        tic = time.perf_counter()
        if rule.step(logits) is None:
            break
        rules.append(time.perf_counter() - tic)
    return masks, rules


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def ms(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(result: dict) -> str:
    load = "/".join(f"{x:.1f}" for x in result["load_average"]["start"])
    temperature = result["args"]["temperature"]
    lines = [
        f"llguidance {result['llguidance']}, max_tokens {result['args']['max_tokens']}, temperature "
        f"{'default' if temperature is None else temperature}, {result['blas']}, "
        f"load average at the start {load}",
        "",
        "| dataset | schemas | this project | by template | llguidance | llguidance only | this project only "
        "| shortest answer too long | compile p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["coverage"]:
        name = f"**{r['dataset']}**" if r["dataset"] == "all" else r["dataset"]
        lines.append(
            f"| {name} | {r['schemas']} | {pct(r['ours'])} | {pct(r['template'])} | {pct(r['llguidance'])} "
            f"| {r['llguidance_only']} | {r['ours_only']} | {r['answer_too_long']} "
            f"| {ms(r['compile_ms_p50'])} / {ms(r['compile_ms_p99'])} |"
        )
    lines += [
        "",
        f"{result['args']['sample']} schemas drawn with seed {result['args']['seed']}; formats checked: "
        f"{', '.join(result['formats'])}",
        "",
        "| policy | schemas | answered | validated | invalid | unchecked | refused | errors | finish reasons |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["policies"]:
        finish = ", ".join(f"{k} {v}" for k, v in r["finish"].items())
        lines.append(
            f"| {r['policy']} | {r['schemas']} | {r['answered']} | {r['validated']} | {r['invalid']} "
            f"| {r['unchecked']} | {r['refused']} | {r['errors']} | {finish} |"
        )
    cost = result["cost"]
    if cost["schemas"]:
        per = cost["ms_per_token"]
        lines += [
            "",
            f"ar on {cost['schemas']} schemas, with the schema ({cost['structured_tokens']} tokens) and without "
            f"({cost['free_tokens']} tokens):",
            "",
            "| per token | ms |",
            "|---|---:|",
            f"| ar, unconstrained | {per['free']:.3f} |",
            f"| ar, with the schema | {per['structured']:.3f} |",
            f"| the mask alone | {per['mask']:.3f} |",
            f"| the grammar rule (mask, choice, closing path) | {per['rule']:.3f} |",
            *(
                f"| {name}, p50 / p99 per token | {p50:.3f} / {p99:.3f} |"
                for name, (p50, p99) in [
                    ("the mask", cost["per_token_ms"]["mask"]),
                    ("the grammar rule", cost["per_token_ms"]["rule"]),
                ]
            ),
            f"| **structured / unconstrained** | **{cost['structured_over_free']:.2f}x** |",
            f"| the grammar rule / an unconstrained token | {cost['rule_over_free']:.3f}x |",
        ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", metavar="DIR", type=Path, help="JSONSchemaBench's data/: a folder per dataset")
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--sample", type=int, default=100, help="schemas drawn for the answers under each policy")
    p.add_argument("--seed", type=int, default=0, help="draws the sample and seeds each generation")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, help="of every answer (default: the model's own)")
    p.add_argument("--policy", action="append", choices=POLICIES, help="repeat for several (default: all four)")
    p.add_argument("--cost-schemas", type=int, default=10, help="schemas the per-token cost is measured on")
    p.add_argument("--json", type=Path, help="write every figure, each schema's verdicts and each invalid answer here")
    args = p.parse_args()
    if args.sample < 0 or args.cost_schemas < 0 or args.max_tokens < 1:
        raise SystemExit("--sample and --cost-schemas take 0 or more, --max-tokens 1 or more")
    entries = read_datasets(args.data)
    if not entries:
        raise SystemExit(f"{args.data} has no folders of schema files; give JSONSchemaBench's data/ folder")
    policies = args.policy or list(POLICIES)
    model, tokenizer = load(args.model)
    load_at_start = os.getloadavg()

    rows = coverage(model, tokenizer, entries, args.max_tokens)
    readable = [e for e in entries if e.schema is not None]
    sample = random.Random(args.seed).sample(readable, min(args.sample, len(readable)))
    answers = []
    for entry in tqdm(sample, desc="answers", file=sys.stderr):
        answers += [answer(model, tokenizer, entry, policy, args) for policy in policies]  # policies take turns
    cls = validator_for({})
    result = {
        "machine": f"{platform.system()} {platform.machine()}, {platform.processor() or 'cpu'}",
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
        "blas": fast_blas.describe(),
        "mlx": mx.__version__,
        "llguidance": version("llguidance"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "formats": sorted(cls.FORMAT_CHECKER.checkers),
        "coverage": coverage_table(rows),
        "top_refusals": top_refusals(rows),
        "schemas": rows,
        "policies": policy_table(answers, policies),
        "invalid": [a for a in answers if a["outcome"] in ("invalid", "error")],
        "cost": grammar_cost(model, tokenizer, sample, args),
    }
    print(markdown(result))
    for message, count in result["top_refusals"]:
        print(f"refused {count}x: {message}", file=sys.stderr)
    for a in result["invalid"]:
        print(
            f"{a['outcome']}: {a['dataset']}/{a['file']} under {a['policy']}: {a['why']}; answer {a.get('text')!r}",
            file=sys.stderr,
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
