"""Generated ids -> text deltas for streaming, with stop strings found on the decoded text.

Contract: `TextStream(decode, stop)`; `push(token_id) -> (delta, stopped)` appends one id and returns the text
that is now final: a delta holds back an unfinished character (decode ending in U+FFFD) and any tail that could
still grow into a stop string; when a stop string appears, the delta ends just before it and `stopped` is True
(the stop string itself is never sent, as OpenAI does). `flush() -> delta` returns what was held back once the
generation ends without a stop. The deltas joined equal the decoded text up to the first stop string.
"""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.text = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        self.ids.append(int(token_id))
        self.text = self.decode(self.ids)
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            end = min(hits)
            delta, self.sent = self.text[self.sent:end], max(self.sent, end)
            return delta, True
        end = len(self.text)
        if self.text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its next token
            end -= 1
        end -= self._stop_prefix(self.text[:end])
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta, False

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
