"""Text of a growing list of token ids in linear time: each new token decodes a short window, never
the whole list again (docs/inference.md, 'Inside the server').

    text = Detokenizer(tokenizer); text.add(token); text.starts[i]; text.from_char(k)"""

from __future__ import annotations

import bisect

WINDOW = 4  # tokens decoded again before the committed end, to join pieces as decode does
MAX_CUT = 8  # tokens a cut character may span: past them, U+FFFD is final text


class Detokenizer:
    """The text of `ids` so far as committed pieces (whole characters) and a tail (the text of
    the ids after the last commit, possibly ending in a cut character, U+FFFD).
    `starts[i]`: characters of whole text before token i (where token i's text starts; a cut
    character counts once it is whole)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.starts: list[int] = []
        self.pieces: list[str] = []
        self.ends: list[int] = []  # cumulative length of the pieces
        self.k = 0  # ids committed
        self.head = ""  # decode of the window before k
        self.tail = ""
        self.decoded = 0  # tokens handed to the tokenizer's decode, in all

    def _decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)

    @property
    def committed(self) -> int:
        return self.ends[-1] if self.ends else 0

    def whole(self) -> int:
        """Characters of whole text: the committed ones and the tail's but a cut character."""
        return self.committed + len(self.tail.rstrip("\ufffd"))

    def add(self, token: int) -> None:
        self.starts.append(self.whole())
        self.ids.append(token)
        low = max(0, self.k - WINDOW)
        text = self._decode(self.ids[low:])
        tail = text[len(self.head) :]
        if tail.endswith("\ufffd") and len(self.ids) - self.k < MAX_CUT:
            self.tail = tail
            return
        if tail:
            self.pieces.append(tail)
            self.ends.append(self.committed + len(tail))
        self.k, self.tail = len(self.ids), ""
        self.head = self._decode(self.ids[max(0, self.k - WINDOW) : self.k])

    def extend(self, ids) -> None:
        for t in ids:
            self.add(t)

    def from_char(self, at: int) -> str:
        """The text from character `at` on (the tail included)."""
        j = bisect.bisect_right(self.ends, at)
        if j == len(self.pieces):
            return self.tail[at - self.committed :]
        first = at - (self.ends[j - 1] if j else 0)
        return self.pieces[j][first:] + "".join(self.pieces[j + 1 :]) + self.tail

    def text(self) -> str:
        return "".join(self.pieces) + self.tail
