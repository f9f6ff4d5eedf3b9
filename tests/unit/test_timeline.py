"""Timeline: predicted occupancy in blocks along future steps."""

from __future__ import annotations

from app.engine.kv.timeline import Timeline


def occupancy(tl: Timeline, steps: int) -> list[int]:
    return [tl.occupancy(tl.now + t) for t in range(steps)]


def test_ramp_in_blocks_and_release():
    tl = Timeline(capacity_blocks=4, block_size_tokens=4, horizon_steps=32)
    ramp = tl.add(tokens=3, steps=6)  # 3..9 tokens: 1,1,2,2,2,2,3 blocks
    assert occupancy(tl, 8) == [1, 1, 2, 2, 2, 2, 3, 0]
    tl.advance()
    tl.advance()
    tl.remove(ramp)  # only what remains from now on is released
    assert occupancy(tl, 6) == [0] * 6


def test_fits_is_exact_at_the_block_boundary():
    tl = Timeline(capacity_blocks=4, block_size_tokens=4, horizon_steps=32)
    tl.add(tokens=8, steps=4)  # 8..12 tokens: 2,3,3,3,3 blocks
    assert tl.fits(tokens=4, steps=0)  # 1 block now: 2 + 1 <= 4
    assert not tl.fits(tokens=4, steps=4)  # 4..8 tokens: 1,2,... -> 3 + 2 > 4 at step 1
    assert tl.fits(tokens=1, steps=3)  # 1..4 tokens: one block throughout: 3 + 1 <= 4
    assert not tl.fits(tokens=2, steps=3)  # 2..5 tokens: a second block at step 3
    assert not tl.fits(tokens=100, steps=0)


def test_advance_past_the_buffer_keeps_future_occupancy():
    tl = Timeline(capacity_blocks=100, block_size_tokens=1, horizon_steps=8)
    for _ in range(200):  # many shifts of the ring
        tl.add(tokens=1, steps=3)
        tl.advance()
    # ramps added at the last 3 steps are still in flight: 4+3+2, then 4+3, then 4
    assert occupancy(tl, 4) == [2 + 3 + 4, 3 + 4, 4, 0]


def test_a_stalled_sequence_keeps_its_memory_promised():
    """A running sequence the step leaves out (token budget, online TPOT cap) falls behind its
    one-token-per-step ramp; re-anchored, its ramp ends when the sequence really does, so the
    timeline does not promise its blocks to a newcomer meanwhile."""
    from app.engine.kv.allocation import ReservePredicted
    from app.engine.kv.pool import KVPool
    from app.engine.request import Prediction, Request, SamplingParams
    from predictor.buckets import LengthBuckets

    pool = KVPool(4, 16)
    policy = ReservePredicted(pool, LengthBuckets(max_tokens=64), max_seq_tokens=64)

    def request(rid: str, outputs: int) -> Request:
        return Request(rid, [1] * 16, SamplingParams(max_tokens=outputs), 0.0, Prediction(bound_tokens=outputs),
                       predicted_output_tokens=outputs)

    stalled = request("a", 32)  # 16 + 32 tokens: 3 blocks at its end
    policy.admit(stalled, 16)
    stalled.num_computed_tokens = 16
    stalled.output_token_ids.append(7)  # its first token: decoding from here
    newcomer = request("b", 16)  # 2 blocks at its end
    for _ in range(40):  # the ramp alone would have ended after 32 steps
        policy.on_step()
        policy.stalled(stalled)
    # still 17 tokens from 3 blocks at its end: the newcomer's 2 blocks would overcommit the pool
    assert not policy.timeline.fits(*policy._plan(newcomer))
    policy.free(stalled)
    assert policy.timeline.fits(*policy._plan(newcomer))
