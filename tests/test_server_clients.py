"""The server as the clients people use read it: llm with llm-ollama, langchain-ollama, the OpenAI
Agents SDK, instructor, pydantic-ai and smolagents against a real uvicorn server serving the bundled demo, each
in its plain, streamed, structured and tool cases (the official openai, ollama and anthropic clients
are driven in test_server.py and test_server_apis.py). Judged on protocol: a plain answer is the demo's
(``generate``'s) at the same seed, a structured one an instance of the client's own model, a tool call
one the client ran with arguments of the tool's types.

A structured case is one row of ``STRUCTURED``: a pydantic model, a prompt, and the instance the demo
answers it with through a JSON schema (None where only its type is known)."""

import asyncio
import json
import logging

import instructor
import openai
import pytest
from agents import (
    Agent,
    AgentOutputSchema,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_ollama import ChatOllama
from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.output import NativeOutput
from pydantic_ai.providers.ollama import OllamaProvider
from pydantic_ai.providers.openai import OpenAIProvider
from smolagents import ActionStep, OpenAIServerModel, ToolCallingAgent, tool

from mlx_dgemma import generate
from mlx_dgemma.server.ollama import digest

from .test_schema_grammar import Everyday, Tree
from .test_server import MODEL_ID, SORT, serving
from .test_server_apis import CALL

ANSWER = "17 23 42 61 85"  # the demo's answer to SORT at seed 3 (and generate's)
PLAIN = {"seed": 3, "max_tokens": 64}


class Person(BaseModel):
    name: str
    age: int


class Reading(BaseModel):
    city: str
    celsius: float
    sunny: bool


# (model, prompt, the demo's answer through the model's JSON schema at seed 2, or None: any instance)
STRUCTURED = [
    (Person, "json: name=ada age=36", Person(name="ada", age=36)),
    (Reading, "json: city=oslo celsius=4.5 sunny=true", None),
]
# The everyday models (lists, Optional, a nested model, an Enum, a dict, dates, a UUID, a Union, a
# recursive tree): their schemas go by the grammar, any valid instance.
EVERYDAY = [(Everyday, "json: name=ada age=36", None), (Tree, "json: name=ada age=36", None)]


def weather(calls: list):
    """A get_weather tool that records the arguments it was called with."""

    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        calls.append((city, days))
        return "sunny"

    return get_weather


def check_calls(calls: list) -> None:
    (call,) = calls
    assert isinstance(call[0], str) and isinstance(call[1], int), call


def check_structured(result, model, expected) -> None:
    assert isinstance(result, model)
    if expected is not None:
        assert result.model_dump() == expected.model_dump()


@pytest.fixture(scope="module")
def server(demo):
    with serving(*demo) as url:
        yield url


def test_the_demos_answer_is_generates(demo):
    assert generate(*demo, SORT, max_tokens=64, seed=3) == ANSWER


# -- llm with llm-ollama (its command line, in process) ---------------------------------------------------


@pytest.fixture(scope="module")
def llm(server, tmp_path_factory):
    """``llm ARGS`` with OLLAMA_HOST pointing here and a fresh llm home: its output."""
    from click.testing import CliRunner

    with pytest.MonkeyPatch.context() as env:
        # (set before llm loads its plugins: llm-ollama keeps its cache of capabilities there)
        env.setenv("LLM_USER_PATH", str(tmp_path_factory.mktemp("llm")))
        env.setenv("OLLAMA_HOST", server)
        from llm.cli import cli

        def run(*args: str) -> str:
            result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
            assert result.exit_code == 0, result.output
            return result.output

        yield run


def test_llm_lists_the_model(llm, demo):
    # llm-ollama registers a model by its name and digest, with the name without ":latest" as an alias.
    assert f"Ollama: ollama/{MODEL_ID}:latest (aliases: ollama/{MODEL_ID})" in llm("models").split("\n")
    table = llm("ollama", "models").split("\n")
    assert table[1].split() == [f"{MODEL_ID}:latest", digest(demo[0])[:12], "completion,", "insert,", "thinking"]


def test_llm_plain_and_streamed(llm):
    options = ["-o", "seed", "3", "-o", "num_predict", "64"]
    assert llm("-m", f"ollama/{MODEL_ID}", *options, "--no-stream", SORT) == ANSWER + "\n"
    assert llm("-m", f"ollama/{MODEL_ID}:latest", *options, SORT) == ANSWER + "\n"
    (logged,) = json.loads(llm("logs", "-n", "1", "--json"))
    assert logged["response"] == ANSWER and logged["output_tokens"] > 0


@pytest.mark.parametrize("model, prompt, expected", STRUCTURED)
def test_llm_structured(llm, model, prompt, expected):
    # llm's schema: the JSON schema of the fields, sent as Ollama's format.
    fields = ", ".join(f"{name} {info.annotation.__name__}" for name, info in model.model_fields.items())
    text = llm("-m", f"ollama/{MODEL_ID}", "-o", "seed", "2", "--schema", fields, prompt)
    check_structured(model.model_validate_json(text), model, expected)


# -- langchain-ollama -----------------------------------------------------------------------------------


def test_langchain_ollama_plain_and_streamed(server):
    chat = ChatOllama(model=MODEL_ID, base_url=server, seed=3, num_predict=64)
    reply = chat.invoke(SORT)
    assert reply.content == ANSWER and reply.response_metadata["done_reason"] == "stop"
    assert reply.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.content for chunk in chat.stream(SORT)) == ANSWER


