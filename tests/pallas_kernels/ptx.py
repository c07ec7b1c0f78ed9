"""A tiny emulator for the straight-line PTX the kernels inline (which runs only on a GPU)."""

import numpy as np


def run_ptx(asm: str, **inputs: int) -> dict[str, int]:
    """Run ``asm`` (``xor``/``shr``/``prmt``/``lop3``/``mov`` on .b32 registers, ``sub.f16x2``) with operands ``$1=...`` given as
    ``inputs`` (``run_ptx(asm, **{"$1": a, "$2": b})``); -> every register's final 32-bit value."""
    regs = dict(inputs)

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in asm.strip("{}\n").splitlines():
        if not line.strip() or line.startswith(".reg"):
            continue
        op, args = line.rstrip(";").split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "xor.b32":
            out = val(src[0]) ^ val(src[1])
        elif op == "mov.b32":
            out = val(src[0])
        elif op == "sub.f16x2":  # per 16-bit half: float16 a - b, rounded to nearest even
            halves = [np.array([(val(x) >> s) & 0xFFFF], np.uint16).view(np.float16) for x in src for s in (0, 16)]
            lo, hi = ((halves[i] - halves[i + 2]).view(np.uint16)[0] for i in (0, 1))
            out = int(lo) | int(hi) << 16
        elif op == "shr.b32":
            out = val(src[0]) >> val(src[1])
        elif op == "prmt.b32":  # byte i of d = byte sel[i] of {b, a} (0-3: a, 4-7: b)
            pool = val(src[0]).to_bytes(4, "little") + val(src[1]).to_bytes(4, "little")
            sel = val(src[2])
            out = int.from_bytes(bytes(pool[(sel >> (4 * i)) & 7] for i in range(4)), "little")
        elif op == "lop3.b32":  # bitwise function of (a, b, c) given by its truth table
            a, b, c, lut = (val(x) for x in src)
            out = sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i
                      for i in range(32))
        else:
            raise AssertionError(f"unexpected PTX {op}")
        regs[d] = out & 0xFFFFFFFF
    return regs


def check_word_pair_asm(asm: str, reference, byte: int) -> None:
    """Check PTX that makes one register of two 16-bit values from two int32 words ($1, $2 -> $0, ``pack=2``)
    against ``reference(words) -> 16-bit patterns`` (a jnp bit-pattern function over an int32 array): every
    value of the words' byte ``byte`` in the second word against a spread of values in the first, the other
    bytes filled with noise that must not leak in."""
    pos = 8 * byte
    byte_values = np.arange(256, dtype=np.uint32)
    for a_byte in range(0, 256, 17):
        a = (a_byte << pos) | 0x5A5A5A5A & ~(0xFF << pos)
        pair = np.stack([np.full(256, a, np.uint32), (byte_values << pos) | (0xA5A5A5A5 & ~(0xFF << pos))])
        want = np.asarray(reference(pair.view(np.int32))).view(np.uint16)
        for col in range(256):
            out = run_ptx(asm, **{"$1": int(pair[0, col]), "$2": int(pair[1, col])})["$0"]
            assert [out & 0xFFFF, out >> 16] == [int(want[0, col]), int(want[1, col])], (a_byte, col)
