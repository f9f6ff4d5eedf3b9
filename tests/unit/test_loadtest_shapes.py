"""Fixed-shape workloads (``--shape P:O``) and constant-rate arrivals in ``foreserve loadtest``."""

from __future__ import annotations

import pytest

from loadtests.shapes import Shape, Tokenizer, parse_shape, shaped_items


def words() -> Tokenizer:
    """A tokenizer of whitespace words, whose decode of a cut re-encodes exactly (as BPE's mostly does)."""
    vocab: dict[str, int] = {}
    inverse: dict[int, str] = {}

    def encode(text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in vocab:
                vocab[w] = len(vocab)
                inverse[vocab[w]] = w
            ids.append(vocab[w])
        return ids

    return Tokenizer(encode, lambda ids: " ".join(inverse[i] for i in ids))


def test_a_shape_is_prompt_and_output_tokens():
    assert parse_shape(" 256:128 ") == Shape(prompt_tokens=256, output_tokens=128)
    assert str(parse_shape("1024:32")) == "1024:32"


@pytest.mark.parametrize("bad", ["256", "256:", ":128", "a:b", "0:8", "8:0", "256:128:1", "-1:5"])
def test_a_shape_that_is_not_two_whole_numbers_is_refused(bad):
    with pytest.raises(ValueError, match="expected PROMPT_TOKENS:OUTPUT_TOKENS"):
        parse_shape(bad)


def test_shaped_prompts_have_exactly_their_tokens_and_mix_the_shapes():
    tok = words()
    corpus = [" ".join(f"w{i}_{j}" for j in range(300)) for i in range(20)]
    shapes = [parse_shape("100:16"), parse_shape("250:4")]
    items = shaped_items(shapes, 60, corpus, tok, seed=1)
    assert {i["shape"] for i in items} == {"100:16", "250:4"}
    for item in items:
        prompt, output = map(int, item["shape"].split(":"))
        assert len(tok.encode(item["prompt"])) == prompt and item["max_tokens"] == output and item["tier"] == "online"
    assert len({i["prompt"] for i in items}) == 60  # cut at seeded offsets: no two alike
    assert shaped_items(shapes, 60, corpus, tok, seed=1) == items


def test_a_corpus_too_small_for_the_shape_is_refused():
    with pytest.raises(ValueError, match="too few"):
        shaped_items([parse_shape("500:8")], 3, ["a b c"], words(), seed=0)


@pytest.mark.parametrize("args, message", [
    (["--shape", "256"], "expected PROMPT_TOKENS:OUTPUT_TOKENS"),
    (["--shape", "256:128", "--natural-eos"], "drop --natural-eos"),
])
def test_bad_shapes_are_refused_before_anything_starts(args, message, capsys):
    from foreserve.cli.main import main

    assert main(["loadtest", *args, "--report", "/nonexistent/lt"]) == 2
    assert main(["loadtest", "peer", *args, "--report", "/nonexistent/peer"]) == 2
    assert message in capsys.readouterr().err


def test_arrivals_are_poisson_or_constant():
    from loadtests.loadtest import LoadSpec
    from loadtests.summary import SLO

    slos = {"online": SLO(ttft_ms=2000, tpot_ms=250)}
    assert LoadSpec(stages="steady:10:1", slos=slos).arrivals == "poisson"
    spec = LoadSpec(stages="steady:10:1", slos=slos, arrivals="constant", shapes=["256:128", " 64:8"])
    assert spec.shapes == ["256:128", "64:8"]
    with pytest.raises(ValueError):
        LoadSpec(stages="steady:10:1", slos=slos, arrivals="uniform")
