"""The CPU decode attention kernel (attn_cpu.cpp) on the KV-slot layouts serving produces.

    python -m benchmarks.decode_attention [--batches 1,8,32,64] [--context 280] [--prompt 128]
        [--layouts contiguous,scheduler,served] [--baseline 00bd50f] [--repeats 5] [--threads N]
        [--kv-dtypes float32,bfloat16]

Every layout is made by plait's own allocator (KVPool's free stack), not by hand:
  contiguous  each request's slots one ascending run (the best case, rarely served)
  scheduler   a fresh pool: each prompt one run (one alloc per request), then one alloc(1) per
              request per decode step, so a request's decode tokens sit B slots apart
  served      the same, from a pool that earlier traffic has turned over (requests of random
              lengths coming and going): prompts too land on scattered runs of slots
One "step" is one call per layer over `--layers` separate K/V buffers (SmolLM2: 30): cycling
through the layers as a forward does keeps the KV out of the last-level cache (one layer's
KV at B=32 x 280 tokens is 13.8 MB, under this machine's 32 MB L3; 30 layers are 410 MB).

`--scheduler`: instead, plait's Scheduler on `--model` (SmolLM2) in this process, B requests
of `--prompt` random tokens decoding together (the slot layout is the scheduler's own; the
layers in Python, --disable-cpu-fused-ops, so that the attention calls can be timed); every
`--steps` decode steps it switches between the new kernel, the old one and torch's path
(`--disable-cpu-attention-kernel`), and reports the median step time and the time in the
attention backend's forward per step (all layers); with `--threads 1` in CPU time too.

`--cascade`: instead, decode attention for requests sharing a cached prefix, at the shapes of
benchmarks/workloads.py (judge: 64 requests on a 1000-token rubric with ~68 tokens each of
their own; tree of thought, stage 2: 12 requests on a 500-token root with ~120 of their own),
30 layers per step: main's path (the old kernel on each request's suffix; the prefix copied
out of the pool with index_select, attended by torch's flash kernel, merged with torch ops)
against this checkout's decode_attention_cpu (the kernel on suffixes and on the prefix in
place, merged in C++).

Variants: this checkout's kernel (`new`) and the kernel source at git `--baseline` (`old`),
built side by side, alternated within each repeat; medians, and old/new as a ratio. With
`--kv-dtypes float32,bfloat16` the layouts' K/V also come as a bf16 pool (the same values
rounded; `--kv-cache-dtype bfloat16`), read by this checkout's kernels (`new-bfloat16`).
The runs of a repeat go in a fixed order, and where the L3 holds much of a step's KV (480 MB
on the Intel Xeon VM) a run right after one over the same pools starts warmer: compare
variants in a run of one dtype (old/new 0.95x with bf16 runs in between, 1.00x without). With
`--threads 1` the clock is the thread's CPU time (robust to a neighbour taking the core, not
to a neighbour's memory traffic).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from plait.radix_cache.kv_pool import KVPool

HKV, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2-135M


def scheduler_slots(batch: int, prompt: int, context: int, served: bool, seed: int) -> tuple:
    """Each request's KV slots as the scheduler allocates them: one alloc per prompt, then one
    alloc(1) per request per decode step; `served`: from a pool whose free stack earlier
    traffic has mixed up (see served_traffic)."""
    size = 4 * batch * (context + 8) + 4096
    pool = KVPool(size, 0, HKV, HEAD_DIM, torch.float32)
    if served:
        served_traffic(pool, batch, prompt, context, random.Random(seed))
    rows = [[pool.alloc(prompt)] for _ in range(batch)]
    for _ in range(context - prompt):
        for r in rows:
            r.append(pool.alloc(1))
    return [torch.cat(r) for r in rows], size


def served_traffic(pool: KVPool, batch: int, prompt: int, context: int, rng) -> None:
    """`batch` requests at a time with random prompt and output lengths (around the measured
    ones), each replaced by a new one when it finishes, until the pool has turned over twice;
    finished requests free their slots in position order, as KVManager.release does without
    the radix cache. The free stack ends up a mix of runs of all lengths."""
    live: list[tuple[list, int]] = []
    turned = 0
    while turned < 2 * pool.size:
        while len(live) < batch:
            p = rng.randint(16, 2 * prompt)
            live.append(([pool.alloc(p)], rng.randint(8, 2 * max(context - prompt, 8))))
            turned += p
        for r, _ in live:
            r.append(pool.alloc(1))
        turned += len(live)
        for r, _ in [x for x in live if len(x[0]) > x[1]]:
            pool.free(torch.cat(r))
        live = [x for x in live if len(x[0]) <= x[1]]
    for r, _ in rng.sample(live, len(live)):
        pool.free(torch.cat(r))


def contiguous_slots(batch: int, context: int) -> tuple[list, int]:
    return [1 + b * (context + 8) + torch.arange(context) for b in range(batch)], batch * (
        context + 8
    ) + 8


def load_old_kernel(ref: str):
    from plait.kernels.cpp_build import load_extension

    text = subprocess.run(
        ["git", "show", f"{ref}:plait/kernels/attn_cpu.cpp"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent,
    ).stdout
    src = Path(tempfile.mkdtemp()) / "attn_cpu.cpp"
    src.write_text(text)
    from plait.kernels.cpu_attention import decode_kernel_flags, kernel_isa

    # the same flags as today's kernel (its ISA, this CPU's prefetch choice): the old source
    # against the new, nothing else
    return load_extension("plait_attn_cpu", src, decode_kernel_flags(kernel_isa()), ["-fopenmp"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=280)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--layouts", default="contiguous,scheduler,served")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument(
        "--baseline",
        default="00bd50f",
        help="git ref of the old kernel (default: main before the rewrite; '' = none)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scheduler", action="store_true", help="A/B inside a real scheduler")
    ap.add_argument("--cascade", action="store_true", help="shared-prefix decode, judge/tree")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--avx2", action="store_true", help="also the new kernel built for AVX2")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--kv-dtypes", default="float32", help="pool dtypes (layouts): float32,bfloat16")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import plait.kernels.cpu_attention as cpu

    assert cpu.start_decode_kernel(block=True), "the decode kernel failed to build"
    variants = {"new": cpu._kernel}  # name -> the kernel module
    if args.avx2 and cpu._kernel.isa != "avx2":
        variants["new-avx2"] = cpu.load_decode_kernel("avx2")
    if args.baseline:
        variants["old"] = load_old_kernel(args.baseline)
    print(f"threads {torch.get_num_threads()}, kernel {cpu._kernel.isa}", flush=True)
    if args.cascade:
        assert "old" in variants, "--cascade compares against --baseline's kernel"
        for name, n, prefix, own in (("judge", 64, 1000, 68), ("tree", 12, 500, 120)):
            run_cascade(name, n, prefix, own, args, variants["old"])
        return 0
    if args.scheduler:
        for b in [int(x) for x in args.batches.split(",")]:
            run_scheduler(b, args, variants)
        return 0
    for layout in args.layouts.split(","):
        for b in [int(x) for x in args.batches.split(",")]:
            run_case(layout, b, args, variants)
    return 0


def run_case(layout: str, batch: int, args, variants: dict) -> None:
    if layout == "contiguous":
        rows, size = contiguous_slots(batch, args.context)
    else:
        rows, size = scheduler_slots(batch, args.prompt, args.context, layout == "served", batch)
    slots = torch.stack(rows)  # [B, L]
    lens = torch.full((batch,), args.context, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, HKV, GROUP, HEAD_DIM, generator=gen)
    shape = (size + 1, HKV, HEAD_DIM)
    kv = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(args.layers)
    ]
    pools = {}  # dtype -> the layers' (K, V)
    for name in args.kv_dtypes.split(","):
        dtype = getattr(torch, name)
        pools[name] = kv if dtype == torch.float32 else [(k.to(dtype), v.to(dtype)) for k, v in kv]
    # run name -> (kernel, pool dtype); a baseline from before bf16 pools reads fp32 ones only
    runs = {
        run_name(n, dt): (mod.decode_attention, dt)
        for dt in pools
        for n, mod in variants.items()
        if dt == "float32" or n != "old" or reads_bf16(mod, q, pools[dt][0], slots, lens)
    }
    outs = {n: fn(q, *pools[dt][0], slots, lens, 0.125)[0] for n, (fn, dt) in runs.items()}
    for dt in pools:
        old, new = run_name("old", dt), run_name("new", dt)
        if old in outs and new in outs:
            torch.testing.assert_close(outs[new], outs[old], atol=1e-5, rtol=1e-5)
    # one thread: its CPU time, which a neighbour taking the core for a while does not inflate
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    per: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(args.repeats):
        for n, (fn, dt) in runs.items():
            t = clock()
            for k, v in pools[dt]:
                fn(q, k, v, slots, lens, 0.125)
            per[n].append(clock() - t)
    step = {n: statistics.median(ts) * 1e3 for n, ts in per.items()}
    rows = batch * args.context * args.layers  # pool rows read per step, K and V each
    mb = {n: 2 * rows * HKV * HEAD_DIM * pools[dt][0][0].element_size() / 1e6
          for n, (_, dt) in runs.items()}
    # ns per token (one layer's K and V row) per thread: comparable across batches and threads
    ns = {n: ms * 1e6 * torch.get_num_threads() / rows for n, ms in step.items()}
    line = f"{layout:10s} B={batch:3d} L={args.context}: " + ", ".join(
        f"{n} {ms:6.2f} ms/step ({mb[n] / ms:5.1f} GB/s, {ns[n]:5.1f} ns/token/thread)"
        for n, ms in step.items()
    )
    for dt in pools:
        old, new = run_name("old", dt), run_name("new", dt)
        if old in step and new in step:
            line += f"  old/{new} {step[old] / step[new]:.2f}x"
    print(line, flush=True)


def run_name(variant: str, dtype: str) -> str:
    """A run's name: the kernel variant, and the pool dtype unless fp32 ("new-bfloat16")."""
    return variant if dtype == "float32" else f"{variant}-{dtype}"


