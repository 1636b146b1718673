"""Derives the PCLMULQDQ folding constants of the CRC32C kernel in ``slots.c`` and checks
the folding method itself, in plain Python (polynomial arithmetic over GF(2) on ints).

Run ``python kvstore/_native/crc32c_constants.py``: it prints the C initialisers that
``slots.c`` holds (``tests/io/test_native_slots.py`` checks that they agree) after checking,
on random messages, that a model of the C code's folding gives the bitwise CRC32C.

The method is that of Intel's whitepaper "Fast CRC Computation for Generic Polynomials
Using PCLMULQDQ Instruction", in its bit-reflected form:

- CRC32C's polynomial P(x) = x^32 + 0x1EDC6F41 (bit-reflected: 0x82F63B78).  The message,
  least significant bit of each byte first, is a polynomial M(x) whose first bit is its
  highest coefficient; the raw CRC (initial register 0, no final XOR) is M(x) x^32 mod P.
- A 16-byte block loaded into an xmm register (little-endian) holds its coefficients
  reflected: register bit j is the coefficient of x^(127 - j).  Its low quadword H is the
  block's top 64 coefficients, the high quadword L the bottom 64: A = H x^64 + L.
- Moving A forward past D more bits of message keeps M(x) mod P unchanged if it is
  replaced by A x^D = H x^(D+64) + L x^D == H (x^(D+64) mod P) + L (x^D mod P): two
  64 x 32-bit carry-less products of at most 95 bits, which fit in the 128-bit block
  D bits further on and are XORed into it.
- PCLMULQDQ of two reflected 64-bit operands gives their product reflected in 127 bits,
  i.e. times x when read as a 128-bit block; a 32-bit constant reflected into the low
  32 bits of a quadword reads as k(x) x^32.  So the constant for H is x^(D+64-33) mod P
  and the one for L is x^(D-33) mod P, each bit-reflected in 32 bits.
- The raw CRC of what is left, one folded block V == M (mod P), is V x^32 mod P: the
  crc32 instruction over V's 16 bytes (no Barrett reduction needed).  A starting
  register c is XORed into the message's first four bytes beforehand (a reflected CRC's
  register and the message's first 32 bits enter the division the same way).
"""

from __future__ import annotations

import random

POLY = (1 << 32) | 0x1EDC6F41      # CRC32C, normal (non-reflected) form with the x^32 term
POLY_REFLECTED = 0x82F63B78

# Fold distances in bits: 4 lanes x 128 bits per 64-byte stride, then lane into lane.
FOLDS = {"fold_512": 512, "fold_128": 128}


def xpow_mod(n: int) -> int:
    """x^n mod P (normal form: bit i is the coefficient of x^i)."""
    r = 1
    for _ in range(n):
        r <<= 1
        if r >> 32:
            r ^= POLY
    return r


def reflect(v: int, bits: int) -> int:
    return int(f"{v:0{bits}b}"[::-1], 2)


def constants(distance: int) -> tuple[int, int]:
    """(constant for the low quadword H, constant for the high quadword L), reflected."""
    return reflect(xpow_mod(distance + 64 - 33), 32), reflect(xpow_mod(distance - 33), 32)


def clmul(a: int, b: int) -> int:
    """Carry-less product, what PCLMULQDQ computes on two quadwords."""
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        b >>= 1
    return r


def crc_bitwise(crc: int, data: bytes) -> int:
    """Raw reflected CRC32C register after data (no initial or final inversion)."""
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (POLY_REFLECTED if crc & 1 else 0)
    return crc


def fold(block: int, k: tuple[int, int]) -> int:
    """One fold of a 128-bit block: clmul(low, k_H) ^ clmul(high, k_L)."""
    mask = (1 << 64) - 1
    return clmul(block & mask, k[0]) ^ clmul(block >> 64, k[1])


def crc_folded(crc: int, data: bytes) -> int:
    """Model of slots.c's crc_pclmul for len(data) a multiple of 16, at least 64."""
    assert len(data) >= 64 and len(data) % 16 == 0
    k512, k128 = constants(FOLDS["fold_512"]), constants(FOLDS["fold_128"])
    blocks = [int.from_bytes(data[i:i + 16], "little") for i in range(0, len(data), 16)]
    lanes = blocks[:4]
    lanes[0] ^= crc
    i = 4
    while len(blocks) - i >= 4:
        lanes = [fold(lanes[j], k512) ^ blocks[i + j] for j in range(4)]
        i += 4
    x = lanes[0]
    for lane in lanes[1:] + blocks[i:]:
        x = fold(x, k128) ^ lane
    return crc_bitwise(0, x.to_bytes(16, "little"))


def main() -> None:
    rng = random.Random(1)
    for n in (64, 80, 128, 144, 256, 272, 1024 + 48):
        data = rng.randbytes(n)
        crc = rng.getrandbits(32)
        assert crc_folded(crc, data) == crc_bitwise(crc, data), n
    for name, distance in FOLDS.items():
        k_h, k_l = constants(distance)
        print(f"/* {name}: x^{distance + 31} mod P, x^{distance - 33} mod P */ "
              f"0x{k_h:08x}, 0x{k_l:08x}")


if __name__ == "__main__":
    main()
