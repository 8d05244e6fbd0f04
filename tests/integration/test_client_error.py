"""A request failed by its KV checksum check tells the client why.

vLLM's OpenAI server turns finish_reason "error" into an HTTP error; with
the series, a stop_reason from the checksum scheduler (kv_checksum_...)
becomes the message of a retryable error (503) instead of "Internal server
error", so a client or a P/D proxy can tell corrupt KV from a server fault
and retry. The real-server check is the demo's e2e test.
"""

from __future__ import annotations

import pytest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.exceptions import GenerationError, RetryableRequestError

from vllm_kvchecksum.scheduler import KV_CHECKSUM_ERROR_PREFIX

REASON = f"{KV_CHECKSUM_ERROR_PREFIX}mismatch: the KV loaded from the producer is corrupt (group 0 blocks [1])"


@pytest.mark.parametrize("serving", [OpenAIServingCompletion, OpenAIServingChat])
def test_checksum_failure_is_named_and_retryable(serving):
    with pytest.raises(RetryableRequestError, match=r"kv_checksum_mismatch: .*group 0 blocks \[1\]") as info:
        serving._raise_if_error(None, "error", "cmpl-1", REASON)
    assert info.value.status_code == 503


def test_other_errors_stay_internal():
    for stop_reason in (None, 7, "some other stop string", "KV_CHECKSUM_MISMATCH"):
        with pytest.raises(GenerationError, match="Internal server error") as info:
            OpenAIServingCompletion._raise_if_error(None, "error", "cmpl-1", stop_reason)
        assert not isinstance(info.value, RetryableRequestError)


def test_no_error_no_raise():
    OpenAIServingCompletion._raise_if_error(None, "stop", "cmpl-1", REASON)
    OpenAIServingCompletion._raise_if_error(None, "length", "cmpl-1", None)


def test_the_reason_names_at_most_32_positions_per_group():
    from vllm_kvchecksum.compare import CheckStatus, GroupVerdict, LoadVerdict
    from vllm_kvchecksum.scheduler import client_reason

    verdict = LoadVerdict("r", CheckStatus.MISMATCH, groups={
        0: GroupVerdict(0, CheckStatus.MISMATCH, tuple(range(5000)), 5000),
        1: GroupVerdict(1, CheckStatus.MISMATCH, (3, 7), 10)})
    reason = client_reason(verdict)
    assert reason.startswith("kv_checksum_mismatch: ")
    assert f"group 0 blocks {list(range(32))} and 4968 more" in reason
    assert "group 1 blocks [3, 7])" in reason and len(reason) < 400