def reads_bf16(mod, q, kv, slots, lens) -> bool:
    """Whether a (baseline) kernel build takes this pool dtype."""
    try:
        mod.decode_attention(q, *kv, slots, lens, 0.125)
    except RuntimeError:
        return False
    return True


def run_cascade(name: str, n: int, prefix: int, own: int, args, old) -> None:
    import plait.kernels.cpu_attention as cpu
    from plait.kernels.base import ForwardMode
    from plait.kernels.testing import random_attention_batch

    b = random_attention_batch(
        [prefix + own] * n,
        [1] * n,
        HKV * GROUP,
        HKV,
        HEAD_DIM,
        mode=ForwardMode.DECODE,
        seed=0,
        spare_slots=0,
    )
    rows, pools = b.meta.req_to_token, b.meta.req_pool_indices.tolist()
    for m in pools[1:]:  # a radix-cache hit: every request's first slots are the first's
        rows[m, :prefix] = rows[pools[0], :prefix]
    layers = [(b.k_buffer.nan_to_num(0.5), b.v_buffer.nan_to_num(0.5))]
    layers += [
        (torch.randn_like(layers[0][0]), torch.randn_like(layers[0][1]))
        for _ in range(args.layers - 1)
    ]
    plan = cpu.plan_decode(b.meta)
    assert len(plan.groups) == 1 and plan.groups[0].slots.numel() == prefix
    q, qg = b.q, b.q.view(n, HKV, GROUP, HEAD_DIM)

    def main_path(k, v):  # plait/kernels/cpu_attention.py at the baseline, kernel on
        out, lse = old.decode_attention(qg, k, v, plan.suffix_slots, plan.suffix_lens, 0.125)
        g = plan.groups[0]
        qs = qg.index_select(0, g.members).transpose(0, 1).reshape(1, HKV, n * GROUP, HEAD_DIM)
        kp = k.index_select(0, g.slots).transpose(0, 1)[None]
        vp = v.index_select(0, g.slots).transpose(0, 1)[None]
        p_out, p_lse = cpu._attend(qs, kp, vp, None, 0.125)
        p_out = p_out[0].view(HKV, n, GROUP, HEAD_DIM).transpose(0, 1)
        p_lse = p_lse[0].view(HKV, n, GROUP).transpose(0, 1)
        s_out, s_lse = out.index_select(0, g.members), lse.index_select(0, g.members)
        new_lse = torch.logaddexp(p_lse, s_lse)
        out[g.members] = (
            p_out * torch.exp(p_lse - new_lse)[..., None]
            + s_out * torch.exp(s_lse - new_lse)[..., None]
        )
        return out.reshape(n, HKV * GROUP, HEAD_DIM)

    def new_path(k, v):
        return cpu.decode_attention_cpu(q, k, v, b.meta, 0.125, use_kernel=True)

    fns = {"old": main_path, "new": new_path}
    torch.testing.assert_close(new_path(*layers[0]), main_path(*layers[0]), atol=1e-5, rtol=1e-5)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    per: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.repeats):
        for key, fn in fns.items():
            t = clock()
            for k, v in layers:
                fn(k, v)
            per[key].append(clock() - t)
    ms = {key: statistics.median(ts) * 1e3 for key, ts in per.items()}
    print(
        f"cascade {name}: {n} requests, {prefix} shared + {own} own tokens: "
        f"old {ms['old']:.1f} ms/step, new {ms['new']:.1f} ms/step, "
        f"old/new {ms['old'] / ms['new']:.2f}x",
        flush=True,
    )