@pytest.mark.parametrize("model, prompt, expected", STRUCTURED + EVERYDAY)
def test_langchain_ollama_structured(server, model, prompt, expected):
    chat = ChatOllama(model=MODEL_ID, base_url=server, seed=2)
    check_structured(chat.with_structured_output(model, method="json_schema").invoke(prompt), model, expected)


def test_langchain_ollama_tool_call_and_its_result(server):
    tool = weather([])
    # The demo calls a tool only where told to: Ollama has no tool_choice, so the server's own
    # template option writes Gemma 4's call syntax into the answer, as a tool-trained checkpoint does.
    chat = ChatOllama(model=MODEL_ID, base_url=server).bind_tools([tool])
    options = {"seed": 0, "template": CALL}
    call = chat.invoke("weather in oslo", options=options)
    (parsed,) = call.tool_calls
    assert call.content == "Sure. " and parsed["name"] == "get_weather" and parsed["args"]["days"] == 3
    streamed = [c for chunk in chat.stream("weather in oslo", options=options) for c in chunk.tool_calls]
    assert [(c["name"], c["args"]) for c in streamed] == [(parsed["name"], parsed["args"])]
    # The call and its result go back (the arguments as an object, Ollama's way) and the model answers.
    result = {"role": "tool", "content": tool(**parsed["args"]), "tool_call_id": parsed["id"]}
    answer = (
        ChatOllama(model=MODEL_ID, base_url=server, seed=0, num_predict=16)
        .bind_tools([tool])
        .invoke([("user", "weather in oslo"), call, result])
    )
    assert answer.response_metadata["done_reason"] in ("stop", "length") and not answer.tool_calls


# -- the OpenAI Agents SDK, on chat completions and on the Responses API ------------------------------------

set_tracing_disabled(True)  # (traces would go to OpenAI)
AGENT_MODELS = [OpenAIChatCompletionsModel, OpenAIResponsesModel]


def agent(server, kind, **kwargs) -> Agent:
    # A client per run: the SDK's runs each have an event loop of their own.
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)
    return Agent(name="demo", model=kind(model=MODEL_ID, openai_client=client), **kwargs)


def run_streamed(agent: Agent, prompt: str) -> tuple[str, object]:
    async def run():
        result = Runner.run_streamed(agent, prompt)
        deltas = [
            event.data.delta
            async for event in result.stream_events()
            if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
        ]
        return "".join(deltas), result

    return asyncio.run(run())


@pytest.mark.parametrize("kind", AGENT_MODELS)
def test_agents_plain_and_streamed(server, kind):
    settings = ModelSettings(max_tokens=64, extra_body={"seed": 3})
    assert Runner.run_sync(agent(server, kind, model_settings=settings), SORT).final_output == ANSWER
    text, result = run_streamed(agent(server, kind, model_settings=settings), SORT)
    assert text == result.final_output == ANSWER


@pytest.mark.parametrize("kind", AGENT_MODELS)
@pytest.mark.parametrize("model, prompt, expected", STRUCTURED + EVERYDAY)
def test_agents_structured(server, kind, model, prompt, expected):
    settings = ModelSettings(extra_body={"seed": 2})
    # The SDK's strict schemas take no dict fields (its own rule): for those a user turns strictness off.
    output = AgentOutputSchema(model, strict_json_schema=False) if model is Everyday else model
    result = Runner.run_sync(agent(server, kind, model_settings=settings, output_type=output), prompt)
    check_structured(result.final_output, model, expected)


@pytest.mark.parametrize("kind", AGENT_MODELS)
def test_agents_tool_call(server, kind):
    # tool_choice names the tool for the first turn; the SDK then resets it, and the model answers.
    for streamed in (False, True):
        calls = []
        settings = ModelSettings(max_tokens=32, tool_choice="get_weather", extra_body={"seed": 0})
        tooled = agent(server, kind, tools=[function_tool(weather(calls))], model_settings=settings)
        result = run_streamed(tooled, "weather in oslo")[1] if streamed else Runner.run_sync(tooled, "weather in oslo")
        check_calls(calls)
        assert [item.type for item in result.new_items] == [
            "tool_call_item",
            "tool_call_output_item",
            "message_output_item",
        ]
        assert isinstance(result.final_output, str)


def test_agents_take_an_answer_padded_to_the_limit(server):
    # The demo under greedy AR ends this answer and pads up to max_tokens: a whole answer, not a cut one
    # (an incomplete response would end the run with ModelBehaviorError).
    settings = ModelSettings(max_tokens=32, extra_body={"seed": 0, "policy": "ar"})
    result = Runner.run_sync(
        agent(server, OpenAIResponsesModel, model_settings=settings), "What is the capital of France?"
    )
    assert result.final_output and result.context_wrapper.usage.output_tokens < 32


