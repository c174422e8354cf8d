"""`EncoderBooks` as a plain object: when each image's encode is scheduled, the encoder
budget per step, the mirrored encoder cache (pinned entries kept, unpinned ones dropped least
recently used first and listed for the workers), Gemma 3's unsplit images, and the admission
check's messages."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.gpu.multimodal.scheduling import EncoderBooks


@dataclass
class Req:
    request_id: str
    mm_features: list[ImageFeature] | None


def img(identifier: str, offset: int, rows: int, length: int | None = None) -> ImageFeature:
    return ImageFeature(identifier, offset, rows if length is None else length, rows)


def step(books: EncoderBooks,
         *calls: tuple[Req, int, int]) -> tuple[list[int], dict[str, list[int]], list[str]]:
    """One step: `fit` for each (request, start, n); the kept counts, encodes and drops."""
    books.begin_step()
    kept = [books.fit(req, start, n) for req, start, n in calls]
    encodes, freed = books.take_step()
    return kept, encodes, freed


def test_rejects_an_empty_cache_or_budget() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        EncoderBooks(0, 8, no_split=False)
    with pytest.raises(ValueError, match="must be >= 1"):
        EncoderBooks(8, 0, no_split=False)


def test_text_only_request_keeps_its_chunk() -> None:
    books = EncoderBooks(16, 16, no_split=False)
    assert step(books, (Req("t", None), 0, 30)) == ([30], {}, [])


def test_one_encode_per_identifier_in_a_step() -> None:
    books = EncoderBooks(64, 64, no_split=False)
    a = Req("a", [img("x", 2, 8)])
    b = Req("b", [img("x", 5, 8), img("y", 20, 4)])
    kept, encodes, freed = step(books, (a, 0, 16), (b, 0, 30))
    assert kept == [16, 30]
    assert encodes == {"a": [0], "b": [1]}  # b's "x" is a's encode
    assert freed == []
    assert books.usage == 12 / 64


def test_same_image_twice_in_one_prompt_is_encoded_once() -> None:
    books = EncoderBooks(64, 64, no_split=False)
    a = Req("a", [img("x", 0, 8), img("x", 10, 8)])
    assert step(books, (a, 0, 20)) == ([20], {"a": [0]}, [])
    assert books.usage == 8 / 64


def test_a_later_request_with_the_same_image_finds_it_cached() -> None:
    books = EncoderBooks(64, 64, no_split=False)
    a = Req("a", [img("x", 0, 8)])
    assert step(books, (a, 0, 10))[1] == {"a": [0]}
    books.release(a)  # finished: unpinned, kept for others
    b = Req("b", [img("x", 3, 8)])
    assert step(books, (b, 0, 12)) == ([12], {}, [])


def test_the_budget_cuts_the_chunk_before_an_image() -> None:
    books = EncoderBooks(64, 10, no_split=False)
    req = Req("r", [img("x", 5, 8), img("y", 20, 8)])
    kept, encodes, _ = step(books, (req, 0, 40))
    assert kept == [20]  # "y" needs 8 more rows than the step has left
    assert encodes == {"r": [0]}
    kept, encodes, _ = step(books, (req, 20, 20))
    assert kept == [20]
    assert encodes == {"r": [1]}


def test_the_budget_is_shared_by_the_steps_requests() -> None:
    books = EncoderBooks(64, 10, no_split=False)
    a = Req("a", [img("x", 0, 8)])
    b = Req("b", [img("y", 3, 8)])
    kept, encodes, _ = step(books, (a, 0, 10), (b, 0, 10))
    assert kept == [10, 3]  # b stops before its image
    assert encodes == {"a": [0]}
    kept, encodes, _ = step(books, (b, 3, 10))  # next step: the budget is back
    assert kept == [10]
    assert encodes == {"b": [0]}


def test_a_chunk_inside_an_image_needs_no_new_encode() -> None:
    books = EncoderBooks(64, 64, no_split=False)
    req = Req("r", [img("x", 2, 12)])
    assert step(books, (req, 0, 6)) == ([6], {"r": [0]}, [])
    assert step(books, (req, 6, 6)) == ([6], {}, [])  # the rest of the image: cached


def test_pinned_entries_are_never_evicted() -> None:
    books = EncoderBooks(16, 64, no_split=False)
    a = Req("a", [img("x", 0, 8)])
    b = Req("b", [img("y", 0, 8)])
    c = Req("c", [img("z", 4, 8)])
    kept, encodes, _ = step(books, (a, 0, 4), (b, 0, 4))  # both mid-image: pinned
    assert encodes == {"a": [0], "b": [0]}
    kept, encodes, freed = step(books, (c, 0, 20))
    assert kept == [4]  # no room for "z": stops before it
    assert encodes == {} and freed == []
    books.release(a)
    kept, encodes, freed = step(books, (c, 0, 20))
    assert kept == [20]
    assert encodes == {"c": [0]}
    assert freed == ["x"]
    assert books.usage == 1.0


def test_passing_an_image_unpins_it() -> None:
    books = EncoderBooks(16, 64, no_split=False)
    a = Req("a", [img("x", 0, 8), img("y", 10, 8)])
    assert step(books, (a, 0, 20))[1] == {"a": [0, 1]}
    other = Req("o", [img("z", 0, 8)])
    assert step(books, (other, 0, 8))[0] == [0]  # both of a's images pinned
    step(books, (a, 20, 1))  # a decodes past both images: unpinned
    kept, encodes, freed = step(books, (other, 0, 8))
    assert kept == [8] and encodes == {"o": [0]} and freed == ["x"]


def test_unpinned_entries_are_evicted_least_recently_used_first() -> None:
    books = EncoderBooks(24, 64, no_split=False)
    reqs = [Req(k, [img(k, 0, 8)]) for k in "xyz"]
    step(books, *((r, 0, 8) for r in reqs))
    for r in reqs:
        books.release(r)
    again = Req("again", [img("x", 0, 8)])  # "x" used again: now the newest
    assert step(books, (again, 0, 8)) == ([8], {}, [])
    books.release(again)
    new = Req("n", [img("w", 0, 16)])
    kept, encodes, freed = step(books, (new, 0, 16))
    assert kept == [16] and encodes == {"n": [0]}
    assert freed == ["y", "z"]
    hit = Req("h", [img("x", 0, 8)])
    assert step(books, (hit, 0, 8)) == ([8], {}, [])  # "x" survived


def test_no_split_never_ends_a_chunk_inside_an_image() -> None:
    books = EncoderBooks(64, 64, no_split=True)
    req = Req("r", [img("x", 5, 8)])
    kept, encodes, _ = step(books, (req, 0, 10))
    assert kept == [5] and encodes == {}  # stops before the image, nothing encoded
    kept, encodes, _ = step(books, (req, 5, 6))
    assert kept == [0] and encodes == {}  # the image cannot fit this step
    kept, encodes, _ = step(books, (req, 5, 8))
    assert kept == [8] and encodes == {"r": [0]}


def test_without_no_split_the_chunk_may_end_inside_an_image() -> None:
    books = EncoderBooks(64, 64, no_split=False)
    req = Req("r", [img("x", 5, 8)])
    assert step(books, (req, 0, 10)) == ([10], {"r": [0]}, [])


def test_cancel_takes_back_the_steps_encodes() -> None:
    books = EncoderBooks(16, 10, no_split=False)
    a = Req("a", [img("x", 0, 8)])
    b = Req("b", [img("y", 0, 8)])
    books.begin_step()
    assert books.fit(a, 0, 8) == 8
    books.cancel(a)  # a got no KV room after all
    assert books.usage == 0
    assert books.fit(b, 0, 8) == 8  # its budget came back
    assert books.take_step() == ({"b": [0]}, [])
    # "x" is not cached: a's next try encodes it.
    assert step(books, (a, 0, 8))[1] == {"a": [0]}


def test_cancel_leaves_cached_images_alone() -> None:
    books = EncoderBooks(16, 16, no_split=False)
    a = Req("a", [img("x", 0, 8)])
    step(books, (a, 0, 8))
    b = Req("b", [img("x", 0, 8)])
    books.begin_step()
    assert books.fit(b, 0, 8) == 8
    books.cancel(b)
    assert books.take_step() == ({}, [])
    assert books.usage == 8 / 16


def test_release_makes_a_requests_images_evictable() -> None:
    books = EncoderBooks(8, 8, no_split=False)
    a = Req("a", [img("x", 0, 8)])
    step(books, (a, 0, 4))
    b = Req("b", [img("y", 0, 8)])
    assert step(books, (b, 0, 8))[0] == [0]
    books.release(a)
    assert step(books, (b, 0, 8)) == ([8], {"b": [0]}, ["x"])


def test_reset_lists_everything_to_free() -> None:
    books = EncoderBooks(16, 16, no_split=False)
    a, b = Req("a", [img("x", 0, 8)]), Req("b", [img("y", 0, 8)])
    step(books, (a, 0, 8), (b, 0, 8))
    books.release(a)
    books.begin_step()
    books.fit(Req("c", [img("z", 0, 8)]), 0, 8)  # evicts "x" (pending drop), encodes "z"
    books.reset()
    encodes, freed = books.take_step()
    assert encodes == {}
    assert sorted(freed) == ["x", "y", "z"]
    assert books.usage == 0
    # After a reset every image is encoded again.
    assert step(books, (Req("d", [img("y", 0, 8)]), 0, 8))[1] == {"d": [0]}


def test_check_messages() -> None:
    books = EncoderBooks(16, 12, no_split=False)
    assert books.check([img("x", 0, 12)], 8) is None  # may be split over steps
    message = books.check([img("x", 0, 4), img("y", 10, 13)], 64)
    assert message is not None
    assert "image 1 needs 13 encoder rows" in message
    assert "encoder budget (12)" in message and "cache (16)" in message
    unsplit = EncoderBooks(64, 64, no_split=True)
    assert unsplit.check([img("x", 0, 8)], 8) is None
    message = unsplit.check([img("x", 0, 8, length=10)], 9)
    assert message is not None
    assert "image 0 spans 10 tokens" in message and "max_num_batched_tokens (9)" in message
