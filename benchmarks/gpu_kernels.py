"""GPU kernel benchmark: the Triton KV-store, extend and decode attention kernels against the
torch reference, on a Llama-3-8B attention shape (32 query heads, 8 kv heads, head_dim 128).

    python -m benchmarks.gpu_kernels                  # on a CUDA machine (written for an H100)
    python -m benchmarks.gpu_kernels --cpu-smoke      # tiny shapes on CPU, Triton interpreter

For each case it
  1. checks the Triton kernel against plait.kernels.torch_backend (computed in fp32 from the
     same bf16 inputs) on fresh random inputs: relative error ||out - ref|| / ||ref||;
  2. times the Triton kernel and the torch reference with CUDA events: the median of many
     single launches after warm-up, the inputs rotated over several independent buffer sets
     (together several times the L2 cache) and L2 overwritten before each launch, so no
     launch finds its K/V cached;
  3. reports decode attention's achieved bandwidth (bytes of K and V read / time) as a fraction
     of the device-to-device copy bandwidth measured here (a torch copy of a 1 GiB tensor,
     counting its read and its write); the headline case is batch 64 x context 4096, bf16.
Writes benchmarks/results/gpu_kernels.md and .json; exits 1 if a check fails.
--cpu-smoke runs the same code on tiny fp32 shapes under TRITON_INTERPRET=1 (timings are
meaningless there) and writes results only where --out says.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5


@dataclass(frozen=True)
class Case:
    kernel: str  # "store_kv" | "extend" | "decode"
    name: str
    prefix_lens: list[int]
    extend_lens: list[int]
    headline: bool = False  # the decode case whose bandwidth fraction is reported on top


@dataclass
class Settings:
    device: torch.device
    shape: Shape
    cases: list[Case]
    iters: int
    ref_iters: int
    warmup: int
    max_rel_err: float
    copy_bytes: int


def _gpu_cases() -> list[Case]:
    return [
        Case("store_kv", "decode step: 64 tokens", [100] * 64, [1] * 64),
        Case("store_kv", "prefill: 8192 tokens", [0] * 8, [1024] * 8),
        Case("extend", "prefill 4 x 1024, no prefix", [0] * 4, [1024] * 4),
        Case("extend", "8 x 256 new after a 2048 cached prefix", [2048] * 8, [256] * 8),
        Case(
            "extend", "ragged 1..700 over prefixes 0..3000", [0, 3000, 17, 1500], [700, 1, 333, 64]
        ),
        Case("decode", "batch 64 x context 4096", [4095] * 64, [1] * 64, headline=True),
        Case("decode", "batch 8 x context 4096", [4095] * 8, [1] * 8),
        Case("decode", "batch 64 x context 512", [511] * 64, [1] * 64),
        Case("decode", "batch 32, ragged 1..8192", [i * 8191 // 31 for i in range(32)], [1] * 32),
    ]


def _smoke_cases() -> list[Case]:
    return [
        Case("store_kv", "8 tokens", [3, 0], [4, 4]),
        Case("extend", "ragged", [0, 20, 5], [17, 3, 1]),
        Case("decode", "batch 3, ragged", [39, 0, 16], [1, 1, 1], headline=True),
    ]


# ---------------------------------------------------------------------------------------------
# timing


class Timer:
    """Median milliseconds of single launches: CUDA events on a GPU, wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flush = None
        if device.type == "cuda":
            # several times L2, and long enough (~0.1 ms) to cover the launcher's Python
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self._flush = torch.empty(max(4 * l2, 256 << 20), dtype=torch.int8, device=device)

    def median_ms(self, fn: Callable[[int], object], iters: int, warmup: int) -> float:
        for i in range(warmup):
            fn(i)
        if self.device.type != "cuda":
            times = []
            for i in range(iters):
                start = time.perf_counter()
                fn(i)
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize(self.device)
        for i in range(iters):
            # overwriting L2 also keeps the GPU busy while Python launches the kernel, so the
            # events time the kernel, not the launch overhead
            self._flush.zero_()
            starts[i].record()
            fn(i)
            ends[i].record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth_gbps(timer: Timer, device: torch.device, num_bytes: int, iters: int) -> float:
    """Device-to-device copy bandwidth, bytes read + bytes written per second."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda i: dst.copy_(src), iters, warmup=3)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------
# one case


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if out.isnan().any():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _num_sets(batch_bytes: int, device: torch.device) -> int:
    """Independent input sets to rotate over: together at least 4x the L2 cache, 2 to 8."""
    if device.type != "cuda":
        return 2
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, min(8, -(-4 * l2 // max(batch_bytes, 1))))


def _attention_flops(case: Case, shape: Shape) -> float:
    # q k^T and p v, 2 flops per multiply-add, over the (query, key) pairs the causal mask keeps
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(case.prefix_lens, case.extend_lens))
    return 4.0 * pairs * shape.num_heads * shape.head_dim


def run_case(case: Case, s: Settings, timer: Timer, copy_gbps: float) -> dict:
    from plait.kernels import torch_backend as ref
    from plait.kernels import triton_ops as ops
    from plait.kernels.base import ForwardMode
    from plait.kernels.testing import random_attention_batch

    mode = ForwardMode.DECODE if case.kernel == "decode" else ForwardMode.EXTEND
    sh = s.shape

    def batch(seed: int):
        b = random_attention_batch(
            case.prefix_lens, case.extend_lens, sh.num_heads, sh.num_kv_heads, sh.head_dim,
            mode=mode, dtype=sh.dtype, device=s.device, seed=seed,
        )  # fmt: skip
        if case.kernel != "store_kv":
            ref.store_kv_reference(b.k_buffer, b.v_buffer, b.meta.out_cache_loc, b.k_new, b.v_new)
        return b

    # 1. correctness on fresh inputs (a seed no timed set uses)
    check = batch(seed=10_000)
    if case.kernel == "store_kv":
        k_buf, v_buf = check.k_buffer.clone(), check.v_buffer.clone()
        ops.store_kv(k_buf, v_buf, check.meta.out_cache_loc, check.k_new, check.v_new)
        ref.store_kv_reference(
            check.k_buffer, check.v_buffer, check.meta.out_cache_loc, check.k_new, check.v_new
        )
        same = torch.equal(k_buf.nan_to_num(7.0), check.k_buffer.nan_to_num(7.0)) and torch.equal(
            v_buf.nan_to_num(7.0), check.v_buffer.nan_to_num(7.0)
        )
        rel_err = 0.0 if same else float("inf")
    else:
        fn = ops.extend_attention if mode is ForwardMode.EXTEND else ops.decode_attention
        ref_fn = (
            ref.extend_attention_reference
            if mode is ForwardMode.EXTEND
            else ref.decode_attention_reference
        )
        out = fn(check.q, check.k_buffer, check.v_buffer, check.meta, sh.scaling,
                 out=torch.full_like(check.q, float("nan")))  # fmt: skip
        expected = ref_fn(
            check.q.float(), check.k_buffer.float(), check.v_buffer.float(), check.meta, sh.scaling
        )
        rel_err = _rel_err(out, expected)
        del out, expected
    ok = rel_err <= s.max_rel_err  # False for NaN too
    del check

    # 2. timing over rotated input sets
    first = batch(seed=0)
    row_bytes = sh.num_kv_heads * sh.head_dim * first.k_buffer.element_size()
    touched = 2 * row_bytes * (first.meta.num_tokens if case.kernel == "store_kv" else
                               sum(first.meta.seq_lens_cpu))  # fmt: skip
    sets = [first] + [batch(seed=i) for i in range(1, _num_sets(touched, s.device))]

    def launch(b, use_ref: bool):
        m = b.meta
        if case.kernel == "store_kv":
            store = ref.store_kv_reference if use_ref else ops.store_kv
            return store(b.k_buffer, b.v_buffer, m.out_cache_loc, b.k_new, b.v_new)
        if mode is ForwardMode.EXTEND:
            f = ref.extend_attention_reference if use_ref else ops.extend_attention
        else:
            f = ref.decode_attention_reference if use_ref else ops.decode_attention
        return f(b.q, b.k_buffer, b.v_buffer, m, sh.scaling)

    triton_ms = timer.median_ms(lambda i: launch(sets[i % len(sets)], False), s.iters, s.warmup)
    torch_ms = timer.median_ms(lambda i: launch(sets[i % len(sets)], True), s.ref_iters, 2)

    result = {
        "kernel": case.kernel,
        "case": case.name,
        "batch": len(case.extend_lens),
        "new_tokens": sum(case.extend_lens),
        "kv_tokens": sum(p + e for p, e in zip(case.prefix_lens, case.extend_lens)),
        "rel_err": rel_err,
        "ok": ok,
        "triton_us": triton_ms * 1e3,
        "torch_us": torch_ms * 1e3,
        "speedup": torch_ms / triton_ms,
        "input_sets": len(sets),
        "headline": case.headline,
    }
    if case.kernel == "store_kv":
        # read k/v rows, write them to the pool
        result["GBps"] = 2 * touched / (triton_ms * 1e-3) / 1e9
    elif case.kernel == "decode":
        result["GBps"] = first.kv_bytes_read / (triton_ms * 1e-3) / 1e9
        result["frac_copy_bw"] = result["GBps"] / copy_gbps
        result["num_kv_splits"] = ops.default_num_kv_splits(
            first.meta.batch_size, sh.num_heads, sh.num_kv_heads, first.meta.max_seq_len,
            s.device,
        )  # fmt: skip
    else:
        result["TFLOPs"] = _attention_flops(case, sh) / (triton_ms * 1e-3) / 1e12
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------
# report


def markdown(report: dict) -> str:
    env, shape = report["environment"], report["shape"]
    clock = "wall clock, interpreter: not meaningful" if env["interpreter"] else "CUDA events"
    shape_text = (
        f"{shape['num_heads']} query heads, {shape['num_kv_heads']} kv heads, "
        f"head_dim {shape['head_dim']}, {shape['dtype']}"
    )
    lines = [
        "# Triton attention kernels",
        "",
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}.",
        (
            f"Shape: {shape_text}. Check: relative error vs the torch reference in fp32, "
            f"limit {report['max_rel_err']:g}. Times: median of single launches ({clock}), "
            "inputs rotated over independent sets, L2 overwritten before each launch."
        ),
        f"Device-to-device copy bandwidth (read + write): {report['copy_GBps']:.0f} GB/s.",
        "",
    ]
    head = next((r for r in report["results"] if r["headline"]), None)
    if head is not None:
        lines += [
            (
                f"**Decode attention, {head['case']}, {shape['dtype']}: "
                f"{head['GBps']:.0f} GB/s of K/V read = {100 * head['frac_copy_bw']:.0f}% of the "
                f"measured copy bandwidth** ({head['triton_us']:.1f} us, "
                f"{head['speedup']:.1f}x the torch reference)."
            ),
            "",
        ]
    lines += [
        "| kernel | case | check (rel. err) | Triton us | torch ref us | speedup | achieved |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        if "frac_copy_bw" in r:
            achieved = f"{r['GBps']:.0f} GB/s ({100 * r['frac_copy_bw']:.0f}% of copy)"
        elif "GBps" in r:
            achieved = f"{r['GBps']:.0f} GB/s"
        else:
            achieved = f"{r['TFLOPs']:.1f} TFLOP/s"
        verdict = "ok" if r["ok"] else "**FAIL**"
        lines.append(
            f"| {r['kernel']} | {r['case']} | {verdict} ({r['rel_err']:.1e}) | "
            f"{r['triton_us']:.1f} | {r['torch_us']:.1f} | {r['speedup']:.1f}x | {achieved} |"
        )
    return "\n".join(lines) + "\n"


def _environment(device: torch.device) -> dict:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "device": name or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }


def _settings(args: argparse.Namespace) -> Settings:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    shape = Shape(args.num_heads, args.num_kv_heads, args.head_dim, dtype)
    if args.cpu_smoke:
        return Settings(
            device=torch.device("cpu"),
            shape=Shape(4, 2, 16, torch.float32),
            cases=_smoke_cases(),
            iters=2,
            ref_iters=2,
            warmup=1,
            max_rel_err=1e-4,
            copy_bytes=1 << 24,
        )
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --cpu-smoke for the CPU check")
    return Settings(
        device=torch.device("cuda"),
        shape=shape,
        cases=_gpu_cases(),
        iters=args.iters,
        ref_iters=max(5, args.iters // 10),
        warmup=args.warmup,
        # bf16 keeps 8 bits of mantissa: outputs (and p before p @ v) round at ~2^-9 relative
        max_rel_err=2e-2,
        copy_bytes=1 << 30,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 shapes, interpreter")
    p.add_argument("--out", type=Path, default=None, help=f"results folder (default {RESULTS})")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        # must precede the first import of triton_ops: the interpreter is chosen at @triton.jit
        os.environ["TRITON_INTERPRET"] = "1"
    from plait.kernels import triton_ops as ops

    if args.cpu_smoke and not ops._interpreted():
        raise SystemExit("--cpu-smoke: triton_ops was imported before TRITON_INTERPRET was set")
    s = _settings(args)
    torch.manual_seed(0)
    timer = Timer(s.device)
    copy_gbps = copy_bandwidth_gbps(timer, s.device, s.copy_bytes, iters=max(s.iters // 4, 2))
    results = []
    for case in s.cases:
        r = run_case(case, s, timer, copy_gbps)
        print(
            f"{r['kernel']:>8} | {r['case']:<40} | rel err {r['rel_err']:.1e} "
            f"{'ok' if r['ok'] else 'FAIL'} | {r['triton_us']:9.1f} us | "
            f"torch {r['torch_us']:9.1f} us",
            flush=True,
        )
        results.append(r)
    report = {
        "environment": _environment(s.device),
        "shape": {**asdict(s.shape), "dtype": str(s.shape.dtype).removeprefix("torch.")},
        "max_rel_err": s.max_rel_err,
        "copy_GBps": copy_gbps,
        "iters": s.iters,
        "results": results,
    }
    table = markdown(report)
    print()
    print(table)
    out = args.out if args.out is not None else (None if args.cpu_smoke else RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_kernels.md").write_text(table)
        (out / "gpu_kernels.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out / 'gpu_kernels.md'} and {out / 'gpu_kernels.json'}")
    failed = [f"{r['kernel']} {r['case']}" for r in results if not r["ok"]]
    if failed:
        print("FAILED checks: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
