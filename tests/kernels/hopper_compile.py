"""Compile every Triton kernel ahead of time for sm_90 (H100), no GPU needed.

The interpreter accepts code that the compiler rejects (types, layouts, shared memory), so the
CPU tests alone cannot tell whether the kernels build for the GPU. This script compiles each
kernel with the block sizes the launchers pick on an H100, for the dtypes and head sizes of
the supported models, and checks each fits the H100's shared memory. Run it in a process
without TRITON_INTERPRET (test_triton_attention.py does): `python tests/kernels/hopper_compile.py`.
Prints one line per variant; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from plait.kernels import triton_ops as ops

CAPABILITY = (9, 0)
TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # per-block opt-in maximum on sm_90

# runtime (non-constexpr) arguments that are not the kernel's data pointers
_POINTERS = {
    "Loc": "*i64",
    "ReqToToken": "*i32",
    "ReqPoolIdx": "*i64",
    "SeqLens": "*i32",
    "PrefixLens": "*i32",
    "ExtendLens": "*i32",
    "ExtendStart": "*i32",
    "MidO": "*fp32",
    "MidLse": "*fp32",
}
_SCALARS = {"qk_scale": "fp32", "num_kv_splits": "i32"}
# strides that are multiples of head_dim in every real model, so a launch sees them divisible
# by 16 (Triton specializes on that; it decides vector widths and whether loads pipeline)
_ALIGNED_STRIDES = {
    "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kbs", "stride_kbh", "stride_vbs",
    "stride_vbh", "stride_qt", "stride_qh", "stride_qb", "stride_ot", "stride_oh", "stride_ob",
    "stride_mob", "stride_moh", "stride_mos",
}  # fmt: skip
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _signature(kernel, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.startswith("stride_"):
            sig[name] = "i32"
        elif name in _SCALARS:
            sig[name] = _SCALARS[name]
        elif name in _POINTERS:
            sig[name] = _POINTERS[name]
        elif name[0].isupper():  # Q, K, V, KBuf, VBuf, O: the model dtype
            sig[name] = "*" + dtype
        else:
            raise KeyError(f"{kernel.__name__}: no type for argument {name!r}; add it above")
    return sig


def _attrs(kernel, signature: dict) -> dict:
    """What a launch with 16-byte aligned tensors and head_dim-multiple strides specializes."""
    attrs = {}
    for i, name in enumerate(kernel.arg_names):
        if signature[name].startswith("*") or name in _ALIGNED_STRIDES:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def build(kernel, dtype: str, constexprs: dict, num_warps: int, stages: int):
    signature = _signature(kernel, dtype, constexprs)
    src = triton.compiler.ASTSource(
        fn=kernel, signature=signature, constexprs=constexprs, attrs=_attrs(kernel, signature)
    )
    return triton.compile(
        src, target=TARGET, options={"num_warps": num_warps, "num_stages": stages}
    )


def _ptxas_report(compiled) -> tuple[int, int]:
    """(registers per thread, spilled bytes) of the kernel, from `ptxas -v` on its PTX."""
    ptxas = get_ptxas(CAPABILITY[0] * 10 + CAPABILITY[1]).path
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        arch = f"--gpu-name=sm_{CAPABILITY[0]}{CAPABILITY[1]}a"
        cmd = [ptxas, "-v", arch, ptx, "-o", os.path.join(tmp, "kernel.cubin")]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spilled


def compile_one(label: str, kernel, dtype: str, params: dict) -> None:
    start = time.perf_counter()
    params = dict(params)
    num_warps, stages = params.pop("num_warps"), params.pop("num_stages", 1)
    compiled = build(kernel, dtype, params, num_warps, stages)
    registers, spilled = _ptxas_report(compiled)
    shared = compiled.metadata.shared
    pipelined = compiled.asm["ttgir"].count("async_copy_global_to_local")
    print(
        f"{label}: warps {num_warps} stages {stages}, shared {shared} B, {registers} registers, "
        f"{spilled} B spilled, {pipelined} async copies, {time.perf_counter() - start:.1f}s",
        flush=True,
    )
    if shared > SMEM_LIMIT:
        raise SystemExit(f"{label} needs {shared} B of shared memory (> {SMEM_LIMIT})")
    if spilled and dtype != "fp32":  # fp32 (exact dots on FMA units) is not a serving dtype
        raise SystemExit(f"{label} spills {spilled} B of registers: pick smaller blocks")
    if stages > 1 and not pipelined:
        raise SystemExit(f"{label}: num_stages={stages} but the K/V loads are not pipelined")


def variants():
    """(label, kernel, dtype, launch params) for the dtypes and head sizes of the supported
    models (Llama/Qwen/Mistral: head_dim 64, 128, 256; GQA groups 1 to 8 and more)."""
    for dtype, head_dim in (("bf16", 128), ("fp16", 64), ("bf16", 256), ("fp32", 128)):
        torch_dtype = _TORCH_DTYPE[dtype]
        yield (
            f"store_kv {dtype} D={head_dim}",
            ops._store_kv_kernel,
            dtype,
            ops.store_kv_params(8, head_dim),
        )
        ext = ops.extend_config(head_dim, torch_dtype, CAPABILITY)
        yield (
            f"extend {dtype} D={head_dim} {ext}",
            ops._extend_attn_kernel,
            dtype,
            ops.extend_params(4, head_dim, torch_dtype, ext),
        )
        for group in (1, 4, 8, 32) if head_dim == 128 else (4,):
            dec = ops.decode_config(group, head_dim, torch_dtype, CAPABILITY)
            yield (
                f"decode stage 1 {dtype} D={head_dim} group={group} {dec}",
                ops._decode_stage1_kernel,
                dtype,
                ops.decode_stage1_params(group, head_dim, torch_dtype, dec),
            )
        for splits in (1, 7, ops.MAX_KV_SPLITS):
            yield (
                f"decode stage 2 {dtype} D={head_dim} splits={splits}",
                ops._decode_stage2_kernel,
                dtype,
                ops.decode_stage2_params(head_dim, splits, dec),
            )


def main() -> None:
    if not isinstance(ops._store_kv_kernel, triton.runtime.jit.JITFunction):
        raise SystemExit("the kernels are interpreted: run without TRITON_INTERPRET")
    for variant in variants():
        compile_one(*variant)
    print("all kernels compiled for sm_90")


if __name__ == "__main__":
    sys.exit(main())
