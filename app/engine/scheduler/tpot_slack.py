"""How much longer than a step within the TPOT cap the next step may take while every answer decoding
in it still ends within the TPOT objective.

The objective that clients and benchmarks measure (vLLM's ``bench serve``, guidellm, foreserve's
load test) is an answer's mean time per output token, (last token - first token) / (tokens - 1),
not each step's. An answer that has decoded faster than the objective so far, or has many tokens
to go, can absorb one long step. The online scheduler spends that slack on prompts: a waiting
prompt goes through in one step instead of in chunks of the TPOT cap. Where a prompt token costs
about as much as a decode row (a CPU), chunks of a few dozen tokens cost the next answer seconds
before its first token.
"""

from __future__ import annotations

# The share of the least slack one step may spend: the rest covers answers that end sooner than
# predicted (less future slack than counted).
SLACK_SHARE = 0.5


def answer_slack_s(slo_s: float, tokens_out: int, decoding_s: float, remaining: int, step_s: float) -> float:
    """Seconds beyond ``step_s`` that the next step may take, with the answer still ending at a mean of
    ``slo_s`` per token. The answer has ``tokens_out`` tokens, the first ``decoding_s`` ago, and
    ``remaining`` to go; each step after the next is counted at ``step_s``, the longest a step within
    the TPOT cap takes (at most ``slo_s``).

    The mean stays within ``slo_s`` while ``decoding_s + next + (remaining - 1) * step_s`` is at most
    ``slo_s * (tokens_out - 1 + remaining)``: the time banked by tokens faster than the objective so
    far, and by the steps to come that the cap keeps below it. Negative: the answer is behind. A step
    of ``t`` changes it by ``step_s - t``."""
    return slo_s * (tokens_out - 1 + remaining) - decoding_s - remaining * step_s
