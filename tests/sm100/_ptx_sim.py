"""A tiny CPU interpreter for straight-line PTX that only touches shared memory: every thread of the block runs the
same instruction stream, so registers are numpy arrays over the threads. Enough for the SM100 decode's V
dequantization wrapped in a test kernel (integer ops, fp32 multiply, 16-bit conversions, shared loads / stores);
anything else raises. Follows the PTX ISA: mul.f32 is round-to-nearest with subnormals (numpy fp32 on the CPU),
cvt.rn to f16 / bf16 rounds to nearest even, cvt.rn.f16x2.f32 d, a, b puts a in the upper half."""

from __future__ import annotations

import re

import numpy as np
import torch

U32 = np.uint32


def _f32(x):
    return x.astype(U32).view(np.float32)


def _to_f16(x):
    return _f32(x).astype(np.float16).view(np.uint16).astype(U32)


def _to_bf16(x):
    t = torch.from_numpy(_f32(x).copy()).to(torch.bfloat16).view(torch.int16)
    return t.numpy().view(np.uint16).astype(U32)


def _e4m3_to_f16(b):
    t = torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)
    return t.numpy().view(np.uint16).astype(U32)


def _statements(ptx: str):
    """(opcode, operands) of the entry's body; inline-asm scopes are flattened (their names never clash in use)."""
    body = ptx[ptx.index("{", ptx.index(".entry")) + 1:]
    body = re.sub(r"//[^\n]*", "", body)
    body = re.sub(r"^\s*[{}]\s*$", "", body, flags=re.M)
    for raw in body.split(";"):
        st = re.sub(r"\s+", " ", raw).strip()
        if st and not st.startswith(".reg"):
            op, _, rest = st.partition(" ")
            yield op, [o.strip() for o in re.findall(r"\{[^}]*\}|\[[^\]]*\]|[^,\s][^,]*", rest)]


def run_block(ptx: str, threads: int, params: list, smem: np.ndarray, smem_symbol: str = "__dynamic_shmem__0"):
    """Run the kernel's PTX for ``threads`` threads over ``smem`` (uint8, changed in place; the dynamic shared
    memory starts at address 0). ``params`` are the kernel's 32-bit parameters in order. Returns the number of
    times each byte of ``smem`` was stored to."""
    names = re.findall(r"\.param \.u32 (\S+?),?\n", ptx)
    regs: dict = {}
    stores = np.zeros(smem.shape, dtype=np.int64)

    def val(t):
        if t in regs:
            return regs[t]
        if t == "%tid.x":
            return np.arange(threads, dtype=U32)
        if t == smem_symbol:
            return np.zeros(threads, dtype=U32)
        if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", t):
            return np.full(threads, int(t[2:], 16), dtype=U32)
        return np.full(threads, int(t, 0) & 0xFFFFFFFF, dtype=U32)

    def addr(t):
        m = re.fullmatch(r"\[([^+\]]+)(?:\+(-?\d+))?\]", t)
        return val(m.group(1).strip()).astype(np.int64) + int(m.group(2) or 0)

    def store(at, words, nbytes):  # words: per-thread values of nbytes // len(words) bytes each, little endian
        step = nbytes // len(words)
        for k, w in enumerate(words):
            for i in range(step):
                np.add.at(stores, at + k * step + i, 1)
                smem[at + k * step + i] = ((w >> U32(8 * i)) & U32(0xFF)).astype(np.uint8)

    for op, o in _statements(ptx):
        def a(i):
            return val(o[i])

        if op == "ret":
            break
        if op == "ld.param.b32":
            regs[o[0]] = np.full(threads, params[names.index(o[1].strip("[]"))] & 0xFFFFFFFF, dtype=U32)
            continue
        if op == "ld.shared.b8":
            regs[o[0]] = smem[addr(o[1])].astype(U32)
            continue
        if op == "ld.shared.b32":
            x = addr(o[1])
            assert (x % 4 == 0).all()
            regs[o[0]] = sum(smem[x + i].astype(U32) << U32(8 * i) for i in range(4))
            continue
        if op == "st.shared.b16":
            x = addr(o[0])
            assert (x % 2 == 0).all()
            store(x, [val(o[1])], 2)
            continue
        if op == "st.shared.v4.b32":
            x = addr(o[0])
            assert (x % 16 == 0).all()
            store(x, [val(r.strip()) for r in o[1].strip("{}").split(",")], 16)
            continue
        if op in ("mov.b32", "mov.u32") and o[0].startswith("{"):
            lo, hi = [r.strip() for r in o[0].strip("{}").split(",")]
            regs[lo], regs[hi] = a(1) & U32(0xFFFF), a(1) >> U32(16)
            continue
        if op in ("mov.b32", "mov.u32", "shfl.sync.idx.b32"):  # the shuffle broadcasts the (uniform) smem base
            r = a(1)
        elif op in ("add.s32", "add.u32"):
            r = a(1) + a(2)
        elif op == "mul.lo.u32":
            r = a(1) * a(2)
        elif op == "and.b32":
            r = a(1) & a(2)
        elif op == "or.b32":
            r = a(1) | a(2)
        elif op == "xor.b32":
            r = a(1) ^ a(2)
        elif op in ("shl.b32", "shr.u32"):
            sh = np.minimum(a(2), U32(32)).astype(np.uint64)
            r = (a(1).astype(np.uint64) << sh if op == "shl.b32" else a(1).astype(np.uint64) >> sh) & 0xFFFFFFFF
        elif op == "bfe.u32":
            r = (a(1) >> a(2)) & ((U32(1) << a(3)) - U32(1))
        elif op == "setp.eq.u32":
            regs[o[0]] = a(1) == a(2)
            continue
        elif op == "setp.lt.s32":
            regs[o[0]] = a(1).view(np.int32) < a(2).view(np.int32)
            continue
        elif op in ("selp.b32", "selp.f32"):
            r = np.where(regs[o[3]], a(1), a(2))
        elif op == "mul.f32":
            with np.errstate(all="ignore"):
                r = (_f32(a(1)) * _f32(a(2))).view(U32)
        elif op == "cvt.rn.f16.f32":
            r = _to_f16(a(1))
        elif op == "cvt.rn.bf16.f32":
            r = _to_bf16(a(1))
        elif op == "cvt.rn.f16x2.f32":
            r = (_to_f16(a(1)) << U32(16)) | _to_f16(a(2))
        elif op == "cvt.rn.bf16x2.f32":
            r = (_to_bf16(a(1)) << U32(16)) | _to_bf16(a(2))
        elif op == "cvt.u16.u32":
            r = a(1) & U32(0xFFFF)
        elif op == "cvt.rn.f16x2.e4m3x2":
            r = _e4m3_to_f16(a(1) & U32(0xFF)) | (_e4m3_to_f16((a(1) >> U32(8)) & U32(0xFF)) << U32(16))
        elif op == "cvt.f32.f16":
            r = (a(1) & U32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32).view(U32)
        else:
            raise NotImplementedError(f"PTX simulator: {op}")
        regs[o[0]] = np.asarray(r).astype(U32)
    return stores
