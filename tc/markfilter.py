"""The classic-BPF program that tests our mark bit: built and recognised here.

cls_bpf with a classic program works on every kernel that has cls_bpf and needs
no eBPF loader. u32 `match mark` is not used: without CONFIG_CLS_U32_MARK it is
accepted and silently matches every packet; fw is absent on minimal kernels.
"""
from __future__ import annotations

import struct

SKF_AD_OFF = 0xFFFFF000  # -0x1000 as u32: ancillary data area
SKF_AD_MARK = 20
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_ALU_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
BPF_JMP_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K
MATCH = 0xFFFFFFFF  # cls_bpf: -1 means "use the filter's default classid": a match
NO_MATCH = 0

Insn = tuple[int, int, int, int]


def mark_test(bit: int) -> list[Insn]:
    """A = skb->mark; A &= bit; if A == bit: match else: no match."""
    return [
        (BPF_LD_W_ABS, 0, 0, SKF_AD_OFF + SKF_AD_MARK),
        (BPF_ALU_AND_K, 0, 0, bit),
        (BPF_JMP_JEQ_K, 0, 1, bit),
        (BPF_RET_K, 0, 0, MATCH),
        (BPF_RET_K, 0, 0, NO_MATCH),
    ]


def encode(program: list[Insn]) -> bytes:
    """struct sock_filter[] in host byte order, as TCA_BPF_OPS expects."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def decode(raw: bytes) -> list[Insn]:
    return [struct.unpack_from("=HBBI", raw, off) for off in range(0, len(raw) - len(raw) % 8, 8)]


def mark_bit_of(raw: bytes) -> int | None:
    """The bit a program tests if it is exactly our mark test, else None."""
    program = decode(raw)
    if len(program) != 5:
        return None
    bit = program[1][3]
    return bit if program == mark_test(bit) else None


def as_tc_bytecode(program: list[Insn]) -> str:
    """The same program in tc(8)'s `bytecode` syntax, for docs and for the tc baseline."""
    return ",".join([str(len(program))] + [" ".join(map(str, insn)) for insn in program])
