"""The sync's content check: an exact integer checksum of every tensor's bytes, in its destination's coordinates.

    sums = CopySums(device)                                 # one per sync and side
    sums.copy(dst, src, "model.norm.weight", dst_offset)   # dst.copy_(src), and its checksum into that name's total
    sums.add(values, "model.norm.weight", dst_offset)       # the checksum alone (values already where they go)
    sums.device_total("w13_weight")                         # CUDA: (totals, slot) for a kernel that adds its own
    sums.totals()                                           # {name: int}: one read from the device, at the end

Per tensor: its bytes in the destination's order, read as little-endian 32-bit words (a last partial word padded
with zeros), and the sum over words j of  word_j * w(j)  mod 2^32, w(j) a mixed, odd 32-bit weight of the word's
index. Element by element, for an element i of s <= 4 bytes: (its bits, zero-extended) << 8 * (i*s mod 4), times
w(floor(i*s / 4)); an 8-byte element is two words, its low half first. Why this form:
- exact: integers, no float tolerance; a sum mod 2^32 does not depend on the order pieces arrive in, and a piece
  may start or end inside a word (its elements' terms add up to the word's), so the sender (per piece, while
  packing) and the receiver (per piece, as it writes) agree bit for bit;
- any single changed element changes the total (its change, shifted into its word, is a nonzero value below 2^32,
  and w(j) is odd, so the product is nonzero mod 2^32), and rows written at the wrong place do too (w depends on j,
  through a multiply-xorshift mix, so a swap or a shift is not a permutation of the same terms); several changes
  cancel with odds of about 2^-32 per tensor;
- cheap: one mix per word, not per element: on CUDA the mix is the kernel's arithmetic beside the copy (about ten
  integer operations), and a word holds 2 bf16 or 4 e4m3 elements.

On CUDA the copy and the checksum are one Triton kernel (colo.sync.checksum_cuda): the bytes are read once, as the
copy reads them anyway, and the pieces of one batch (a bucket's run from one source group) go in one launch from a
small table (a batch also launches on its own past FLUSH_BYTES), so a sync of hundreds of pieces costs a few dozen
launches. On CPU plain torch: the copy, then the checksum of what was written. Both compute the same integers
(tests/unit/test_sync_checksum.py; tests/gpu/test_checksum_gpu.py on CUDA).
"""
from __future__ import annotations

import torch

MASK = 0xFFFFFFFF  # totals are mod 2^32
K1, K2 = 0x9E3779B1, 0x85EBCA77  # odd multipliers of the index mix (golden ratio, murmur3's fmix32)
CHUNK = 1 << 22  # words per torch step: int64 temporaries of a 3 GB expert tensor at once would need ~25 GB
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# CopySums (CUDA) flushes on its own once its pending pieces hold this many destination bytes: the GPU starts on a
# bucket's first pieces while the host prepares the rest (~1 ms of host work per 1 GB bucket otherwise left the GPU
# idle). Each launch costs the host a table and a Triton launch, so batches stay large: a few launches per bucket.
FLUSH_BYTES = 256 << 20


def mix(j: torch.Tensor) -> torch.Tensor:
    """w(j) for int64 word indices j: odd 32-bit values, as int64."""
    h = (j & MASK) * K1 & MASK
    h = h ^ (h >> 15)
    return (h * K2 & MASK) | 1


