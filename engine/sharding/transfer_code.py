"""Lossless transfer coding of bf16 weights: fewer bytes over PCIe, the same bits in the slot.

A bf16 word is two bytes, [s eeeeeee] [e mmmmmmm]. The low byte (the exponent's last bit and the mantissa)
is close to uniform noise, the high byte is not: a weight matrix sits within a few binades of its scale,
so its exponents' top bits take a handful of values. The coded form keeps every low byte as it is and
replaces each high byte with a 4-bit code: bit 3 the sign, bits 0-2 the offset (0-6) of the exponent's
top seven bits from a base chosen per chunk (the 7-value window holding the most words); offset code 7
marks an escape, a word stored whole with its position in the sub-layer's escape block. That is 12 bits a
weight, 75% of the bytes, for any bf16 matrix whose values span fewer than 14 binades (a normal
distribution puts about 2 in 10,000 words outside them).

A sub-layer's packed buffer is coded in chunks of `CHUNK_WORDS` words, each with its own base, so
the GPU can take them one at a time through a small staging ring: the copy engine brings chunk c into a
stage while the GPU decodes chunk c-1 from the other one into the slot. A chunk whose coded form would not
be smaller than `MAX_CODED_FRACTION` of its bytes (another dtype's bytes, padding, heavy tails) is kept raw
and copied straight into the slot. Decoding is exact: the slot holds the same bytes as the host buffer.

Coded buffer layout (bytes): each chunk (coded: lo [W] | nibbles [ceil(W/2)], word 2i in the low nibble and
2i+1 in the high; raw: its bytes), then the escape block (positions int32 [k], the word's index in the
sub-layer, then the words int16 [k]); each piece starts `ALIGN`ed. The GPU decodes a chunk's escapes as
garbage and the escape block, applied last, puts them right: one small operation per sub-layer.

A tighter form (`SLIPSTREAM_TRANSFER_CODE_TIGHT=1`, experimental, off by default: on the H200, session 27 call
BY, Llama-3-8B at 4 GiB, 71.9% of the bytes against 75.3%, the prefills 2-4% faster, the decode 4% slower):
the high byte of a normal bf16 matrix carries about 2.7 bits, and the 4-bit code spends 4. A tight chunk
keeps the low bytes, a sign plane (1 bit a word) and a 2-bit code: the offset (0-2) of the exponent's top
seven bits from a 3-value window (about 92% of a normal matrix's words), or 3 for a word whose top bits are
in a second stream of 4-bit codes (a 15-value window of its own, 15 marking an escape). Each block of
TIGHT_BLOCK words stores where its words start in that stream, so the GPU finds a word's code by a prefix
sum within its block. About 11.3 bits a weight, 71% of the bytes; a chunk takes whichever form is smaller.
Tight chunk layout: block starts int32 [ceil(W / TIGHT_BLOCK)] | lo [W] | signs [ceil(W/8)] | codes
[ceil(W/4)] | second codes [ceil(n2/2)], bits and codes packed from each byte's low end.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ALIGN = 256                     # every coded chunk starts aligned (the host buffer's views and DMA like it)
CHUNK_WORDS = 32 << 20          # 64 MiB of bf16 a chunk
MAX_CODED_FRACTION = 0.8        # code a chunk only if that makes it at most this share of its bytes
MIN_BYTES = 256 << 10           # smaller sub-layers stay raw (a copy that small is latency, not bytes)
N_STAGES = 2                    # staging buffers on the GPU: one filling while the other is decoded
ESCAPE = 7
ESCAPE_SLICE = 1 << 17          # escapes put per scatter (`apply_escapes`; its int64 index 1 MiB at most)
TIGHT_BLOCK = 1024              # a tight chunk's words per decode block (its second codes' start stored per block)
ESCAPE2 = 15


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True, slots=True)
class Chunk:
    raw_off: int        # first byte in the raw (packed) buffer
    words: int          # bf16 words it covers
    off: int            # first byte in the coded buffer
    nbytes: int         # bytes in the coded buffer (raw chunks: 2 * words)
    base: int           # -1: stored raw; else the window's first value of the exponent's top seven bits
    base2: int = -1     # a tight chunk's second window's first value (-1: the 4-bit code)
    n2: int = 0         # a tight chunk's words in the second stream

    @property
    def coded(self) -> bool:
        return self.base >= 0

    @property
    def tight(self) -> bool:
        return self.base2 >= 0


@dataclass(slots=True)
class CodedBuffer:
    """A sub-layer's bytes in transfer-coded form: one host buffer, its chunks and its escape block."""
    host: torch.Tensor          # uint8, pinned on CUDA
    chunks: tuple[Chunk, ...]
    raw_bytes: int
    esc_off: int = 0            # the escape block's first byte
    escapes: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.host.numel())

    @property
    def stage_bytes(self) -> int:
        """What one staging buffer must hold: the largest coded chunk, or the escape block."""
        return max(max((c.nbytes for c in self.chunks if c.coded), default=0), 6 * self.escapes)


