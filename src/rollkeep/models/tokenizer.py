"""A character tokenizer: printable ASCII plus PAD, BOS and EOS. Built from nothing, so a
fresh machine needs no download; good enough for the built-in arithmetic task and for
small text datasets."""

from __future__ import annotations

import string

PAD, BOS, EOS = 0, 1, 2
_CHARS = string.digits + string.ascii_letters + string.punctuation + " "
_SPECIAL = 3


class CharTokenizer:
    name = "char"

    def __init__(self) -> None:
        self.vocab_size = _SPECIAL + len(_CHARS)
        self.eos_id = EOS
        self._to_id = {c: i + _SPECIAL for i, c in enumerate(_CHARS)}
        self._unknown = self._to_id["?"]

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = [self._to_id.get(c, self._unknown) for c in text]
        return [BOS, *ids] if bos else ids

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= _SPECIAL:
                out.append(_CHARS[i - _SPECIAL])
        return "".join(out)