def position_weights(start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """w(j) for words j in [start, start + n): (n,) int64 holding odd 32-bit values."""
    return mix(torch.arange(start, start + n, device=device, dtype=torch.int64))


_CACHED: dict[torch.device, torch.Tensor] = {}  # device -> w(j) for j < CHUNK as int32 (the same 32 bits)


def _weights32(start: int, n: int, device: torch.device) -> torch.Tensor:
    """w(j), j in [start, start + n), as int32 (its 32 bits): from a cache of the first CHUNK words, which most
    destinations' pieces fall in, else computed."""
    if start + n > CHUNK:
        return position_weights(start, n, device).to(torch.int32)  # int64 -> int32 keeps the low 32 bits
    if device not in _CACHED:
        _CACHED[device] = position_weights(0, CHUNK, device).to(torch.int32)
    return _CACHED[device][start: start + n]


def _words(words: torch.Tensor, first: int) -> int:
    """Sum of word_j * w(j) mod 2^32 over int32 words at word indices first, first + 1, ...: the products in int32
    wrap mod 2^32 as the definition's do, summed read as uint32 (on CPU 3x faster than int64 arithmetic)."""
    total = 0
    for i in range(0, words.numel(), CHUNK):
        c = words[i: i + CHUNK]
        p = c * _weights32(first + i, c.numel(), c.device)
        total += int(p.view(torch.uint32).to(torch.int64).sum())
    return total & MASK


def _elementwise(v: torch.Tensor, offset: int) -> int:
    """The per-element form, for elements at destination indices offset, offset + 1, ... (s <= 4 bytes)."""
    s = v.element_size()
    total = 0
    for i in range(0, v.numel(), CHUNK):
        c = v[i: i + CHUNK]
        bits = c.view(_INT[s]).to(torch.int64) & ((1 << 8 * s) - 1)
        byte = (torch.arange(c.numel(), device=c.device, dtype=torch.int64) + offset + i) * s
        total += int((((bits << (byte & 3) * 8) & MASK) * mix(byte >> 2) & MASK).sum())
    return total & MASK


def checksum(values: torch.Tensor, dst_offset: int = 0) -> int:
    """The checksum of `values` (any shape, read flat) written at element `dst_offset` of its destination: the
    elements before its first whole word and after its last one term by term, the words between as int32 words."""
    v = values.reshape(-1)
    if v.element_size() == 8:  # two words per element, the low half first (little-endian)
        v, dst_offset = v.view(torch.int32), 2 * dst_offset
    r = 4 // v.element_size()
    head = min(v.numel(), -dst_offset % r)
    body = (v.numel() - head) // r * r
    total = _elementwise(v[:head], dst_offset) + _elementwise(v[head + body:], dst_offset + head + body)
    if body:
        b = v[head: head + body]
        if b.element_size() != 4 and b.storage_offset() * b.element_size() % 4:
            b = b.clone()  # view(int32) needs a 4-byte-aligned start in its storage
        total += _words(b.view(torch.int32), (dst_offset + head) // r)
    return total & MASK


def combine(*parts: int) -> int:
    """The checksum of a tensor from its pieces' checksums."""
    return sum(parts) & MASK


class CopySums:
    """Per-destination checksum totals of one side of one sync. On CUDA (with Triton) copies and sums are batched
    until flush(), and flush on their own once the batch holds FLUSH_BYTES of destination bytes; a caller must still
    flush before the sources or the summed values may change, or the destinations are read by someone else."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.slots: dict[str, int] = {}
        self.host: dict[str, int] = {}  # CPU path: totals as Python ints
        self.fused = self.device.type == "cuda" and _triton_available()
        self.sums = torch.zeros(0, dtype=torch.int64, device=self.device)  # (slots,) CUDA path
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None, int, int]] = []  # (dst, src, dst_offset, slot)
        self.pending_bytes = 0  # destination bytes of `pending`: past FLUSH_BYTES it flushes on its own

    def _slot(self, name: str) -> int:
        slot = self.slots.get(name)
        if slot is not None:
            return slot
        slot = self.slots[name] = len(self.slots)
        if self.fused and slot >= self.sums.numel():  # grow by doubling: slots are few (one per parameter)
            grown = torch.zeros(max(64, 2 * self.sums.numel()), dtype=torch.int64, device=self.device)
            grown[: self.sums.numel()] = self.sums
            self.sums = grown
        return slot

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, dst_offset: int) -> None:
        """dst (1-D, contiguous) := src cast to dst's dtype; its checksum goes into `name`'s total."""
        slot = self._slot(name)
        if self.fused and dst.is_contiguous() and src.is_contiguous() and dst.dtype.itemsize in (1, 2, 4) \
                and src.dtype.itemsize in (1, 2, 4):
            self.pending.append((dst, src if src.dim() == 1 else src.reshape(-1), int(dst_offset), slot))
            self._pending(dst)
            return
        dst.copy_(src)
        self.add(dst, name, dst_offset)

    def add(self, values: torch.Tensor, name: str, dst_offset: int) -> None:
        """The checksum of `values` (already at their destination, or packed as they will be written)."""
        slot = self._slot(name)
        if self.fused and values.is_contiguous() and values.element_size() in (1, 2, 4):
            self.pending.append((values.reshape(-1), None, int(dst_offset), slot))  # summed in place at flush()
            self._pending(values)
            return
        self.host[name] = combine(self.host.get(name, 0), checksum(values, dst_offset))

    def _pending(self, dst: torch.Tensor) -> None:
        """Count a batched piece's destination bytes; past FLUSH_BYTES launch the batch now (the GPU starts on it)."""
        self.pending_bytes += dst.numel() * dst.dtype.itemsize
        if self.pending_bytes >= FLUSH_BYTES:
            self.flush()

    def device_total(self, name: str) -> tuple[torch.Tensor, int]:
        """(the device tensor of totals, `name`'s slot in it), for a kernel that adds its own terms
        (colo.sync.fp8_pack); CUDA with Triton only. The tensor may be regrown by a later name: take it per launch."""
        if not self.fused:
            raise RuntimeError("CopySums.device_total: the totals live on the host here (no CUDA with Triton)")
        slot = self._slot(name)
        return self.sums, slot

    def note(self, name: str) -> None:
        """A destination whose pieces carry no bytes (vocabulary fill): total 0, present on both sides."""
        self._slot(name)
        self.host.setdefault(name, 0)

    def flush(self) -> None:
        """Run the batched copies (CUDA): every pending destination holds its bytes afterwards (stream order)."""
        if self.pending:
            _launch(self.pending, self.sums)
            self.pending = []
        self.pending_bytes = 0

    def totals(self) -> dict[str, int]:
        self.flush()
        if not self.fused:
            return {n: self.host.get(n, 0) for n in self.slots}
        got = self.sums[: len(self.slots)].tolist()  # the one device -> host read of the sync
        return {n: (got[s] + self.host.get(n, 0)) & MASK for n, s in self.slots.items()}


def compare(sent: dict[str, int], received: dict[str, int]) -> list[str]:
    """One line per destination whose checksums differ or that only one side has."""
    errors = []
    for name in sorted(set(sent) | set(received)):
        a, b = sent.get(name), received.get(name)
        if a is None or b is None:
            errors.append(f"{name}: checksum only on the {'receiver' if a is None else 'sender'} side")
        elif a & MASK != b & MASK:
            errors.append(f"{name}: bytes differ (checksum sent {a & MASK:#010x}, written {b & MASK:#010x})")
    return errors


# ------------------------------------------------------------------------------------------- CUDA: Triton


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _launch(pending: list[tuple[torch.Tensor, torch.Tensor | None, int, int]], sums: torch.Tensor) -> None:
    from colo.sync.checksum_cuda import launch
    launch(pending, sums)
