"""The client sees a failed KV checksum check by its name on every path: a
retryable 503 when a retry may succeed, else a 500 that says it is not.

test_client_error checks `_raise_if_error` itself; this drives vLLM's real
OpenAI handlers (OpenAIServingCompletion, OpenAIServingChat), streaming and
not, from `create_completion` / `create_chat_completion` through the real
result generators, with an engine whose only output for the request is
what a request failed by the checksum scheduler ends with: finish_reason
"error" and a stop_reason naming the failure. What the client receives is
read where the server produces it: the stream's error chunk, or, when not
streaming, the JSON response of vLLM's own VLLMError handler (the one the
API server registers) for the exception the handler raised.

The handlers are built with their own __init__ on a mocked AsyncLLM (as
vLLM's test_chat_error does); only prompt rendering is replaced (no
tokenizer here: the configs are config-only), returning the prompt's
token ids.
"""

from __future__ import annotations

import asyncio
import json
from unittest.mock import AsyncMock, MagicMock

import pytest
from pd_harness import make_config
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve.exception_handling.handlers.vllm_error import vllm_error_handler
from vllm.exceptions import GenerationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.v1.engine.async_llm import AsyncLLM

from vllm_kvchecksum.core.verdicts import CheckStatus, LoadVerdict, UnverifiedReason
from vllm_kvchecksum.engine.scheduler import KV_CHECKSUM_ERROR_PREFIX, client_reason

MODEL = "kvcs-test-model"
PROMPT_IDS = [11, 12, 13]
REASON = f"{KV_CHECKSUM_ERROR_PREFIX}mismatch: the KV loaded from the producer is corrupt (group 0 blocks [2])"
# A failure every retry meets again (the producer runs another model).
SETUP_REASON = client_reason(LoadVerdict("r", CheckStatus.UNVERIFIED,
                                         reason_key=UnverifiedReason.FINGERPRINT_DIFFERS))


def _engine(stop_reason) -> MagicMock:
    """An AsyncLLM whose one output for any request is an error finish with `stop_reason`."""
    config = make_config("kv_consumer", 1, 1, 16)
    engine = MagicMock(spec=AsyncLLM)
    engine.errored = False
    engine.model_config, engine.vllm_config = config.model_config, config
    engine.input_processor = MagicMock()
    engine.renderer = MagicMock()  # its tokenizer is never asked for text here

    async def generate(*args, **kwargs):
        yield RequestOutput(
            request_id=args[2], prompt=None, prompt_token_ids=PROMPT_IDS, prompt_logprobs=None,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                      finish_reason="error", stop_reason=stop_reason)],
            finished=True)

    engine.generate = MagicMock(side_effect=generate)
    return engine


def _renderer(engine) -> OnlineRenderer:
    return OnlineRenderer(model_config=engine.model_config, renderer=engine.renderer, request_logger=None,
                          chat_template=None, chat_template_content_format="auto")


def completion_handler(stop_reason) -> OpenAIServingCompletion:
    engine = _engine(stop_reason)
    models = OpenAIServingModels(engine_client=engine, base_model_paths=[BaseModelPath(name=MODEL, model_path=MODEL)])
    handler = OpenAIServingCompletion(engine, models, online_renderer=_renderer(engine), request_logger=None)
    handler.online_renderer.render_completion = AsyncMock(
        return_value=[{"type": "token", "prompt_token_ids": PROMPT_IDS, "prompt": "abc"}])
    return handler


def chat_handler(stop_reason) -> OpenAIServingChat:
    engine = _engine(stop_reason)
    models = OpenAIServingModels(engine_client=engine, base_model_paths=[BaseModelPath(name=MODEL, model_path=MODEL)])
    handler = OpenAIServingChat(engine, models, "assistant", online_renderer=_renderer(engine), request_logger=None,
                                chat_template=None, chat_template_content_format="auto")
    handler.online_renderer.render_chat = AsyncMock(
        return_value=([{"role": "user", "content": "abc"}], [{"type": "token", "prompt_token_ids": PROMPT_IDS}]))
    return handler


async def _respond(api: str, stream: bool, stop_reason) -> tuple[int | None, dict]:
    """(HTTP status, error object) the client gets; for a stream, the status
    inside its error chunk (the stream itself started with 200)."""
    if api == "completion":
        request = CompletionRequest(model=MODEL, prompt="abc", max_tokens=4, stream=stream)
        call = completion_handler(stop_reason).create_completion(request)
    else:
        request = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=4,
                                        stream=stream)
        call = chat_handler(stop_reason).create_chat_completion(request)
    if not stream:
        with pytest.raises(GenerationError) as info:
            await call
        response = await vllm_error_handler(None, info.value)
        body = json.loads(response.body)
        return response.status_code, body["error"]
    chunks = [chunk async for chunk in await call]
    assert chunks[-1] == "data: [DONE]\n\n"
    errors = [json.loads(c[len("data: "):]) for c in chunks[:-1] if '"error"' in c]
    assert len(errors) == 1, chunks
    # No completion text or finish reason reached the client before the error.
    assert not any('"finish_reason":"error"' in c or '"finish_reason": "error"' in c for c in chunks), chunks
    return errors[0]["error"]["code"], errors[0]["error"]


APIS = [("completion", False), ("completion", True), ("chat", False), ("chat", True)]
IDS = ["completion-full", "completion-stream", "chat-full", "chat-stream"]


@pytest.mark.parametrize("api,stream", APIS, ids=IDS)
def test_checksum_failure_reaches_the_client_named_and_retryable(api, stream):
    status, error = asyncio.run(_respond(api, stream, REASON))
    assert status == 503, error
    assert error["code"] == 503
    assert error["message"] == REASON
    if not stream:
        assert error["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize("api,stream", APIS, ids=IDS)
def test_a_failure_a_retry_cannot_fix_reaches_the_client_named_not_retryable(api, stream):
    assert SETUP_REASON.startswith(f"{KV_CHECKSUM_ERROR_PREFIX}unverified: ") and "not retryable" in SETUP_REASON
    status, error = asyncio.run(_respond(api, stream, SETUP_REASON))
    assert status == 500 and error["code"] == 500, error
    assert error["message"] == SETUP_REASON
    assert error["type"] == "InternalServerError"


@pytest.mark.parametrize("api,stream", APIS, ids=IDS)
def test_an_error_without_a_checksum_reason_stays_internal(api, stream):
    status, error = asyncio.run(_respond(api, stream, None))
    assert status == 500 and error["code"] == 500, error
    assert error["message"] == "Internal server error"
    assert error["type"] == "InternalServerError"
