"""Host-side text of a streamed request: UTF-8-safe incremental detokenisation and stop strings
matched across deltas."""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never end inside a UTF-8 character.

    Byte-level BPE tokens can hold part of a character: the decode of such a prefix ends with U+FFFD.
    Only a small window is decoded per token (from `_prefix` on): the delta is the window's text
    beyond the text of [_prefix, _read), and it is released once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start (a character boundary)
        self._read = 0  # tokens whose text has been released

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        return self._delta(final=False)

    def flush(self) -> str:
        """Release whatever is left (an incomplete character at the very end becomes U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.tok is None or self._read == len(self.ids):
            return ""
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read])
        text = self.tok.decode(self.ids[self._prefix :])
        if len(text) > len(prefix_text) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(prefix_text) :]
        return ""


class StopMatcher:
    """Cuts a stream of text deltas at the first stop string, across delta boundaries.

    The longest suffix of the unsent text that is a prefix of some stop string is held back, so a
    stop string never straddles already-sent text: every occurrence lies in the unsent buffer.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._unsent = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to send, stopped)."""
        if not self.stops:
            return text, False
        self._unsent += text
        hits = [j for j in (self._unsent.find(s) for s in self.stops) if j >= 0]
        if hits:
            out, self._unsent = self._unsent[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._unsent)), hold, -1):
                if self._unsent.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self._unsent) - hold
        out, self._unsent = self._unsent[:cut], self._unsent[cut:]
        return out, False

    def flush(self) -> str:
        out, self._unsent = self._unsent, ""
        return out
