"""The ``fuzz`` scenario: schemathesis generates requests from the service's own OpenAPI schema
(every route; bodies valid and not) and sends them with the key; each answer must be below 500,
and each 4xx in OpenAI's error shape with no traceback, path or internals (``probes._clean``).
Generated chats are cut to a few tokens (``max_tokens`` 4) so that a valid one costs little."""

from __future__ import annotations

from collections import Counter

import httpx

from loadtests.chaos.probes import _clean

MAX_TOKENS = 4


def _short(body):
    if isinstance(body, dict) and "messages" in body:
        return {**body, "max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS}
    return body


def fuzz(url: str, key: str, examples: int = 20) -> dict:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    statuses: Counter = Counter()
    bad: list[str] = []
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy())
            def send(case) -> None:
                kwargs = case.as_transport_kwargs(base_url=url)
                body = _short(kwargs.pop("json", None))
                try:
                    response = client.request(kwargs["method"], kwargs["url"], params=kwargs.get("params"),
                                              headers={k: str(v) for k, v in (kwargs.get("headers") or {}).items()
                                                       if k.lower() not in ("authorization", "content-length")},
                                              json=body if body is not None else None,
                                              content=kwargs.get("data") if body is None else None)
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
                    bad.append(f"{case.method} {case.path}: {type(exc).__name__}")
                    return
                statuses[response.status_code] += 1
                if response.status_code >= 500 or (response.status_code >= 400 and not _clean(response)):
                    bad.append(f"{case.method} {case.path} -> {response.status_code}: {response.text[:160]}")

            send()
    sent = sum(statuses.values())
    errors_4xx = sum(n for s, n in statuses.items() if isinstance(s, int) and 400 <= s < 500)
    return {"sent": sent, "answered": sum(n for s, n in statuses.items() if isinstance(s, int) and s < 400),
            "clean_error": errors_4xx - sum(1 for b in bad if " -> 4" in b), "hung": 0, "broken": len(bad),
            "server_errors": sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500),
            "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)}, "broken_examples": bad[:5]}
