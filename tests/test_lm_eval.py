"""lm-evaluation-harness against a real server on the demo, as its users run it: ``local-completions``
with its defaults (the server's own tokenizer through /tokenize, token-id prompts, batches of prompts),
one loglikelihood task (multiple choice: echoed prompts' log-probabilities) and one generate_until
task, each over a local jsonl (no download). The harness's choices must be those the encoder's
log-probabilities computed in process make, its answers ``generate``'s, and no request refused."""

import json
import random

import pytest

from mlx_dgemma import generate
from mlx_dgemma.demo.tasks import make_instance
from mlx_dgemma.engine.scoring import sequence_logprobs

from .test_server import MODEL_ID, serving

lm_eval = pytest.importorskip("lm_eval")

DOCS = 4  # sort prompts per task
SEED = 1234  # the harness's default seed, which it sends with every request


def sort_docs(tokenizer) -> list[dict]:
    rng = random.Random(7)
    docs = []
    for _ in range(DOCS):
        prompt, answer = make_instance("sort", rng, split="eval")
        numbers = answer.split()
        wrong = [" ".join(reversed(numbers)), " ".join(numbers[1:] + numbers[:1])]
        # The demo answers chat turns: the prompt is its chat template's rendering, special tokens as text
        # (the server's /tokenize reads them as their ids).
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False)
        docs.append({"question": text, "choices": [answer, *wrong], "answer": 0, "target": answer})
    return docs


def write_tasks(folder, docs: list[dict]) -> None:
    data = folder / "sort.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "doc_to_text: '{{question}}'\n"
    )
    (folder / "sort_choice.yaml").write_text(
        "task: demo_sort_choice\n" + common + "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "sort_generate.yaml").write_text(
        "task: demo_sort_generate\n" + common + "output_type: generate_until\ndoc_to_target: '{{target}}'\n"
        "target_delimiter: ''\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 64\n"
        "metric_list:\n  - metric: exact_match\n"
    )


@pytest.mark.slow  # about a minute; test_server_logprobs.py sends the same request shapes in the default suite
def test_harness_scores_a_loglikelihood_and_a_generate_task(demo, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model, tokenizer = demo
    docs = sort_docs(tokenizer)
    write_tasks(tmp_path, docs)
    statuses = []
    with serving(model, tokenizer, statuses=statuses) as url:
        results = simple_evaluate(
            model="local-completions",
            tasks=["demo_sort_choice", "demo_sort_generate"],
            model_args=f"model={MODEL_ID},base_url={url}/v1/completions,max_retries=1,timeout=600",
            batch_size=4,
            task_manager=TaskManager(include_path=str(tmp_path)),
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
            log_samples=True,
        )
    assert statuses and all(status == 200 for _, status in statuses), statuses

    def loglikelihoods(doc) -> list[float]:  # each choice's, as the encoder's log-probabilities in process make it
        context = tokenizer.encode(doc["question"], add_special_tokens=False)
        sums = []
        for answer in doc["choices"]:
            ids = context + tokenizer.encode(answer, add_special_tokens=False)
            sums.append(sum(e.logprob for e in sequence_logprobs(model, ids)[len(context) :]))
        return sums

    ours = [loglikelihoods(doc) for doc in docs]
    for sample in results["samples"]["demo_sort_choice"]:  # the same forward over the same ids: the same numbers
        assert [resp[0] for resp in sample["filtered_resps"]] == ours[sample["doc_id"]]
    accuracy = sum(max(range(3), key=sums.__getitem__) == doc["answer"] for sums, doc in zip(ours, docs)) / len(docs)
    assert results["results"]["demo_sort_choice"]["acc,none"] == pytest.approx(accuracy)

    answers = [
        generate(
            model,
            tokenizer,
            tokenizer.encode(doc["question"], add_special_tokens=False),
            max_tokens=64,
            seed=SEED,
            temperature=0,
        ).split("\n")[0]
        for doc in docs
    ]
    exact = sum(answer == doc["target"] for answer, doc in zip(answers, docs)) / len(docs)
    assert results["results"]["demo_sort_generate"]["exact_match,none"] == pytest.approx(exact)
