"""vLLM's tokenizer endpoints, so that a client tokenizes as the server does (lm-evaluation-harness's
``local-completions`` finds them by itself and counts a loglikelihood request's context with them):
``GET /tokenizer_info``, ``POST /tokenize`` (``{"prompt": text, "add_special_tokens": true}`` ->
``{"count", "max_model_len", "tokens"}``) and ``POST /detokenize`` (``{"tokens": [ids]}`` -> ``{"prompt": text}``).
Errors are OpenAI's shape."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.routing import Route

from .api import Api, BadRequest
from .app import Server
from .body import typed


def routes(server: Server) -> list[Route]:
    tokenizer, config = server.tokenizer, server.model.config

    def check_model(body: dict) -> None:
        server.reader.check_model(body.get("model"))

    def tokenize(body: dict) -> dict:
        check_model(body)
        prompt = typed(body, "prompt", str, None)
        if prompt is None:
            raise BadRequest("prompt must be the text to tokenize", param="prompt")
        if not tokenizer.has_vocabulary:
            raise BadRequest("this checkpoint has no tokenizer files: send prompts as token ids", param="prompt")
        server.reader.check_length(len(prompt), "the prompt", "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=typed(body, "add_special_tokens", bool, True))
        return {"count": len(ids), "max_model_len": config.max_position_embeddings, "tokens": ids}

    def detokenize(body: dict) -> dict:
        check_model(body)
        ids = typed(body, "tokens", list, None)
        if ids is None or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size for i in ids
        ):
            raise BadRequest(f"tokens must be a list of token ids from 0 to {config.vocab_size - 1}", param="tokens")
        return {"prompt": tokenizer.decode(ids)}

    async def tokenizer_info(request):
        piece = tokenizer.piece
        return JSONResponse(
            {
                "tokenizer_class": type(tokenizer).__name__,
                "bos_token": piece(tokenizer.bos_token_id),
                "eos_token": piece(tokenizer.stop_ids[0]),
                "pad_token": piece(tokenizer.pad_token_id),
                "chat_template": tokenizer.chat_template,
                "model_max_length": config.max_position_embeddings,
            }
        )

    async def tokenize_route(request):
        return await server.worked(request, Api(server), tokenize)

    async def detokenize_route(request):
        return await server.worked(request, Api(server), detokenize)

    return [
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
    ]
