"""Token sampling for one step: greedy, temperature, top-k, top-p, with per-request seeded RNGs."""

from __future__ import annotations

import zlib

import torch

from app.engine.request import SamplingParams

_SEED_MASK = (1 << 63) - 1


def _mix(*parts: object) -> int:
    """A stable 63-bit seed from a few values (Python's hash() is salted per process)."""
    return zlib.crc32(repr(parts).encode()) | (zlib.adler32(repr(parts[::-1]).encode()) << 32) & _SEED_MASK


class Sampler:
    """Samples one token per row of ``logits``.

    Every request with a temperature gets its own ``torch.Generator``, kept across steps so that
    the same seed reproduces the same tokens however requests are batched. A request without a
    seed gets one derived from ``default_seed`` and its id. ``drop`` forgets finished requests.
    """

    def __init__(self, default_seed: int = 0) -> None:
        self.default_seed = default_seed
        # request_id -> (generator, number of output tokens it has sampled so far)
        self._generators: dict[str, tuple[torch.Generator, int]] = {}

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, request_id: str, params: SamplingParams, num_output_tokens: int) -> torch.Generator:
        held = self._generators.get(request_id)
        if held is not None and held[1] == num_output_tokens:
            gen = held[0]
        else:
            # NOTE: a request whose output was discarded or that we never saw restarts from a seed
            # derived from (seed, tokens so far), so where it resumes is still deterministic.
            seed = params.seed if params.seed is not None else _mix(self.default_seed, request_id)
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if num_output_tokens == 0 else _mix(seed, num_output_tokens))
        self._generators[request_id] = (gen, num_output_tokens + 1)
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        num_output_tokens: list[int],
    ) -> list[int]:
        """``logits`` is ``[rows, vocab]``; returns one token id per row."""
        tokens = logits.argmax(dim=-1)  # NOTE: one op for every greedy row (all of them, usually)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return tokens.tolist()
        idx = torch.tensor(random_rows, device=logits.device)
        # NOTE: random rows are drawn on the CPU with per-request CPU generators: the same seed
        # gives the same tokens whatever the runner's device.
        sub = logits.index_select(0, idx).float().cpu()
        temps = torch.tensor([params[i].temperature for i in random_rows], dtype=sub.dtype, device="cpu")
        sub = sub / temps[:, None]
        top_ks = [params[i].top_k for i in random_rows]
        top_ps = [params[i].top_p for i in random_rows]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            probs_sorted, order = self._filter_sorted(sub, top_ks, top_ps)
        else:
            probs_sorted, order = torch.softmax(sub, dim=-1), None
        for row, i in enumerate(random_rows):
            gen = self._generator(request_ids[i], params[i], num_output_tokens[i])
            pick = int(torch.multinomial(probs_sorted[row], 1, generator=gen))
            tokens[i] = int(order[row, pick]) if order is not None else pick
        return tokens.tolist()

    @staticmethod
    def _filter_sorted(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities sorted descending with top-k and top-p applied (one sort for all rows)."""
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        ps = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device)
        # keep a token while the mass before it is below top_p; the first always survives, even
        # for a top_p that is 0 in float32 (1e-50 passes the `> 0` check)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill((mass_before >= ps[:, None]) & (ranks > 0), 0.0)
        return probs / probs.sum(dim=-1, keepdim=True), order
