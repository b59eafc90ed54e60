"""The sync's exact checksum (colo.sync.checksum): what it sees, that pieces add up to the whole, and that the CUDA
kernel computes the same integers as the torch path (run here by Triton's interpreter on CPU tensors).

    .venv/bin/python -m pytest tests/unit/test_sync_checksum.py -q
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from colo.sync.checksum import MASK, CopySums, checksum, combine, compare

ROOT = Path(__file__).resolve().parents[2]


def _bf16(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_pieces_in_any_order_add_up_to_the_whole() -> None:
    t = _bf16(1000)
    whole = checksum(t)
    assert 0 <= whole <= MASK
    assert combine(checksum(t[300:], 300), checksum(t[:300], 0)) == whole
    assert combine(checksum(t[301:], 301), checksum(t[:301], 0)) == whole  # a split inside a 32-bit word
    e = torch.randn(1003).to(torch.float8_e4m3fn)  # 1-byte elements: splits at every place in a word
    assert {combine(checksum(e[:k], 0), checksum(e[k:k + 5], k), checksum(e[k + 5:], k + 5))
            for k in range(1, 9)} == {checksum(e)}
    sums = CopySums("cpu")
    for a, b in ((700, 1000), (0, 300), (300, 700)):  # the receiver sees buckets in any order
        sums.add(t[a:b], "x", a)
    assert compare({"x": whole}, sums.totals()) == []


def test_a_tensor_sums_as_its_bytes_read_as_32_bit_words() -> None:
    """The definition (module doc): the destination's bytes as little-endian words, whatever the element type."""
    t = _bf16(1000)
    assert checksum(t) == checksum(t.view(torch.int32)) == checksum(t.view(torch.float32))
    assert checksum(t[:998], 0) == checksum(t[:998].view(torch.int32), 0)
    assert checksum(t[2:], 2) == checksum(t[2:].view(torch.int32), 1)  # element 2 of bf16 is word 1
    assert checksum(t.view(torch.int64)) == checksum(t)  # 8-byte elements: two words each
    assert checksum(t[:999]) == checksum(torch.cat([t[:999], t.new_zeros(1)]))  # a partial last word, zero-padded
    odd = t[1:]  # a piece whose start is not 4-byte aligned in its storage
    assert checksum(odd, 1) == checksum(odd.clone(), 1) and checksum(odd, 1) != checksum(odd, 0)


def test_every_single_changed_element_is_seen() -> None:
    """One element's bit pattern changed in any bit, at any position: always a different checksum (the weight of a
    word is odd, and the change, shifted into its word, is nonzero below 2^32)."""
    t = _bf16(257)
    whole = checksum(t)
    bits = t.view(torch.int16)
    for pos in (0, 1, 100, 256):
        for bit in range(16):
            bad = bits.clone()
            bad[pos] ^= (1 << bit) if bit < 15 else -(1 << 15)
            assert checksum(bad.view(torch.bfloat16)) != whole, (pos, bit)
    f = torch.randn(64)
    for bit in range(32):  # float32 too, including the sign bit
        bad = f.view(torch.int32).clone()
        bad[5] ^= (1 << bit) if bit < 31 else -(1 << 31)
        assert checksum(bad.view(torch.float32)) != checksum(f), bit
    e = torch.randn(64).to(torch.float8_e4m3fn)
    for pos in range(4):  # each place in a word, every bit of a byte
        for bit in range(8):
            bad = e.view(torch.uint8).clone()
            bad[8 + pos] ^= 1 << bit
            assert checksum(bad.view(torch.float8_e4m3fn)) != checksum(e), (pos, bit)
    pair = _bf16(2).view(torch.int16)  # two elements of one word swapped
    assert checksum(pair.flip(0)) != checksum(pair) or pair[0] == pair[1]


def test_rows_in_the_wrong_place_are_seen() -> None:
    """The same values at other positions: swapped rows, rows shifted by one, a piece written at the wrong offset."""
    t = _bf16(64 * 32).view(64, 32)
    whole = checksum(t)
    assert checksum(t[torch.tensor([1, 0] + list(range(2, 64)))]) != whole  # two rows swapped
    assert checksum(torch.roll(t, 1, 0)) != whole
    assert checksum(t[:32], 0) != checksum(t[:32], 32 * 32)  # the same bytes at another offset
    same = t.clone()
    same[[3, 9]] = 0.0
    assert checksum(same) != whole


