"""The reasoning parsers on Qwen3 and DeepSeek-R1 texts: the non-streamed split, the same
split however the text is cut into deltas, and the prompt-opened thinking of R1-style
templates."""

from __future__ import annotations

import pytest

from ringserve.http.reasoning import REASONING_PARSERS, make_reasoning_parser

THOUGHT = "\nThe user wants 2 + 2. That is 4 (not </thin 5).\n"
# (parser, prompt end, model text, reasoning, content)
CASES = [
    ("qwen3", "<|im_start|>assistant\n", f"<think>{THOUGHT}</think>\n\nThe answer is 4.",
     THOUGHT, "\n\nThe answer is 4."),
    ("qwen3", "<|im_start|>assistant\n", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "<|im_start|>assistant\n", "<thinking> is a tag", None, "<thinking> is a tag"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Let me see.\n</think>\n\n4",
     "Let me see.\n", "\n\n4"),
    ("qwen3", "<|im_start|>assistant\n", "<think>\ncut short by max_tokens",
     "\ncut short by max_tokens", None),
    ("qwen3", "<|im_start|>assistant\n", "<think>\n\n</think>\n\nNo thinking.", "\n\n",
     "\n\nNo thinking."),
    ("deepseek_r1", "<|Assistant|><think>\n", f"{THOUGHT}</think>The answer is 4.",
     THOUGHT, "The answer is 4."),
    ("deepseek_r1", "<|Assistant|>", f"<think>{THOUGHT}</think>4", THOUGHT, "4"),
    ("deepseek_r1", "<|Assistant|>", "still thinking when it stopped",
     "still thinking when it stopped", None),
    ("deepseek_r1", "<|Assistant|>", "</think>only an answer", None, "only an answer"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_split_plain_and_streamed(case: tuple[str, str, str, str | None, str | None]) -> None:
    name, prompt, text, reasoning, content = case
    assert make_reasoning_parser(name, prompt).extract(text) == (reasoning, content)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser = make_reasoning_parser(name, prompt)
        parts = [parser.feed(p) for p in pieces] + [parser.finish()]
        got_reasoning = "".join(r for r, _ in parts) or None
        got_content = "".join(c for _, c in parts) or None
        assert (got_reasoning, got_content) == (reasoning, content), pieces
        assert "<think>" not in (got_reasoning or "") + (got_content or "")


def test_streams_as_it_goes() -> None:
    parser = make_reasoning_parser("qwen3", "")
    assert parser.feed("<think>Hmm") == ("Hmm", "")
    assert parser.feed(" ok</th") == (" ok", "")
    assert parser.feed("ink>Yes") == ("", "Yes")
    assert parser.feed(" sir") == ("", " sir")


def test_registry() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        make_reasoning_parser("r2")