def enabled_by_env() -> bool | None:
    """`SLIPSTREAM_TRANSFER_CODE`: 1 on, 0 off, unset: decide by host memory (`engine.backends`)."""
    v = os.environ.get("SLIPSTREAM_TRANSFER_CODE")
    return None if v in (None, "") else v not in ("0", "off", "false")


def tight_enabled() -> bool:
    """`SLIPSTREAM_TRANSFER_CODE_TIGHT=1`: chunks may take the tight form where it is smaller."""
    return os.environ.get("SLIPSTREAM_TRANSFER_CODE_TIGHT", "0") == "1"


def min_bytes() -> int:
    return int(os.environ.get("SLIPSTREAM_TRANSFER_CODE_MIN", MIN_BYTES))


def _top_bits(raw: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_and(raw.view(-1, 2)[:, 1], 0x7F)


SAMPLE_STRIDE = 61             # the base is chosen from every 61st word (a prime: no stride of a matrix's rows)


def _choose_base(raw: torch.Tensor) -> int:
    """The 7-value window of the exponent's top bits holding the most of a sample of the chunk's words."""
    hi = raw.view(-1, 2)[:, 1]
    sample = torch.bitwise_and(hi[::SAMPLE_STRIDE] if hi.numel() > 64 * SAMPLE_STRIDE else hi, 0x7F)
    return int(_windows(torch.bincount(sample.to(torch.int64), minlength=128), 7).argmax())   # [b, b + 6]


def _pays(words: int, escapes: int) -> bool:
    return _coded_bytes(words) + 6 * escapes <= MAX_CODED_FRACTION * 2 * words


def _coded_bytes(words: int) -> int:
    return words + (words + 1) // 2


def chunk_bounds(total_words: int, chunk_words: int | None = None,
                 segments: list[tuple[int, int, int]] | None = None) -> list[tuple[int, int]]:
    """(first word, words) of each chunk: runs of up to `chunk_words`. `segments`: (first word, words, words
    a row) of each tensor in the buffer, in order and covering it (a tensor's segment runs to the next
    one's start, padding included). A chunk then ends only where a row of the tensor it ends in does (or
    at a tensor's end), so no row of a matrix straddles two chunks and the CPU can read each row from one
    chunk's bytes and base; small tensors share chunks with their neighbours. A row longer than a chunk
    is a chunk of its own."""
    segments = segments or [(0, total_words, 1)]
    chunk_words = chunk_words or CHUNK_WORDS
    out, start, cur = [], 0, 0
    for s0, words, row in segments:
        p, end, row = s0, s0 + words, max(int(row), 1)
        while p < end:
            room = chunk_words - cur
            if end - p <= room:
                cur += end - p
                p = end
                continue
            take = room // row * row
            if take == 0 and cur == 0:
                take = min(row, end - p)
            if take == 0:
                out.append((start, cur))
                start, cur = p, 0
                continue
            cur += take
            p += take
            out.append((start, cur))
            start, cur = p, 0
    if cur:
        out.append((start, cur))
    return out


def plan(raw: torch.Tensor, chunk_words: int | None = None,
         segments: list[tuple[int, int, int]] | None = None,
         tight: bool | None = None) -> tuple[tuple[Chunk, ...], int, int] | None:
    """How a packed buffer (uint8, bf16 words) codes: (chunks, the escape block's offset, escapes), from one
    counting pass; None if it is not whole words or no chunk gets smaller. Its coded form takes
    `coded_size(...)` bytes. `segments`: see `chunk_bounds`. `tight`: whether chunks may take the tight form
    (None: `tight_enabled()`)."""
    tight = tight_enabled() if tight is None else tight
    n = raw.numel()
    if n % 2 or n // 2 >= 1 << 31:
        return None
    chunks, off, escapes = [], 0, 0
    for w0, w in chunk_bounds(n // 2, chunk_words, segments):
        part = raw[2 * w0:2 * (w0 + w)]
        base = _choose_base(part)
        esc = _count_escapes(part, base)
        if not _pays(w, esc):
            base, esc = -1, 0
        nbytes = 2 * w if base < 0 else _coded_bytes(w)
        chunk = Chunk(2 * w0, w, off, nbytes, base)
        if tight:                              # (the tight form where it is smaller, escapes counted)
            tb, b2, n2, esc2 = _tight_choice(part)
            size = _tight_bytes(w, n2) + 6 * esc2
            if size < nbytes + 6 * esc and size <= MAX_CODED_FRACTION * 2 * w:
                chunk, esc = Chunk(2 * w0, w, off, _tight_bytes(w, n2), tb, b2, n2), esc2
        chunks.append(chunk)
        escapes += esc
        off = _up(off + chunk.nbytes, ALIGN)
    if not any(c.coded for c in chunks):
        return None
    return tuple(chunks), off, escapes


def coded_size(esc_off: int, escapes: int) -> int:
    return esc_off + _up(6 * escapes, ALIGN)


def encode_into(raw: torch.Tensor, layout: tuple[tuple[Chunk, ...], int, int], host: torch.Tensor) -> CodedBuffer:
    """Code `raw` as `plan` laid it out into `host` (uint8, `coded_size` bytes: pinned for the GPU's copies)."""
    chunks, esc_off, escapes = layout
    pos_all = []
    for c in chunks:
        part = raw[c.raw_off:c.raw_off + 2 * c.words]
        if c.tight:
            pos_all.append(_code_tight(part, c, host[c.off:c.off + c.nbytes]) + c.raw_off // 2)
        elif c.coded:
            pos_all.append(_code_chunk(part, c.base, host[c.off:c.off + c.nbytes]) + c.raw_off // 2)
        else:
            host[c.off:c.off + c.nbytes].copy_(part)
    pos = torch.cat(pos_all)
    if len(pos) != escapes:
        raise RuntimeError(f"transfer coding: {len(pos)} escapes where {escapes} were counted")
    if escapes:
        host[esc_off:esc_off + 4 * escapes].view(torch.int32).copy_(pos)
        host[esc_off + 4 * escapes:esc_off + 6 * escapes].view(torch.int16).copy_(raw.view(torch.int16)[pos.long()])
    return CodedBuffer(host, chunks, raw.numel(), esc_off, escapes)


def encode(raw: torch.Tensor, pin: bool = False, chunk_words: int | None = None,
           tight: bool | None = None) -> CodedBuffer | None:
    """`plan` and `encode_into` a buffer of its own; None if coding does not pay. (A weight store plans all its
    sub-layers first and packs their coded buffers into a few pinned chunks: one pinned allocation per
    buffer rounds each up to a power of two.)"""
    layout = plan(raw, chunk_words, tight=tight)
    if layout is None:
        return None
    from engine.sharding.device import host_buffers

    return encode_into(raw, layout, host_buffers([coded_size(*layout[1:])], pin)[0])


def _count_escapes(part: torch.Tensor, base: int) -> int:
    from engine import kernels

    k = kernels.bf16_code(part.view(torch.int16), base, None, None) if part.is_contiguous() else None
    if k is not None:
        return k
    d = _top_bits(part).to(torch.int16) - base
    return int(((d < 0) | (d > 6)).sum())


def _code_chunk(part: torch.Tensor, base: int, out: torch.Tensor) -> torch.Tensor:
    """Code one chunk's words (`part`, uint8 [2W]) against `base` into `out` (lo [W] | nibbles); returns
    its escapes' word positions within the chunk (int32)."""
    from engine import kernels

    w = part.numel() // 2
    words = part.view(torch.int16)
    lo, nib = out[:w], out[w:]
    k = kernels.bf16_code(words, base, lo, nib) if part.is_contiguous() else None
    if k is not None:
        pos = kernels.bf16_escapes(words, base, k) if k else torch.zeros(0, dtype=torch.int32)
        if pos is not None:
            return pos
    pair = part.view(-1, 2)
    lo.copy_(pair[:, 0])
    hi = pair[:, 1]
    off = torch.bitwise_and(hi, 0x7F).to(torch.int16) - base
    esc = (off < 0) | (off > 6)
    code = torch.where(esc, ESCAPE, off).to(torch.uint8) | torch.bitwise_right_shift(torch.bitwise_and(hi, 0x80), 4)
    if w % 2:
        code = torch.cat([code, code.new_zeros(1)])
    nib.copy_(code[0::2] | torch.bitwise_left_shift(code[1::2], 4))
    return esc.nonzero().view(-1).to(torch.int32)


def decode_chunk(lo: torch.Tensor, nib: torch.Tensor, out16: torch.Tensor, base: int) -> None:
    """Write a coded chunk's words into `out16` (int16 [W], the slot's words for it) from its low bytes
    `lo` [W] and nibbles `nib` [ceil(W/2)] on the same device: one fused kernel on CUDA where Triton is
    there, else a few tensor operations. Escaped words come out wrong until `apply_escapes`."""
    if out16.is_cuda and triton_available():
        _triton_decode(lo, nib, out16, out16.numel(), base)
        return
    w = out16.numel()
    pair = out16.view(torch.uint8).view(-1, 2)
    pair[:, 0].copy_(lo)
    code = torch.stack([torch.bitwise_and(nib, 15), torch.bitwise_right_shift(nib, 4)], 1).view(-1)[:w]
    pair[:, 1].copy_(torch.bitwise_left_shift(torch.bitwise_and(code, 8), 4) | (torch.bitwise_and(code, 7) + base))


def _windows(hist: torch.Tensor, width: int) -> torch.Tensor:
    """[128 - width + 1]: of a histogram of the exponent's top seven bits, the words in each window [b, b +
    width - 1]."""
    counts = hist.cumsum(0)
    return counts[width - 1:] - torch.cat([counts.new_zeros(1), counts[:-width]])


def _tight_split(top: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets from `base` as uint8, wrapping below it; which words go to the second stream)."""
    d = top - base                                   # (uint8: a value below the window wraps past 128)
    return d, d > 2


def _tight_choice(part: torch.Tensor) -> tuple[int, int, int, int]:
    """A chunk's tight windows and counts: (base, base2, words in the second stream, escapes). The windows
    come from a sample's histogram (the second from what the first leaves), the counts from every word."""
    from engine import kernels

    hi = part.view(-1, 2)[:, 1]
    sample = torch.bitwise_and(hi[::SAMPLE_STRIDE] if hi.numel() > 64 * SAMPLE_STRIDE else hi, 0x7F)
    hist = torch.bincount(sample.to(torch.int64), minlength=128)
    base = int(_windows(hist, 3).argmax())
    hist[base:base + 3] = 0
    base2 = int(_windows(hist, 15).argmax())
    got = kernels.bf16_tight_code(part.view(torch.int16), base, base2) if part.is_contiguous() else None
    if got is not None:
        return base, base2, *got
    top = torch.bitwise_and(hi, 0x7F)
    second = top[_tight_split(top, base)[1]]
    return base, base2, int(second.numel()), int(((second - base2) > 14).sum())


def _tight_layout(w: int, n2: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets in a tight chunk: (block starts, lo, signs, codes, second codes, end)."""
    nb = -(-w // TIGHT_BLOCK)
    lo = 4 * nb
    sgn = lo + w
    c2 = sgn + (w + 7) // 8
    nib2 = c2 + (w + 3) // 4
    return 0, lo, sgn, c2, nib2, nib2 + (n2 + 1) // 2


def _tight_bytes(w: int, n2: int) -> int:
    return _tight_layout(w, n2)[-1]


def _pack(vals: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """uint8 values of `bits` bits each (at most 2**bits - 1), packed into `out` from each byte's low end."""
    per = 8 // bits
    whole = vals.numel() // per * per
    v = vals[:whole].view(-1, per)
    acc = v[:, 0].clone()
    for j in range(1, per):
        acc |= torch.bitwise_left_shift(v[:, j], j * bits)
    out[:acc.numel()].copy_(acc)
    if whole < vals.numel():                        # (the last byte's values)
        tail = 0
        for j, x in enumerate(vals[whole:].tolist()):
            tail |= int(x) << (j * bits)
        out[acc.numel()] = tail


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first `n` values of `bits` bits each packed by `_pack` (uint8)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return torch.bitwise_and(torch.bitwise_right_shift(packed[:, None], shifts), (1 << bits) - 1).view(-1)[:n]


def _code_tight(part: torch.Tensor, c: Chunk, out: torch.Tensor) -> torch.Tensor:
    """Code one chunk's words in the tight form into `out` (its `c.nbytes`); returns its escapes' word
    positions within the chunk (int32)."""
    from engine import kernels

    w = c.words
    b0, lo, sgn, c2, nib2, end = _tight_layout(w, c.n2)
    if part.is_contiguous():
        out[nib2:end].zero_()
        pos = torch.empty(max(c.n2, 1), dtype=torch.int32)
        parts = (out[b0:lo], out[lo:sgn], out[sgn:c2], out[c2:nib2], out[nib2:end])
        got = kernels.bf16_tight_code(part.view(torch.int16), c.base, c.base2, parts, pos)
        if got is not None:
            if got[0] != c.n2:
                raise RuntimeError(f"tight transfer coding: {got[0]} second-stream words where {c.n2} were counted")
            return pos[:got[1]].clone()
    pair = part.view(-1, 2)
    hi = pair[:, 1]
    top = torch.bitwise_and(hi, 0x7F)
    d, second = _tight_split(top, c.base)
    padded = torch.zeros(-(-w // TIGHT_BLOCK) * TIGHT_BLOCK, dtype=torch.int32)
    padded[:w] = second
    per_block = padded.view(-1, TIGHT_BLOCK).sum(1, dtype=torch.int32)
    out[b0:lo].view(torch.int32).copy_(per_block.cumsum(0, dtype=torch.int32) - per_block)
    out[lo:sgn].copy_(pair[:, 0])
    _pack(torch.bitwise_right_shift(hi, 7), 1, out[sgn:c2])
    _pack(d.clamp(max=3), 2, out[c2:nib2])
    where2 = second.nonzero().view(-1)
    d2 = top[where2] - c.base2
    esc = d2 > 14
    _pack(d2.masked_fill_(esc, ESCAPE2), 4, out[nib2:end])
    return where2[esc].to(torch.int32)


def decode_tight_chunk(st: torch.Tensor, out16: torch.Tensor, w: int, n2: int, base: int, base2: int) -> None:
    """Write a tight chunk's words into `out16` (int16 [w]) from its bytes `st` on the same device: one fused
    kernel on CUDA where Triton is there and its check passed, else tensor operations. Escaped words come
    out wrong until `apply_escapes`."""
    b0, lo, sgn, c2, nib2, end = _tight_layout(w, n2)
    if out16.is_cuda and _tight_triton is not None:
        _tight_triton(st[b0:lo].view(torch.int32), st[lo:sgn], st[sgn:c2], st[c2:nib2], st[nib2:end], out16, w,
                      base, base2)
        return
    pair = out16.view(torch.uint8).view(-1, 2)
    pair[:, 0].copy_(st[lo:sgn])
    code = _unpack(st[c2:nib2], 2, w)
    top = base + code
    if n2:
        second = code == 3
        vals = _unpack(st[nib2:end], 4, n2)
        pos = (torch.cumsum(second.to(torch.int64), 0) - 1).clamp_(min=0)
        top = torch.where(second, base2 + vals[pos], top)
    sign = _unpack(st[sgn:c2], 1, w)
    pair[:, 1].copy_((torch.bitwise_left_shift(sign, 7) | torch.bitwise_and(top, 0x7F)).to(torch.uint8))


def apply_escapes(block: torch.Tensor, k: int, dst16: torch.Tensor) -> None:
    """Put the escaped words of the escape block `block` (uint8 [6k]) into the sub-layer's words `dst16`,
    `ESCAPE_SLICE` at a time: PyTorch copies an int32 index to int64 before it scatters, a temporary of 8
    bytes an escape. Whole, it was 20 MiB for one expert group of the Qwen3-30B-A3B shape (some 2.6 million
    escapes) and ran the 2 GiB budget out of memory on the H200 (session 29, call CG); a slice's is booked
    with the staging ring (`WeightStore.escape_index_bytes`)."""
    pos, val = block[:4 * k].view(torch.int32), block[4 * k:6 * k].view(torch.int16)
    for a in range(0, k, ESCAPE_SLICE):
        dst16.index_put_((pos[a:a + ESCAPE_SLICE],), val[a:a + ESCAPE_SLICE])


class Program:
    """One coded buffer's copy into one device buffer through one staging ring, as views cut once: per
    piece (chunk or escape block), the host bytes, the stage it crosses into and what runs there."""

    __slots__ = ("any_raw", "steps")

    def __init__(self, coded: CodedBuffer, dst: torch.Tensor, stages: list[torch.Tensor]):
        steps, j = [], 0
        dst16 = dst[:coded.raw_bytes].view(torch.int16)
        for c in coded.chunks:
            src = coded.host[c.off:c.off + c.nbytes]
            out = dst[c.raw_off:c.raw_off + 2 * c.words]
            if not c.coded:
                steps.append((None, src, out, None))
                continue
            k, j = j % len(stages), j + 1
            st = stages[k][:c.nbytes]
            out16 = out.view(torch.int16)
            if c.tight:
                steps.append((k, src, st, lambda st=st, out16=out16, c=c:
                              decode_tight_chunk(st, out16, c.words, c.n2, c.base, c.base2)))
                continue
            lo, nib, base = st[:c.words], st[c.words:], c.base
            steps.append((k, src, st, lambda lo=lo, nib=nib, out16=out16, base=base: decode_chunk(lo, nib, out16, base)))
        if coded.escapes:
            k, n = j % len(stages), coded.escapes
            src = coded.host[coded.esc_off:coded.esc_off + 6 * n]
            st = stages[k][:6 * n]
            steps.append((k, src, st, lambda st=st, n=n: apply_escapes(st, n, dst16)))
        self.steps = tuple(steps)
        self.any_raw = any(s[0] is None for s in steps)


class CpuMatrix:
    """A bf16 matrix [n, k] of a coded sub-layer as the native matmul reads it in place (`kernels.CodedMat`):
    per chunk it lies in, its first row there and that row's low bytes and codes, the chunk's base; and the
    sub-layer's escape block. Holds what it points into. Raises ValueError where a chunk of it is raw."""

    def __init__(self, coded: CodedBuffer, word0: int, n: int, k: int):
        from engine.kernels import CodedMat

        if k % 2 or word0 % 2 or n < 1:
            raise ValueError("not a coded matrix: odd rows or start")
        end = word0 + n * k
        mine = [c for c in coded.chunks if c.raw_off // 2 < end and c.raw_off // 2 + c.words > word0]
        first, lo, nib, base = [], [], [], []
        p = coded.host.data_ptr()
        for c in mine:
            w = max(c.raw_off // 2, word0)                 # this chunk's first word of the matrix
            if not c.coded or c.tight or (w - word0) % k:
                raise ValueError("not a coded matrix: a chunk of it is raw, tight or cuts a row")
            rel = w - c.raw_off // 2
            first.append((w - word0) // k)
            lo.append(p + c.off + rel)
            nib.append(p + c.off + c.words + rel // 2)
            base.append(c.base)
        if not mine or first[0] != 0:
            raise ValueError("not a coded matrix: its chunks do not cover it")
        m = len(mine)
        self._first = (ctypes.c_int64 * m)(*first)
        self._lo = (ctypes.c_void_p * m)(*lo)
        self._nib = (ctypes.c_void_p * m)(*nib)
        self._base = (ctypes.c_uint8 * m)(*base)
        self._host = coded.host
        self.desc = CodedMat(m, self._first, self._lo, self._nib, self._base, p + coded.esc_off,
                             p + coded.esc_off + 4 * coded.escapes, coded.escapes, word0)
        self.shape = (n, k)


def decode(coded: CodedBuffer, dst: torch.Tensor | None = None) -> torch.Tensor:
    """The raw bytes back (host or device `dst`, uint8 [raw_bytes]); for tests and checks."""
    dst = torch.empty(coded.raw_bytes, dtype=torch.uint8) if dst is None else dst
    stage = torch.empty(max(coded.stage_bytes, 1), dtype=torch.uint8, device=dst.device)
    for k, src, st, run in Program(coded, dst, [stage]).steps:
        st.copy_(src)
        if run is not None:
            run()
    return dst


def _make_triton_decode():
    """The fused CUDA decode (one pass: read the low bytes and nibbles, write the words), or None."""
    if os.environ.get("SLIPSTREAM_TRANSFER_TRITON", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:     # no Triton (CPU builds, some Windows setups): the tensor-op decode runs
        return None

    @triton.jit(do_not_specialize=["n", "base"])     # (one compile, whatever the chunk's length and base)
    def _kernel(lo_ptr, nib_ptr, out_ptr, n, base, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        lo = tl.load(lo_ptr + i, mask=m, other=0).to(tl.int32)
        nb = tl.load(nib_ptr + i // 2, mask=m, other=0).to(tl.int32)
        code = (nb >> ((i & 1) * 4).to(tl.int32)) & 15
        hi = ((code & 8) << 4) | ((base + (code & 7)) & 0x7F)
        word = (hi << 8) | lo
        tl.store(out_ptr + i, word.to(tl.int16), mask=m)

    def run(lo, nib, out16, n, base):
        block = 4096
        _kernel[(triton.cdiv(n, block),)](lo, nib, out16, n, base, BLOCK=block)

    return run


def _make_tight_triton():
    """The fused CUDA decode of a tight chunk (one program a block of TIGHT_BLOCK words: its words' second
    codes found by a prefix sum over the block from the block's stored start), or None."""
    if os.environ.get("SLIPSTREAM_TRANSFER_TRITON", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["n", "base", "base2"])
    def _kernel(boff_ptr, lo_ptr, sgn_ptr, c2_ptr, nib_ptr, out_ptr, n, base, base2, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        lo = tl.load(lo_ptr + i, mask=m, other=0).to(tl.int32)
        sign = (tl.load(sgn_ptr + i // 8, mask=m, other=0).to(tl.int32) >> (i % 8).to(tl.int32)) & 1
        code = (tl.load(c2_ptr + i // 4, mask=m, other=0).to(tl.int32) >> ((i % 4) * 2).to(tl.int32)) & 3
        second = (code == 3) & m
        f = second.to(tl.int32)
        pos = tl.load(boff_ptr + pid) + tl.cumsum(f, axis=0) - f
        val = (tl.load(nib_ptr + pos // 2, mask=second, other=0).to(tl.int32) >> ((pos & 1) * 4)) & 15
        top = tl.where(second, base2 + val, base + code) & 0x7F
        word = (((sign << 7) | top) << 8) | lo
        tl.store(out_ptr + i, word.to(tl.int16), mask=m)

    def run(boff, lo, sgn, c2, nib, out16, n, base, base2):
        _kernel[(triton.cdiv(n, TIGHT_BLOCK),)](boff, lo, sgn, c2, nib, out16, n, base, base2, BLOCK=TIGHT_BLOCK)

    return run


_triton_decode = None
_triton_checked = False
_tight_triton = None      # set by `warm_up` once the kernel gave a tight buffer's bytes back on this GPU


def cuda_decode_works(device: torch.device) -> bool:
    """Whether the fused CUDA decode compiles and gives the bytes back here (`warm_up`). Triton builds a small
    launcher with the system C compiler on first use, so having Triton is not enough: a machine without a
    compiler, or with a driver Triton cannot use, gets False and streams raw bytes."""
    if not triton_available():
        return False
    try:
        warm_up(device)
    except Exception as exc:  # noqa: BLE001 (any failure to build or run it: raw streaming, never a failed open)
        log.warning("transfer coding off: the CUDA decode did not run (%s)", str(exc).splitlines()[0][:200])
        return False
    return True


def warm_up(device: torch.device) -> None:
    """Compile the CUDA decode now (Triton compiles on first use, about a second, and per pointer
    alignment): decode a small buffer whose second chunk starts its nibbles unaligned, as a sub-layer's
    last chunk may."""
    if not triton_available():
        return
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(3049, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    coded = encode(raw, chunk_words=2048, tight=False)
    out = decode(coded, torch.empty(raw.numel(), dtype=torch.uint8, device=device))
    torch.cuda.synchronize(device)
    if not torch.equal(out.cpu(), raw):
        raise RuntimeError("transfer coding: the CUDA decode does not give the bytes back")
    if tight_enabled():
        _check_tight_triton(device)


def _check_tight_triton(device: torch.device) -> None:
    """Take the fused tight decode where it builds here and gives a tight buffer's bytes back (blocks and a
    last chunk of odd length, escapes, a block with no second codes), else keep the tensor-op decode."""
    global _tight_triton
    if _tight_triton is not None:
        return
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3 * TIGHT_BLOCK + 517, generator=g) * 0.02).to(torch.bfloat16)
    w[::97] = w[::97] * 1e6                               # (escapes and second codes)
    w[TIGHT_BLOCK:2 * TIGHT_BLOCK] = 0.01                 # (a block with no second code)
    raw = w.view(torch.uint8)
    coded = encode(raw, chunk_words=2 * TIGHT_BLOCK + 100, tight=True)
    if coded is None or not any(c.tight for c in coded.chunks):
        return
    try:
        kernel = _make_tight_triton()
        if kernel is None:
            return
        _tight_triton = kernel
        out = decode(coded, torch.empty(raw.numel(), dtype=torch.uint8, device=device))
        torch.cuda.synchronize(device)
        if not torch.equal(out.cpu(), raw):
            raise RuntimeError("its bytes differ")
    except Exception as exc:  # noqa: BLE001 (the tensor-op decode stays: tight coding never fails an open)
        _tight_triton = None
        log.warning("tight transfer coding: the fused CUDA decode did not run (%s); tensor operations decode",
                    str(exc).splitlines()[0][:200])


def triton_available() -> bool:
    """Whether CUDA decodes run as the fused Triton kernel (resolved on first use)."""
    global _triton_decode, _triton_checked
    if not _triton_checked:
        _triton_checked = True
        _triton_decode = _make_triton_decode() if torch.cuda.is_available() else None
    return _triton_decode is not None
