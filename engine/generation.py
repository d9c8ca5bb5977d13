"""Generation pieces shared by every backend: events, sampling, stop strings, streamed detokenization.

A backend produces one token id per step; `TextStream` turns ids into text pieces that never split a
UTF-8 character, and holds back text that might still become a stop string.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    text: str                 # the new piece of text (may be "" while bytes of a character are pending)
    token_id: int | None      # the token this step produced (None for the final event)
    finish_reason: str | None = None   # None while streaming; "stop" | "length" | "eos" | "cancelled"
    index: int = 0            # the position of this token among the generated ones


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @staticmethod
    def make(max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, stop=None, seed=None) -> SamplingParams:
        from engine.errors import BadInputError

        if max_new_tokens < 0:
            raise BadInputError(f"max_new_tokens={max_new_tokens}: must be 0 or more")
        if temperature < 0:
            raise BadInputError(f"temperature={temperature}: must be 0 or more")
        if not 0 < top_p <= 1:
            raise BadInputError(f"top_p={top_p}: must be in (0, 1]")
        if isinstance(stop, str):
            stop = (stop,)
        return SamplingParams(int(max_new_tokens), float(temperature), float(top_p), int(top_k or 0),
                              tuple(s for s in (stop or ()) if s), seed)


class Sampler:
    """Picks the next token from logits: greedy at temperature 0, else temperature / top-k / top-p."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.float().cpu()
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            probs = nucleus(probs, p.top_p)
        return draw(probs, self.generator)


