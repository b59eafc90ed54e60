"""Coverage of one sync (pure; the receiver keeps one per sync and checks it at the end).

Every destination param must be written exactly once, element by element. Intervals are recorded per piece and
merged at the end, so a dropped piece shows up as a gap and a duplicated piece as an overlap, each reported with
the param's name and the element range. The bytes themselves are compared by colo.sync.checksum.
"""
from __future__ import annotations


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
