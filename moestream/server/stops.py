"""Stop strings in streamed text: one KMP automaton per string, the tail that could still become one held back.

Owns `StopMatcher`, which the scheduler feeds each decoded piece of text; no I/O, no torch.
"""
from __future__ import annotations


def _failure(s: str) -> list[int]:
    """KMP failure table: fail[i] is the length of the longest proper border of s[:i + 1]."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could still become one.

    One KMP automaton per stop string follows the text character by character, so matching costs O(text) in
    total however the text arrives; the held-back tail is the longest prefix of a stop string that the text
    currently ends with. The first stop string to complete ends the output, at its start."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)  # characters of each stop string matched at the end of the text
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, nothing more is emitted."""
        if not self.stops:
            return text, False
        buf = self.held + text
        base = len(self.held)
        for pos, ch in enumerate(text, base + 1):  # pos: length of buf up to and including ch
            done = [len(s) for j, s in enumerate(self.stops) if self._step(j, ch) == len(s)]
            if done:
                self.held = ""
                return buf[:pos - max(done)], True
        keep = max(self._state)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def _step(self, j: int, ch: str) -> int:
        s, k = self.stops[j], self._state[j]
        if k == len(s):
            k = self._fail[j][k - 1]
        while k and s[k] != ch:
            k = self._fail[j][k - 1]
        if s[k] == ch:
            k += 1
        self._state[j] = k
        return k

    def flush(self) -> str:
        text, self.held = self.held, ""
        self._state = [0] * len(self.stops)
        return text