# -- instructor -----------------------------------------------------------------------------------------


def patched(server, mode=instructor.Mode.TOOLS):
    return instructor.from_openai(
        openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60), mode=mode
    )


@pytest.mark.parametrize("model, prompt, expected", STRUCTURED + EVERYDAY)
def test_instructor_structured(server, model, prompt, expected):
    # JSON_SCHEMA: the model's schema as response_format; TOOLS (instructor's default): a forced call to a
    # tool whose parameters are the schema (the demo was taught JSON answers, not calls: any instance).
    # (strict=False: instructor's strict validation takes no JSON string for an Enum or a date)
    ask = dict(
        model=MODEL_ID,
        response_model=model,
        messages=[{"role": "user", "content": prompt}],
        seed=2,
        max_retries=1,
        strict=model is not Everyday,
    )
    check_structured(patched(server, instructor.Mode.JSON_SCHEMA).chat.completions.create(**ask), model, expected)
    called = patched(server).chat.completions.create(**ask)
    check_structured(called, model, None)
    # Streamed: instructor's partial objects (a schema whose fields may be missing), the last one whole.
    partials = list(patched(server).chat.completions.create_partial(**ask))
    check_structured(model.model_validate(partials[-1].model_dump()), model, None)


# -- pydantic-ai, through the OpenAI and the Ollama providers ------------------------------------------------


def pydantic_model(server, provider=OpenAIProvider):
    keys = {"api_key": "none"} if provider is OpenAIProvider else {}
    return OpenAIChatModel(MODEL_ID, provider=provider(base_url=server + "/v1", **keys))


@pytest.mark.parametrize("provider", [OpenAIProvider, OllamaProvider])
def test_pydantic_ai_plain_and_streamed(server, provider):
    assistant = PydanticAgent(pydantic_model(server, provider), model_settings=PLAIN)
    result = assistant.run_sync(SORT)
    assert result.output == ANSWER and result.usage.output_tokens > 0

    async def streamed():
        async with assistant.run_stream(SORT) as run:
            return [text async for text in run.stream_text(delta=True)]

    assert "".join(asyncio.run(streamed())) == ANSWER


@pytest.mark.parametrize("model, prompt, expected", STRUCTURED + EVERYDAY)
def test_pydantic_ai_structured(server, model, prompt, expected):
    # NativeOutput: the schema as response_format; the default: a forced call to a final_result tool.
    native = PydanticAgent(pydantic_model(server), output_type=NativeOutput(model), model_settings={"seed": 2})
    check_structured(native.run_sync(prompt).output, model, expected)
    called = PydanticAgent(pydantic_model(server), output_type=model, model_settings={"seed": 2})
    check_structured(called.run_sync(prompt).output, model, None)


@pytest.mark.parametrize("streamed", [False, True])
def test_pydantic_ai_tool_call(server, streamed):
    calls = []
    # A tool forced on the first step only (per-step settings), then the model answers.
    assistant = PydanticAgent(
        pydantic_model(server),
        tools=[weather(calls)],
        model_settings=lambda ctx: {
            "seed": 0,
            "max_tokens": 32,
            "tool_choice": ["get_weather"] if ctx.run_step == 1 else "auto",
        },
    )

    async def run_streamed():
        async with assistant.run_stream("weather in oslo") as run:
            text = "".join([piece async for piece in run.stream_text(delta=True)])
            return text, run.all_messages()

    if streamed:
        output, messages = asyncio.run(run_streamed())
    else:
        result = assistant.run_sync("weather in oslo")
        output, messages = result.output, result.all_messages()
    check_calls(calls)
    assert isinstance(output, str)
    kinds = [part.part_kind for message in messages for part in message.parts]
    assert kinds == ["user-prompt", "tool-call", "tool-return", "text"]


# -- smolagents ---------------------------------------------------------------------------------------


def test_smolagents_tool_calling_agent_takes_a_step(server, caplog):
    """ToolCallingAgent sends its tools and final_answer with tool_choice "required" on every step: the
    step's call is one of them, with arguments of the tool's types, and nothing is refused."""
    calls = []

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days.

        Args:
            city: The city.
            days: How many days ahead.
        """
        calls.append((city, days))
        return "sunny"

    caplog.set_level(logging.INFO, logger="mlx_dgemma.server")
    model = OpenAIServerModel(MODEL_ID, api_base=server + "/v1", api_key="none", max_tokens=64, seed=0)
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=1, verbosity_level=0)
    agent.run("weather in oslo for 3 days", max_steps=1)
    step = next(s for s in agent.memory.steps if isinstance(s, ActionStep))
    assert step.error is None and len(step.tool_calls) == 1
    (call,) = step.tool_calls
    assert call.name in ("get_weather", "final_answer")
    if call.name == "get_weather":
        check_calls(calls)
    else:
        assert isinstance(call.arguments["answer"], str) and not calls
    assert not [r.getMessage() for r in caplog.records if r.name == "mlx_dgemma.server" and "refused" in r.getMessage()]