NUCLEUS_FIRST = 256     # candidates looked at first for top-p
NUCLEUS_BINS = 1024     # log-probability bins that find a wider nucleus's edge
NUCLEUS_OCTAVES = 64    # the range they cover below the 256th most likely token


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` kept on the smallest set of most likely tokens whose mass reaches `top_p` (the first always
    kept), the rest zeroed (not renormalised: `draw` scales by the total): what a sort, a cumulative sum
    and "keep while the mass before a token is below top_p" keep, without sorting the vocabulary (20 ms per
    token over 150k tokens on a 2-core host). A trained model's nucleus usually lies in the top 256 tokens.
    Otherwise the other tokens are binned by log-probability, the bins' masses summed from the top down
    to the bin where the mass reaches `top_p`: bins above it are kept whole, below it dropped, and only that
    bin's tokens are sorted."""
    n = probs.numel()
    k = min(NUCLEUS_FIRST, n)
    top, idx = torch.topk(probs, k)                     # descending
    cum = torch.cumsum(top, 0)
    if cum[-1] >= top_p or k == n:
        keep = cum - top < top_p
        keep[0] = True
        return torch.zeros_like(probs).scatter_(0, idx[keep], top[keep])
    if float(top[-1]) == 0.0:                           # the top tokens hold all the mass there is
        return torch.zeros_like(probs).scatter_(0, idx, top)
    rest = probs.clone().index_fill_(0, idx, 0.0)
    # bins of log2-probability over the 64 octaves below the 256th token (rarer ones, and zeros, in the
    # lowest: reached only when top_p is within 2^-64 of the mass there is)
    hi = float(top[-1].log2())
    bins = ((rest.log2() - (hi - NUCLEUS_OCTAVES)) * (NUCLEUS_BINS / NUCLEUS_OCTAVES)).floor_()
    bins = bins.clamp_(0, NUCLEUS_BINS - 1).long()
    mass = torch.bincount(bins, weights=rest.double(), minlength=NUCLEUS_BINS)
    down = torch.cumsum(mass.flip(0), 0).flip(0)        # mass of each bin and all above it
    before = float(cum[-1]) + torch.cat([down[1:], down.new_zeros(1)])   # mass above each bin
    reach = torch.nonzero(before + mass >= top_p).flatten()
    edge = int(reach.max()) if reach.numel() else 0     # the highest bin where the mass reaches top_p
    out = torch.where(bins > edge, rest, 0.0).index_copy_(0, idx, top)
    members = torch.nonzero(bins == edge).flatten()
    vals, order = torch.sort(rest[members], descending=True)
    take = float(before[edge]) + torch.cumsum(vals.double(), 0) - vals.double() < top_p
    out[members[order[take]]] = vals[take]
    return out


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn with chance proportional to `probs` (non-negative, any total), by the inverse of
    the cumulative distribution: a zero-probability token is never drawn. torch.multinomial does the same
    in about 5 ms over a 150k vocabulary on a 2-core host, this in about 0.3 ms."""
    cdf = torch.cumsum(probs.double(), 0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


@dataclass(slots=True)
class TextStream:
    """Incremental detokenization with stop strings.

    `push(token_id)` returns the text that is safe to show now; `stopped` turns true when a stop string
    appeared (the text up to it has been emitted, the stop string itself is not).
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    emitted: str = ""          # text already handed out
    stopped: bool = False

    def _decoded(self) -> str:
        text = self.tokenizer.decode(self.ids)
        # A trailing U+FFFD means an incomplete UTF-8 sequence: wait for the next token.
        return text.rstrip("\ufffd") if text.endswith("\ufffd") else text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids) if final else self._decoded()
        if not text.startswith(self.emitted):
            # The decoder rewrote earlier text (rare, e.g. merged spaces): emit only what is new.
            common = 0
            while common < min(len(text), len(self.emitted)) and text[common] == self.emitted[common]:
                common += 1
            self.emitted = text[:common]
        for s in self.stop:
            at = text.find(s, max(0, len(self.emitted) - len(s) + 1))
            if at >= 0:
                self.stopped = True
                piece = text[len(self.emitted):at] if at >= len(self.emitted) else ""
                self.emitted = text[:at]
                return piece
        safe = len(text)
        if not final:
            # Hold back a tail that is a prefix of some stop string.
            for s in self.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        safe = min(safe, len(text) - k)
                        break
        safe = max(safe, len(self.emitted))
        piece = text[len(self.emitted):safe]
        self.emitted = text[:safe]
        return piece


class CancelToken:
    """Set from any thread to stop a running generation at the next step."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


def token_events(tokens: Iterator[int], tokenizer, n_prompt: int, params: SamplingParams, cancel: CancelToken,
                 stats: dict | None = None, t0: float | None = None) -> Iterator[GenerationEvent]:
    """Events of a generation from its token ids: text pieces, then one final event whose finish_reason
    is "eos" (an end-of-sequence token, not shown), "stop" (a stop string), "cancelled" or "length".
    `stats` (if given) receives ttft_s, prompt_tokens, prefill_tokens_per_s, decode_tokens_per_s and
    generated_tokens (times from `t0`, default the first request for an event). The token iterator is
    closed when the events end."""
    stats = {} if stats is None else stats
    stream = TextStream(tokenizer, params.stop)
    eos = set(tokenizer.eos_token_ids)
    t0 = time.perf_counter() if t0 is None else t0
    t_first = None
    n = 0
    reason = "length"
    try:
        for tid in tokens:
            now = time.perf_counter()
            if t_first is None:
                t_first = now
                stats.update(ttft_s=now - t0, prompt_tokens=n_prompt,
                             prefill_tokens_per_s=n_prompt / max(now - t0, 1e-9))
            n += 1
            if tid in eos:
                reason = "eos"
                break
            piece = stream.push(tid)
            if stream.stopped:
                if piece:
                    yield GenerationEvent(piece, tid, None, n - 1)
                reason = "stop"
                break
            yield GenerationEvent(piece, tid, None, n - 1)
            if cancel.cancelled:
                reason = "cancelled"
                break
            if n >= params.max_new_tokens:
                break
        else:
            if cancel.cancelled:
                reason = "cancelled"
    finally:
        end = time.perf_counter()
        if t_first is not None and n > 1:
            stats["decode_tokens_per_s"] = (n - 1) / max(end - t_first, 1e-9)
        stats["generated_tokens"] = n
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
    tail = stream.flush() if reason in ("length", "eos", "cancelled") else ""
    yield GenerationEvent(tail, None, reason, n)
