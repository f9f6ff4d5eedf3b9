"""A stand-in for the chat endpoint that costs nothing: it streams ``max_tokens`` chunks in OpenAI's
SSE shape, ``ttft_ms`` before the first and ``itl_ms`` between the next. Used to show the load
generator is never the bottleneck (``foreserve loadtest stub-check``) and by the locustfile's tests.

    python -m loadtests.stub_server --port 8001 --ttft-ms 50 --itl-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def _chunk(i: int, delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": f"stub-{i}", "object": "chat.completion.chunk", "created": int(time.time()), "model": "stub",
            "choices": choices}
    if usage:
        body["usage"] = usage
    return "data: " + json.dumps(body) + "\n\n"


def build_app(ttft_ms: float, itl_ms: float, fail_every: int = 0) -> Starlette:
    count = {"n": 0}

    async def chat(request: Request):
        body = await request.json()
        count["n"] += 1
        if fail_every and count["n"] % fail_every == 0:
            return JSONResponse({"error": {"message": "stub failure", "type": "server_error", "param": None,
                                           "code": None}}, status_code=503)
        n = max(1, int(body.get("max_tokens") or 16))

        async def events():
            await asyncio.sleep(ttft_ms / 1000)
            yield _chunk(count["n"], {"role": "assistant", "content": ""})
            for i in range(n):
                if i:
                    await asyncio.sleep(itl_ms / 1000)
                yield _chunk(count["n"], {"content": " tok"})
            yield _chunk(count["n"], {}, finish="length")
            yield _chunk(count["n"], {}, usage={"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request):
        return JSONResponse({"status": "ok", "model": "stub", "pools": {}})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--ttft-ms", type=float, default=50)
    p.add_argument("--itl-ms", type=float, default=20)
    p.add_argument("--fail-every", type=int, default=0, help="answer every Nth request with a 503 (tests)")
    args = p.parse_args(argv)
    uvicorn.run(build_app(args.ttft_ms, args.itl_ms, args.fail_every), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
