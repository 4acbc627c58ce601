"""Derives the folding constants of csrc/crc32.c and checks the folding scheme in pure Python.

CRC-32 (zlib's, polynomial 0x104C11DB7) is bit-reflected: in a 16-byte lane loaded little-endian,
integer bit i holds the coefficient of x^(127-i). Folding a lane X forward by D bytes splits it
into its low 64 bits L (degrees 127..64) and high 64 bits H (degrees 63..0) and uses
X * x^(8D) = refl(L) * x^(8D+64) + refl(H) * x^(8D) (mod P). A carry-less product of two
reflected 64-bit values comes out one degree short, so each constant carries x^-1:
    k_low(D) = refl64(x^(8D+63) mod P),  k_high(D) = refl64(x^(8D-1) mod P).
Run ``python tools/crc32_constants.py`` to print them; tests/test_crc32.py checks that the C
source holds these values and that the Python model of the folding equals zlib.
"""

from __future__ import annotations

import os
import zlib

POLY = 0x104C11DB7  # x^32 + x^26 + ... + 1, bit d = coefficient of x^d
FOLD_BYTES = (16, 64, 256)  # one 128-bit lane, one 512-bit block, four 512-bit registers


def xpow_mod(e: int) -> int:
    """x^e mod P, bit d = coefficient of x^d."""
    r = 1
    for _ in range(e):
        r <<= 1
        if r >> 32:
            r ^= POLY
    return r


def refl(v: int, bits: int) -> int:
    return int(f"{v:0{bits}b}"[::-1], 2)


def fold_constants(distance: int) -> tuple[int, int]:
    """(k_low, k_high) that fold a 16-byte lane forward by ``distance`` bytes."""
    return refl(xpow_mod(8 * distance + 63), 64), refl(xpow_mod(8 * distance - 1), 64)


def clmul(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        b >>= 1
    return r


def fold(lane: int, distance: int) -> int:
    k_low, k_high = fold_constants(distance)
    low, high = lane & (2**64 - 1), lane >> 64
    return clmul(low, k_low) ^ clmul(high, k_high)


def model_crc32(data: bytes, value: int = 0) -> int:
    """The 16-byte folding of csrc/crc32.c in Python (lengths >= 16), finished by zlib."""
    lane = int.from_bytes(data[:16], "little") ^ (~value & 0xFFFFFFFF)
    pos = 16
    while len(data) - pos >= 16:
        lane = fold(lane, 16) ^ int.from_bytes(data[pos : pos + 16], "little")
        pos += 16
    # The folded lane stands for everything before `pos`: its raw CRC (zero start, no
    # inversions) is the CRC register there. zlib.crc32(b, v) runs the register from ~v and
    # returns its complement, hence the ~ on both sides.
    register = ~zlib.crc32(lane.to_bytes(16, "little"), 0xFFFFFFFF) & 0xFFFFFFFF
    return zlib.crc32(data[pos:], ~register & 0xFFFFFFFF)


def main() -> None:
    for distance in FOLD_BYTES:
        k_low, k_high = fold_constants(distance)
        print(f"fold {distance:4d} bytes: k_low=0x{k_low:016x} k_high=0x{k_high:016x}")
    for n in (16, 17, 31, 64, 100, 1000):
        data = os.urandom(n)
        assert model_crc32(data, 12345) == zlib.crc32(data, 12345), n
    print("model equals zlib.crc32")


if __name__ == "__main__":
    main()
