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

from vllm_kvchecksum.engine.scheduler import KV_CHECKSUM_ERROR_PREFIX

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
    from vllm_kvchecksum.core.verdicts import CheckStatus, GroupVerdict, LoadVerdict
    from vllm_kvchecksum.engine.scheduler import client_reason

    verdict = LoadVerdict("r", CheckStatus.MISMATCH, groups={
        0: GroupVerdict(0, CheckStatus.MISMATCH, tuple(range(5000)), 5000),
        1: GroupVerdict(1, CheckStatus.MISMATCH, (3, 7), 10)})
    reason = client_reason(verdict)
    assert reason.startswith("kv_checksum_mismatch: ")
    assert f"group 0 blocks {list(range(32))} and 4968 more" in reason
    assert "group 1 blocks [3, 7])" in reason and len(reason) < 400


def _unverified(*keys, source="producer"):
    """An unverified verdict: one key is the load's own reason, more are its groups' reasons."""
    from vllm_kvchecksum.core.verdicts import CheckStatus, GroupVerdict, LoadVerdict, UnverifiedReason

    if len(keys) == 1:
        return LoadVerdict("r", CheckStatus.UNVERIFIED, reason_key=UnverifiedReason(keys[0]), source=source)
    return LoadVerdict("r", CheckStatus.UNVERIFIED, source=source, groups={
        g: GroupVerdict(g, CheckStatus.UNVERIFIED, reason_key=UnverifiedReason(k)) for g, k in enumerate(keys)})


@pytest.mark.parametrize("keys, retryable", [
    (("missing_workers",), True),  # a worker's report lost: may work next time
    (("missing_workers", "fingerprint_differs"), False),  # one reason a retry meets again is enough
    (("no_producer_checksums",), False),  # checksums off on the producer, or lost by the proxy
    (("fingerprint_differs",), False),
    (("block_sizes_not_multiples", "fingerprint_differs"), False),
    (("tp_sizes_differ",), False),
    (("not_checksummed_by_producer",), False),
    (("producer_tp_size_differs",), False),
])
@pytest.mark.parametrize("serving", [OpenAIServingCompletion, OpenAIServingChat])
def test_only_failures_a_retry_may_fix_are_retryable(serving, keys, retryable):
    """A proxy that retries 503s must not loop on a failure every retry meets
    again (another model, block sizes, checksums off): those are a 500
    naming the reason and saying a retry will not fix it."""
    from vllm_kvchecksum.engine.scheduler import client_reason

    reason = client_reason(_unverified(*keys))
    with pytest.raises(GenerationError) as info:
        serving._raise_if_error(None, "error", "cmpl-1", reason)
    assert str(info.value) == reason and reason.startswith("kv_checksum_unverified: ")
    assert all(k in reason for k in keys)
    if retryable:
        assert isinstance(info.value, RetryableRequestError) and info.value.status_code == 503
    else:
        assert not isinstance(info.value, RetryableRequestError) and info.value.status_code == 500
        assert "not retryable" in reason


def test_failed_offloaded_loads_are_retryable():
    """What failed was dropped from the store: the retry recomputes it."""
    from vllm_kvchecksum.engine.scheduler import client_error_is_retryable, client_reason

    assert client_error_is_retryable(client_reason(_unverified("not_stored", source="offloaded")))
    assert not client_error_is_retryable(client_reason(_unverified("not_stored")))
