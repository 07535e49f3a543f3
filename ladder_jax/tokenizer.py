"""The embedded default tokenizer: UTF-8 bytes, no download.

Ids 0-255 are the bytes; then three specials. Any preset whose vocab_size >= 259 can use it
(`tiny` and `small` have 320: a multiple of 16 and of 64, so every tp up to 16 divides it).
"""

from __future__ import annotations


class ByteTokenizer:
    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259

    bos_id, eos_id, pad_id = BOS, EOS, PAD

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def decode(self, ids) -> str:
        """Bytes back to text; specials are dropped, broken UTF-8 shows as U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self):
        return "ByteTokenizer(bytes 0-255, BOS=256, EOS=257, PAD=258)"