def test_every_dtype_the_sync_carries() -> None:
    g = torch.Generator().manual_seed(1)
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64):
        x = torch.randn(333, generator=g).to(dt) if dt != torch.int64 else torch.randint(-2**62, 2**62, (333,),
                                                                                          generator=g)
        y = x.clone()
        y.view(torch.uint8)[7] ^= 1
        assert checksum(x) == checksum(x.clone()) and checksum(x) != checksum(y), dt
    assert checksum(torch.zeros(100, dtype=torch.bfloat16)) == 0  # the vocabulary fill's zeros count 0


def test_copy_sums_copies_and_sums_what_it_wrote() -> None:
    src = torch.randn(500)
    dst = torch.zeros(800, dtype=torch.bfloat16)
    sums = CopySums("cpu")
    sums.copy(dst[100:600], src, "w", 100)
    sums.note("pad")
    got = sums.totals()
    assert torch.equal(dst[100:600], src.to(torch.bfloat16))
    assert got == {"w": checksum(src.to(torch.bfloat16), 100), "pad": 0}
    assert compare(got, {"w": got["w"] ^ 1, "pad": 0}) == [f"w: bytes differ (checksum sent {got['w']:#010x}, "
                                                          f"written {got['w'] ^ 1:#010x})"]
    assert compare(got, {"w": got["w"]}) == ["pad: checksum only on the sender side"]


KERNEL = textwrap.dedent("""
    import torch
    from colo.sync import checksum as C, checksum_cuda as K

    def vectorizable(*ts):  # launch()'s test of VEC's contract, on tensors
        return K._aligned(ts[0].numel(), max(t.element_size() for t in ts), *(t.data_ptr() for t in ts))

    g = torch.Generator().manual_seed(0)
    src = torch.randn(5000, generator=g).to(torch.bfloat16)
    buf = torch.zeros(6000, dtype=torch.bfloat16)
    sums = torch.zeros(4, dtype=torch.int64)
    # a vectorized group (16-byte starts) and an unaligned one, several pieces per launch, two destinations
    K.launch([(buf[8:1008], src[0:1000], 0, 1), (buf[1016:5016], src[1000:5000], 1000, 1),
              (buf[5017:5021], src[3:7], 7, 2)], sums)
    assert vectorizable(buf[8:1008], src[0:1000]) and not vectorizable(buf[5017:5021], src[3:7])
    assert torch.equal(buf[8:1008], src[:1000]) and torch.equal(buf[1016:5016], src[1000:])
    assert torch.equal(buf[5017:5021], src[3:7])
    assert int(sums[1]) & C.MASK == C.checksum(src, 0)
    assert int(sums[2]) & C.MASK == C.checksum(src[3:7], 7)
    # a flush's mix: copies and pieces summed where they lie (no source), aligned or not, groups in one table
    tot = torch.zeros(3, dtype=torch.int64)
    K.launch([(buf[8:1008], None, 0, 0), (buf[1016:5016], src[1000:5000], 1000, 0), (buf[5017:5021], None, 7, 1),
              (buf[5024:5056], src[100:132].float(), 2, 2)], tot)
    assert torch.equal(buf[1016:5016], src[1000:]) and torch.equal(buf[5024:5056], src[100:132])
    assert int(tot[0]) & C.MASK == C.checksum(src, 0)
    assert int(tot[1]) & C.MASK == C.checksum(src[3:7], 7)
    assert int(tot[2]) & C.MASK == C.checksum(src[100:132], 2)
    for dt, n in ((torch.float32, 3001), (torch.float8_e4m3fn, 3001), (torch.bfloat16, 20_000)):
        x = torch.randn(n, generator=g).to(dt)  # 20,000: more whole blocks than programs, then a partial one
        out, s = torch.zeros(n, dtype=dt), torch.zeros(1, dtype=torch.int64)
        vec = vectorizable(out, x)  # VEC's contract: 16-byte starts, whole vectors (3,001 elements are not)
        assert vec == (n % (16 // x.element_size()) == 0), dt
        for pos in (11, 12):  # a start inside a word (a term per element) and on one (per word, a partial last)
            s.zero_()
            K.launch([(out, x, pos, 0)], s)
            assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), dt
            assert int(s[0]) & C.MASK == C.checksum(x, pos), (dt, pos)
            s.zero_()
            K.launch([(x, None, pos, 0)], s)
            assert int(s[0]) & C.MASK == C.checksum(x, pos), (dt, pos, "summed where it lies")
    print("kernel ok")
""")


