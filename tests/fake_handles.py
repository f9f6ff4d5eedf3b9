"""Stand-ins for Serve deployment handles in tests that judge what a deployment answers: each method
is a ``remote()`` whose awaitable returns the canned answer, or raises it when it is an exception."""

from __future__ import annotations


class Call:
    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self):
        async def answer():
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

        return answer()


class Handle:
    """``Handle(stats={...}, info=RuntimeError("gone"))``: ``await handle.stats.remote()`` gives the dict."""

    def __init__(self, **methods) -> None:
        for name, answer in methods.items():
            setattr(self, name, Call(answer))
