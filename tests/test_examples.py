"""Every example runs to completion on the bundled demo model and prints what it promises."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_chat_carries_the_conversation():
    out = run("chat.py")
    assert out.count("you> ") == 3 and out.count("model> ") == 3
    assert "17 23 42 61 85" in out.split("\n")[1]  # the first turn's answer


def test_background_generation_streams_cancels_and_reports_errors():
    out = run("background.py")
    assert "done: stop" in out and "done: cancelled" in out
    assert "error: the prompt is empty" in out
    cancelled = out.split("cancelled after its first canvas:")[1]
    assert cancelled.count("canvas committed") == 1


def test_json_schema_output_parses():
    lines = [line for line in run("json_schema.py").split("\n") if ":" in line]
    assert len(lines) == 2 and all("'name'" in line and "'age'" in line for line in lines)


def test_infill_fills_between_prefix_and_suffix():
    out = run("infill.py").strip()
    assert out.startswith("17 [") and out.endswith("] 85")


def test_batch_answers_every_prompt():
    lines = run("batch.py").strip().split("\n")
    assert len(lines) == 4 and all(" -> " in line for line in lines)


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_covered(name):
    assert f"test_{name.removesuffix('.py')}" in Path(__file__).read_text() or name in Path(__file__).read_text()


def test_openai_client_talks_to_a_server_it_starts():
    lines = run("openai_client.py").strip().split("\n")
    assert lines[0].startswith("chat: ") and lines[1].startswith("streamed: ")
    assert lines[2].startswith("json_schema: {") and "'name'" in lines[2] and "'age'" in lines[2]


@pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch is needed")
def test_two_machines_on_loopback_write_the_single_process_text():
    out = run("two_machines.py")
    assert out.strip().split("\n")[-1] == "the same text"