def test_the_cuda_kernel_computes_the_torch_checksum() -> None:
    """colo.sync.checksum's Triton kernel, run by Triton's CPU interpreter (TRITON_INTERPRET=1, set before Triton is
    imported: a process of its own): the copies are exact and the sums equal the torch path's for bf16, float32 and
    e4m3 pieces, batched and unaligned, starting on a word or inside one, copied or summed where they lie. Casts
    inside the kernel (float32 -> bf16) need a GPU's rounding:
    tests/gpu/test_checksum_gpu.py."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", KERNEL], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "kernel ok" in p.stdout, p.stderr[-3000:]


AUTO_FLUSH = textwrap.dedent("""
    import torch
    from colo.sync import checksum as C

    C.FLUSH_BYTES = 4096  # destination bytes; the pieces below are ~2 KB of bf16
    launches = []
    launch = C._launch
    C._launch = lambda pending, sums: (launches.append(len(pending)), launch(pending, sums))
    g = torch.Generator().manual_seed(0)
    src = torch.randn(5000, generator=g).to(torch.bfloat16)
    vals = torch.randn(80, generator=g).to(torch.bfloat16)
    dst = torch.zeros(5000, dtype=torch.bfloat16)
    sums = C.CopySums("cpu")
    sums.fused = True  # the CUDA path's batching, its kernel run by Triton's interpreter
    sums.copy(dst[:1000], src[:1000], "w", 0)
    sums.copy(dst[1000:2000], src[1000:2000].float(), "w", 1000)  # float32 source: counted in the bf16 bytes written
    assert len(sums.pending) == 2 and sums.pending_bytes == 4000 and launches == []
    assert int(torch.count_nonzero(dst)) == 0  # below the threshold nothing has run yet
    sums.copy(dst[2000:3001], src[2000:3001], "w", 2000)  # 6,002 bytes pending: launched on its own
    assert sums.pending == [] and sums.pending_bytes == 0 and launches == [3]
    assert torch.equal(dst[:3001], src[:3001])  # written before any explicit flush
    sums.copy(dst[3001:], src[3001:], "w", 3001)  # 3,998 bytes, starting inside a word: waits
    assert len(sums.pending) == 1 and int(torch.count_nonzero(dst[3001:])) == 0 and launches == [3]
    sums.add(vals[:50], "v", 5)  # summed where it lies; 4,098 bytes with the copy: both in one launch
    assert sums.pending == [] and sums.pending_bytes == 0 and launches == [3, 2]
    sums.add(vals[50:], "v", 55)
    assert len(sums.pending) == 1 and sums.pending_bytes == 60
    sums.flush()  # the caller's flush at a bucket's end still runs what is left
    assert sums.pending == [] and sums.pending_bytes == 0 and launches == [3, 2, 1]
    assert torch.equal(dst, src)
    got = sums.totals()
    assert got == {"w": C.checksum(dst), "v": C.checksum(vals, 5)}, got
    assert launches == [3, 2, 1]  # nothing left for totals() to launch
    cpu = C.CopySums("cpu")  # the CPU path: no batching, the same totals
    out = torch.zeros(5000, dtype=torch.bfloat16)
    for a, b in ((0, 1000), (1000, 3001), (3001, 5000)):
        cpu.copy(out[a:b], src[a:b], "w", a)
    cpu.add(vals, "v", 5)
    assert cpu.pending == [] and cpu.pending_bytes == 0 and torch.equal(out, src) and cpu.totals() == got
    print("auto flush ok")
""")


def test_copy_sums_flushes_on_its_own_past_flush_bytes() -> None:
    """The fused path (forced on CPU, its kernel in Triton's interpreter: a process of its own, as above) launches its
    batch once the pending pieces hold FLUSH_BYTES of destination bytes, so a bucket's GPU work overlaps the host's
    work on its later pieces; the copies are exact and the totals those of what was written, as with one flush."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", AUTO_FLUSH], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "auto flush ok" in p.stdout, p.stderr[-3000:]
