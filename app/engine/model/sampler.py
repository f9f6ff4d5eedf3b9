"""Token sampling for one step: greedy, temperature, top-k, top-p, with per-request seeded RNGs."""

from __future__ import annotations

import zlib

import torch

from app.engine.request import SamplingParams

_SEED_MASK = (1 << 63) - 1
# top-k / top-p rows are filtered among this many largest logits (see Sampler._sample_filtered)
CANDIDATES = 256


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
    ) -> list[int | None]:
        """``logits`` is ``[rows, vocab]``; returns one token id per row, or None for a row that
        cannot be sampled (NaN or +inf logits, or only -inf): that row's request fails, the rows
        beside it get the tokens they would get alone."""
        tokens = logits.argmax(dim=-1)  # NOTE: one op for every greedy row (all of them, usually)
        ok = torch.isfinite(logits.amax(dim=-1))  # NOTE: a row's max is NaN if any logit is, inf if any is
        bad = set() if bool(ok.all()) else set((~ok).nonzero().flatten().tolist())
        random_rows = [i for i, p in enumerate(params) if not p.greedy and i not in bad]
        if not random_rows:
            return _without(tokens.tolist(), bad)
        idx = torch.tensor(random_rows, device=logits.device)
        # NOTE: random rows are drawn on the CPU with per-request CPU generators: the same seed
        # gives the same tokens whatever the runner's device and whatever rows share the step.
        sub = logits.index_select(0, idx).float().cpu()
        temps = torch.tensor([params[i].temperature for i in random_rows], dtype=sub.dtype, device="cpu")
        sub = sub / temps[:, None]
        scaled_ok = torch.isfinite(sub.amax(dim=-1))
        if not bool(scaled_ok.all()):  # a temperature small enough to overflow the row
            bad |= {random_rows[r] for r in (~scaled_ok).nonzero().flatten().tolist()}
            keep = scaled_ok.nonzero().flatten()
            sub, random_rows = sub[keep], [random_rows[r] for r in keep.tolist()]
            if not random_rows:
                return _without(tokens.tolist(), bad)
        uniform = torch.cat([
            torch.rand(1, generator=self._generator(request_ids[i], params[i], num_output_tokens[i]))
            for i in random_rows
        ])
        filtered = torch.tensor([params[i].top_k > 0 or params[i].top_p < 1.0 for i in random_rows])
        picks = torch.empty(len(random_rows), dtype=torch.long)
        # NOTE: an unfiltered row is drawn in vocabulary order, a filtered one in sorted order: each
        # row always the same way, so a seed's tokens do not depend on the rows beside it.
        if (~filtered).any():
            plain = (~filtered).nonzero().flatten()
            picks[plain] = _inverse_cdf(torch.softmax(sub[plain], dim=-1), uniform[plain])
        if filtered.any():
            rows = filtered.nonzero().flatten()
            chosen = [random_rows[r] for r in rows.tolist()]
            picks[rows] = self._sample_filtered(sub[rows], [params[i].top_k for i in chosen],
                                                [params[i].top_p for i in chosen], uniform[rows])
        out = tokens.tolist()
        for row, i in enumerate(random_rows):
            out[i] = int(picks[row])
        return _without(out, bad)

    @staticmethod
    def _sample_filtered(logits: torch.Tensor, top_ks: list[int], top_ps: list[float], uniform: torch.Tensor) -> torch.Tensor:
        """Token ids drawn with top-k and top-p applied.

        Rows are filtered among their ``CANDIDATES`` largest logits (a partial sort), with
        probabilities normalised over the whole vocabulary. That is exact wherever the kept tokens
        all lie among the candidates: a top-k within them, or (no top-k) a top-p whose mass they
        reach (every row of SmolLM2's answers at top-p 0.9, temperature 0.7). The other rows (a
        flat distribution, a top-k beyond the candidates) take a full sort.
        NOTE: with a full sort of the 49k vocabulary (24% of the step) and multinomial over it (13%),
        sampling was 44% of a batch-36 decode step on 2 CPU cores (py-spy)."""
        vocab, device = logits.shape[-1], logits.device
        width = min(vocab, CANDIDATES)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=device)
        ps = torch.tensor(top_ps, dtype=logits.dtype, device=device)
        top, ids = logits.topk(width, dim=-1)  # sorted descending
        ranks = torch.arange(width, device=device)[None, :]
        top = top.masked_fill(ranks >= ks[:, None], float("-inf"))
        within_k = ks <= width  # as the full sort does, normalise over the top-k alone
        norm = torch.where(within_k, top.logsumexp(dim=-1), logits.logsumexp(dim=-1))
        probs = (top - norm[:, None]).exp()
        # NOTE: a top-k beyond the candidates but short of the vocabulary renormalises over k
        # tokens the candidates do not all hold: the full sort
        exact = within_k | ((ks >= vocab) & (probs.sum(dim=-1) >= ps))
        picks = ids.gather(1, _inverse_cdf(_apply_top_p(probs, ps, ranks), uniform)[:, None]).squeeze(1)
        rest = (~exact).nonzero().flatten()
        if len(rest):
            sub = logits.index_select(0, rest)
            probs, order = Sampler._filter_full(sub, [top_ks[r] for r in rest.tolist()], [top_ps[r] for r in rest.tolist()])
            picks[rest] = order.gather(1, _inverse_cdf(probs, uniform[rest])[:, None]).squeeze(1)
        return picks

    @staticmethod
    def _filter_full(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities sorted descending with top-k and top-p applied, not renormalised; token
        ids), after a full sort of each row."""
        vocab, device = logits.shape[-1], logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        ps = torch.tensor(top_ps, dtype=logits.dtype, device=device)
        return _apply_top_p(torch.softmax(sorted_logits, dim=-1), ps, ranks), order


def _without(tokens: list[int], bad: set[int]) -> list[int | None]:
    """``tokens`` with the rows in ``bad`` replaced by None."""
    return [None if i in bad else t for i, t in enumerate(tokens)] if bad else tokens


def _apply_top_p(probs: torch.Tensor, ps: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """Zero each sorted row's tokens once the mass before them reaches top_p. The first always
    survives, even for a top_p that is 0 in float32 (1e-50 passes the `> 0` check)."""
    mass_before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill((mass_before >= ps[:, None]) & (ranks > 0), 0.0)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the index where the running sum of ``weights`` (any scale) first exceeds
    ``uniform`` (in [0, 1)) of its total: a draw from the normalised row. Always an index of
    positive weight, since the sum must grow past the target there."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # NaN logits, or nothing left to draw
        raise RuntimeError("sampling: a row has no finite positive probabilities (NaN or -inf logits)")
    target = (uniform * total)[:, None].contiguous()
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(weights.shape[-1] - 1)
