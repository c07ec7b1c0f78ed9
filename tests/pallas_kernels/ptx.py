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
