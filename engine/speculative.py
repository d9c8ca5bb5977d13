"""N-gram (prompt lookup) speculative decoding: propose the tokens that followed the latest earlier
occurrence of the context's last n tokens; the model verifies them all in one step.

Verification keeps greedy output that of plain decoding: a proposed token is accepted only where it
equals the model's own argmax at that position, and the first mismatch is replaced by the argmax. On the
CPU (and the simulated accelerator) the tokens are the same bit for bit. On a GPU a verify step is a
multi-token step, whose bf16 kernels round apart from a one-token step's: where two tokens' logits all but
tie, the argmax can differ from plain decoding's, and since the engine's default (`speculative=None`)
decides from measured step times which steps verify proposals, two runs of one prompt can differ there
(session 26, calls BO-BV: a tiny random model's 24th token, in runs that verified 6 and 17 proposals).
`speculative=False` gives plain greedy decoding, the same tokens every run; the GPU suite measures that.
"""

from __future__ import annotations


class NgramIndex:
    """Latest and previous end positions of every n-gram (n = 1..max_n) of a growing token list."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self._prev: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens) - 1
            for n in range(1, self.max_n + 1):
                if end + 1 < n:
                    break
                key = tuple(self.tokens[end + 1 - n:end + 1])
                if key in self._last:
                    self._prev[key] = self._last[key]
                self._last[key] = end

    def propose(self, k: int, min_n: int = 1) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the current suffix."""
        end = len(self.tokens) - 1
        for n in range(min(self.max_n, end + 1), min_n - 1, -1):
            key = tuple(self.tokens[end + 1 - n:])
            pos = self._last.get(key)
            if pos == end:
                pos = self._prev.get(key)
            if pos is not None and pos < end:
                return self.tokens[pos + 1:min(pos + 1 + k, end + 1)]
        return []


def accepted_prefix(proposal: list[int], greedy: list[int]) -> int:
    """How many proposed tokens match the model's argmax at their positions (greedy[i] is the model's
    choice after the input token i, so proposal[i] is checked against greedy[i])."""
    n = 0
    while n < len(proposal) and proposal[n] == greedy[n]:
        n += 1
    return n