def run_scheduler(batch: int, args, variants: dict) -> None:
    import plait.kernels.cpu_attention as cpu
    from plait.args import ServerArgs
    from plait.messages import TokenizedGenerateReq
    from plait.models.resolve import resolve_model_path
    from plait.models.tokenizer import load_tokenizer
    from plait.runtime.scheduler import Scheduler
    from plait.runtime.scheduler_process import InProcessIO

    path = str(resolve_model_path(args.model))
    new_steps = (2 + 3 * args.repeats) * args.steps + 8
    tokens = batch * (args.prompt + new_steps + 8) + 1024
    io = InProcessIO()
    # decode steps are timed (no speculation); the attention backend's forward is timed per
    # call, so the layers run in Python: the C++ layer loop (fused ops) calls the kernel
    # directly and the time in it could not be told apart
    server = ServerArgs(model_path=path, max_total_tokens=tokens, log_level="warning",
                        speculative_ngram=0, disable_cpu_fused_ops=True)
    sched = Scheduler(server, path, io, load_tokenizer(path))
    rng = random.Random(batch)
    vocab = sched.runner.config.vocab_size
    for i in range(batch):
        ids = [rng.randrange(10, vocab - 10) for _ in range(args.prompt)]
        io.inbox.put(
            TokenizedGenerateReq(
                rid=f"r{i}",
                input_ids=ids,
                sampling_params={
                    "temperature": 0.0,
                    "max_new_tokens": new_steps,
                    "ignore_eos": True,
                },
            )
        )
    attn = sched.runner.attn_backend
    spent = [0.0]
    forward = attn.forward
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def timed_forward(*a, **kw):
        t = clock()
        try:
            return forward(*a, **kw)
        finally:
            spent[0] += clock() - t

    attn.forward = timed_forward
    while sched.counters["decode_forwards"] < 2:
        sched.step()
    kinds = {n: (True, mod) for n, mod in variants.items()}
    kinds["torch"] = (False, cpu._kernel)
    step = {n: [] for n in kinds}
    att = {n: [] for n in kinds}
    kernel = cpu._kernel
    try:
        for _ in range(args.repeats):
            for n, (use, mod) in kinds.items():
                attn.use_cpu_kernel, cpu._kernel = use, mod
                before = sched.counters["decode_forwards"]
                spent[0] = 0.0
                t = clock()
                for _ in range(args.steps):
                    sched.step()
                steps = sched.counters["decode_forwards"] - before
                assert steps == args.steps, "a step that was not a decode step"
                step[n].append((clock() - t) / steps)
                att[n].append(spent[0] / steps)
    finally:
        cpu._kernel, attn.use_cpu_kernel = kernel, True
    ms = {n: (statistics.median(step[n]) * 1e3, statistics.median(att[n]) * 1e3) for n in kinds}
    line = f"scheduler B={batch:3d} ctx {args.prompt}+: " + ", ".join(
        f"{n} step {s:6.1f} ms (attention {a:5.1f})" for n, (s, a) in ms.items()
    )
    if "old" in ms:
        line += f"  attention old/new {ms['old'][1] / ms['new'][1]:.2f}x"
    print(line, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
