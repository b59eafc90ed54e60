"""Coverage and digest checks for one sync (pure functions; the receiver and sender both use them).

Coverage: every destination param must be written exactly once, element by element. Intervals are
recorded per piece and merged at the end, so a dropped piece shows up as a gap and a duplicated piece
as an overlap, each reported with the param's name and the element range.

Digest: one float64 per tensor, sum(x_i * w_i) with w_i a fixed pseudo-random weight of the element's
index in the destination, so it catches wrong values and also rows landing in the wrong place (a plain
sum would not see swapped experts). The sender sums per piece, the receiver per tensor; the two differ
only by float64 summation order, far below any real difference (one bf16 ulp moves it by ~1e-3 relative
to a single element, compared with a 1e-9 relative tolerance on the total).
"""
from __future__ import annotations

import torch

DIGEST_RTOL = 1e-9


def _weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(start, start + n, device=device, dtype=torch.int64)
    return 1.0 + ((idx * 2654435761) % 1024).to(torch.float64) / 1024.0  # (n,) in [1, 2)


CHUNK = 1 << 24  # elements per step: float64 temporaries of a whole 3 GB expert tensor would need ~10 GB


def piece_digest(values: torch.Tensor, dst_offset: int) -> float:
    """Digest contribution of `values` (1-D) written at element `dst_offset` of its destination."""
    v = values.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=v.device)
    for i in range(0, v.numel(), CHUNK):
        c = v[i: i + CHUNK]
        total += (c.to(torch.float64) * _weights(dst_offset + i, c.numel(), v.device)).sum()
    return float(total)


def tensor_digest(t: torch.Tensor) -> float:
    return piece_digest(t.reshape(-1), 0)


def compare_digests(sent: dict[str, float], received: dict[str, float]) -> list[str]:
    errors = []
    for name in sorted(set(sent) | set(received)):
        a, b = sent.get(name), received.get(name)
        if a is None or b is None:
            errors.append(f"{name}: digest only on the {'receiver' if a is None else 'sender'} side")
        elif abs(a - b) > DIGEST_RTOL * max(1.0, abs(a), abs(b)):
            errors.append(f"{name}: digest sent {a!r} != received {b!r}")
    return errors


class Coverage:
    """Element intervals written per destination during one sync."""

    def __init__(self, expect: dict[str, int] | None) -> None:
        self.expect = dict(expect) if expect is not None else None
        self.runs: dict[str, list[tuple[int, int]]] = {}
        self.tensors = 0
        self.bytes = 0

    def add(self, dst: str, offset: int, numel: int, nbytes: int) -> None:
        self.runs.setdefault(dst, []).append((int(offset), int(offset) + int(numel)))
        self.tensors += 1
        self.bytes += int(nbytes)

    def errors(self, sizes: dict[str, int]) -> list[str]:
        """Problems against `sizes` (every param this side holds -> numel) and the sender's expect."""
        errs: list[str] = []
        if self.expect is not None:
            for n in sorted(set(self.expect) ^ set(sizes)):
                side = "sender expects" if n in self.expect else "engine holds"
                errs.append(f"{n}: {side} it but the other side does not")
            for n in sorted(set(self.expect) & set(sizes)):
                if self.expect[n] != sizes[n]:
                    errs.append(f"{n}: sender expects {self.expect[n]} elements, engine holds {sizes[n]}")
        for n in sorted(set(self.runs) - set(sizes)):
            errs.append(f"{n}: written but the engine has no such param")
        for n in sorted(sizes):
            runs = sorted(self.runs.get(n, []))
            if not runs:
                errs.append(f"{n}: never written")
                continue
            pos = 0
            for a, b in runs:
                if a > pos:
                    errs.append(f"{n}: elements [{pos}, {a}) never written")
                elif a < pos:
                    errs.append(f"{n}: elements [{a}, {min(b, pos)}) written twice")
                pos = max(pos, b)
            if pos < sizes[n]:
                errs.append(f"{n}: elements [{pos}, {sizes[n]}) never written")
            elif pos > sizes[n]:
                errs.append(f"{n}: written past its end ({pos} > {sizes[n]} elements)")
        return errs
