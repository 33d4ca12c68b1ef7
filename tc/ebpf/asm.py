"""The instruction assembler: eBPF instructions as bytes, labels and jumps resolved into offsets."""
from __future__ import annotations

import struct
from typing import Any

R0, R1, R2, R3, R4, R6, R7, R8, R10 = 0, 1, 2, 3, 4, 6, 7, 8, 10
# what resolve() takes: an instruction, ("label", name) or ("jmp", code, dst, imm, target)
Item = bytes | tuple[Any, ...]


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def le(word: bytes) -> int:
    """Four network-order bytes as a 32-bit load on a little-endian host sees them, as a signed immediate."""
    return int(struct.unpack("<i", word)[0])


def resolve(body: list[Item]) -> bytes:
    """Place the labels and fill in the jumps' offsets. `body` holds instructions, ("label", name) and
    ("jmp", code, dst, imm, target); every item but a label is one 8-byte slot (ld_imm64's two slots
    are two items)."""
    labels: dict[str, int] = {}
    pos = 0
    for item in body:
        if isinstance(item, tuple) and item[0] == "label":
            labels[item[1]] = pos
        else:
            pos += 1
    out: list[bytes] = []
    for item in body:
        if isinstance(item, tuple):
            if item[0] == "jmp":
                _, code, dst, imm, target = item
                out.append(insn(code, dst, 0, labels[target] - len(out) - 1, imm))
        else:
            out.append(item)
    return b"".join(out)
