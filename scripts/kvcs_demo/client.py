"""The demo's client of a vLLM OpenAI server: one completion, and what its answer says.

Its own module, below the demo and the store drill, which both send
completions (the store drill is run by the demo, so it cannot import it).
"""

from __future__ import annotations

import httpx

OUTPUT_TOKENS = 8
REQUEST_TIMEOUT_S = 180.0


def completion(client: httpx.Client, url: str, prompt: str | list[int], *, max_tokens: int = OUTPUT_TOKENS,
               request_id: str | None = None, kv_transfer_params: dict | None = None,
               logprobs: int | None = None) -> tuple[int, dict]:
    body: dict = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if logprobs is not None:
        body["logprobs"] = logprobs
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = client.post(f"{url}/v1/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": {"message": r.text[:500]}}


def text_of(body: dict) -> str | None:
    try:
        return body["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return None


def error_of(body: dict) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", ""))
    return str(err or "")
