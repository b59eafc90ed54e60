"""The sync's content check: an exact integer checksum of every tensor's bytes, in its destination's coordinates.

    sums = CopySums(device)                                 # one per sync and side
    sums.copy(dst, src, "model.norm.weight", dst_offset)   # dst.copy_(src), and its checksum into that name's total
    sums.add(values, "model.norm.weight", dst_offset)       # the checksum alone (values already where they go)
    sums.device_total("w13_weight")                         # CUDA: (totals, slot) for a kernel that adds its own
    sums.totals()                                           # {name: int}: one read from the device, at the end

Per tensor: sum over its elements of  bits(x_i) * w(i)  mod 2^64, where bits(x_i) is the element's raw bit pattern
(its integer view, sign-extended to 32 bits; 8-byte elements fold their two halves), w(i) a mixed, odd 32-bit
weight of the element's index i in the destination tensor, and the product taken mod 2^32. Why this form:
- exact: integers, no float tolerance; a sum mod 2^64 does not depend on the order pieces arrive in, so the
  sender (per piece, while packing) and the receiver (per piece, as it writes) agree bit for bit;
- any single changed element changes the total (w(i) is odd, so bits * w(i) mod 2^32 is never 0 for a nonzero
  change), and rows written at the wrong place do too (w depends on i, through a multiply-xorshift mix, so a
  swap or a shift is not a permutation of the same terms);
- cheap: a few 32-bit integer operations per element, no float64 temporaries.

On CUDA the copy and the checksum are one Triton kernel (colo.sync.checksum_cuda): the bytes are read once, as the
copy reads them anyway, and the pieces of one batch (a bucket's run from one source group) go in one launch from a
small table, so a sync of hundreds of pieces costs a few dozen launches. On CPU plain torch: the copy, then the checksum
of what was written. Both compute the same integers (tests/unit/test_sync_checksum.py; tests/gpu/test_checksum_gpu.py
on CUDA).
"""
from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
M32 = 0xFFFFFFFF
K1, K2 = 0x9E3779B1, 0x85EBCA77  # odd multipliers of the index mix (golden ratio, murmur3's fmix32)
CHUNK = 1 << 22  # elements per torch step: int64 temporaries of a 3 GB expert tensor at once would need ~25 GB
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def position_weights(start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """w(i) for i in [start, start + n): (n,) int64 holding odd 32-bit values."""
    h = (torch.arange(start, start + n, device=device, dtype=torch.int64) & M32) * K1 & M32
    h = h ^ (h >> 15)
    return (h * K2 & M32) | 1


def _bits32(x: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern as a 32-bit value (int64 holding [0, 2^32)): sign-extended below 4 bytes, the
    two halves xor-ed for 8-byte elements."""
    b = x.view(_INT[x.element_size()]).to(torch.int64)
    if x.element_size() == 8:
        b = b ^ (b >> 32)
    return b & M32


_CACHED: dict[torch.device, torch.Tensor] = {}  # device -> w(i) for i < CHUNK as int32 (the same 32 bits)


def _weights32(start: int, n: int, device: torch.device) -> torch.Tensor:
    """w(i), i in [start, start + n), as int32 (its 32 bits): from a cache of the first CHUNK positions, which most
    destinations' pieces fall in, else computed."""
    if start + n > CHUNK:
        return position_weights(start, n, device).to(torch.int32)  # int64 -> int32 keeps the low 32 bits
    if device not in _CACHED:
        _CACHED[device] = position_weights(0, CHUNK, device).to(torch.int32)
    return _CACHED[device][start: start + n]


def checksum(values: torch.Tensor, dst_offset: int = 0) -> int:
    """The checksum of `values` (any shape, read flat) written at element `dst_offset` of its destination.

    In int32: bits * w wraps mod 2^32 as the module doc's product does, and the products are summed read as uint32
    (measured on CPU: 3x faster than the int64 formula)."""
    v = values.reshape(-1)
    total = 0
    for i in range(0, v.numel(), CHUNK):
        c = v[i: i + CHUNK]
        if c.element_size() == 8:
            total += int(((_bits32(c) * position_weights(dst_offset + i, c.numel(), c.device)) & M32).sum())
            continue
        p = c.view(_INT[c.element_size()]).to(torch.int32) * _weights32(dst_offset + i, c.numel(), c.device)
        total += int(p.view(torch.uint32).to(torch.int64).sum())
    return total & MASK64


def combine(*parts: int) -> int:
    """The checksum of a tensor from its pieces' checksums."""
    return sum(parts) & MASK64


class CopySums:
    """Per-destination checksum totals of one side of one sync. On CUDA (with Triton) copies and sums are batched
    until flush(); a caller must flush before the sources or the summed values may change, or the destinations are
    read by someone else."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.slots: dict[str, int] = {}
        self.host: dict[str, int] = {}  # CPU path: totals as Python ints
        self.fused = self.device.type == "cuda" and _triton_available()
        self.sums = torch.zeros(0, dtype=torch.int64, device=self.device)  # (slots,) CUDA path
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None, int, int]] = []  # (dst, src, dst_offset, slot)

    def _slot(self, name: str) -> int:
        slot = self.slots.setdefault(name, len(self.slots))
        if self.fused and slot >= self.sums.numel():  # grow by doubling: slots are few (one per parameter)
            grown = torch.zeros(max(64, 2 * self.sums.numel()), dtype=torch.int64, device=self.device)
            grown[: self.sums.numel()] = self.sums
            self.sums = grown
        return slot

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, dst_offset: int) -> None:
        """dst (1-D, contiguous) := src cast to dst's dtype; its checksum goes into `name`'s total."""
        slot = self._slot(name)
        if self.fused and dst.is_contiguous() and src.is_contiguous() and dst.element_size() in (1, 2, 4) \
                and src.element_size() in (1, 2, 4):
            self.pending.append((dst, src.reshape(-1), int(dst_offset), slot))
            return
        dst.copy_(src)
        self.add(dst, name, dst_offset)

    def add(self, values: torch.Tensor, name: str, dst_offset: int) -> None:
        """The checksum of `values` (already at their destination, or packed as they will be written)."""
        slot = self._slot(name)
        if self.fused and values.is_contiguous() and values.element_size() in (1, 2, 4):
            self.pending.append((values.reshape(-1), None, int(dst_offset), slot))  # summed in place at flush()
            return
        self.host[name] = combine(self.host.get(name, 0), checksum(values, dst_offset))

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

    def totals(self) -> dict[str, int]:
        self.flush()
        if not self.fused:
            return {n: self.host.get(n, 0) for n in self.slots}
        got = self.sums[: len(self.slots)].tolist()  # the one device -> host read of the sync
        return {n: (got[s] + self.host.get(n, 0)) & MASK64 for n, s in self.slots.items()}


def compare(sent: dict[str, int], received: dict[str, int]) -> list[str]:
    """One line per destination whose checksums differ or that only one side has."""
    errors = []
    for name in sorted(set(sent) | set(received)):
        a, b = sent.get(name), received.get(name)
        if a is None or b is None:
            errors.append(f"{name}: checksum only on the {'receiver' if a is None else 'sender'} side")
        elif a & MASK64 != b & MASK64:
            errors.append(f"{name}: bytes differ (checksum sent {a & MASK64:#018x}, written {b & MASK64:#018x})")
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
