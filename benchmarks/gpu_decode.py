"""GPU decode benchmark: tokens/s of a ~1B-parameter Llama (random weights, bf16; the
embedded `bench-1b` checkpoint, Llama-3.2-1B's shape) with the torch attention backend, the
Triton backend, and the Triton backend replaying CUDA graphs.

    python -m benchmarks.gpu_decode                   # on a CUDA machine (written for an H100)
    python -m benchmarks.gpu_decode --model plait-tiny --batches 1,4 --steps 8   # a quick look

Two measurements per configuration:
  1. decode step (model runner, no scheduler): B requests with a `--context`-token prompt each,
     prefilled, then `--steps` decode steps timed one by one (each step's forward to its logits
     on the device, CUDA-synchronized; the median step). tokens/s = B / median step.
  2. end to end (plait.Engine: tokenizer, scheduler and detokenizer processes over ZMQ, the
     sampler, logits copied to the host): B prompts of `--context` tokens, `--max-new-tokens`
     greedy tokens each, ignore_eos; output tokens/s over the wall time of the whole batch
     (prefill included), and the median time per output token of the decode phase from the
     per-request timings.
Writes benchmarks/results/gpu_decode.{json,md} (or --out); exits 1 if a configuration fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"

CONFIGS = {  # name -> ServerArgs overrides
    "torch": {"attention_backend": "torch", "disable_cuda_graph": True},
    "triton": {"attention_backend": "triton", "disable_cuda_graph": True},
    "triton+graphs": {"attention_backend": "triton", "disable_cuda_graph": False},
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def runner_steps(model_path: str, config: dict, batches: list[int], context: int, steps: int,
                 max_bs: int, device: str = "cuda") -> list[dict]:
    """Median decode step of the model runner alone, per batch size."""
    from plait.args import ServerArgs
    from plait.kernels.base import ForwardMode
    from plait.runtime.model_runner import ForwardInputs, ModelRunner

    pool_tokens = max_bs * (context + steps + 8) + 64
    args = ServerArgs(model_path=model_path, device=device, max_running_requests=max_bs,
                      max_total_tokens=pool_tokens, context_length=context + steps + 64, **config)
    t0 = time.perf_counter()
    runner = ModelRunner(args, model_path)
    load_s = time.perf_counter() - t0
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for batch in batches:
        rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
        # prefill 8 requests a forward (the extend kernels are not what is measured)
        tokens: list[int] = []
        for start in range(0, batch, 8):
            part = rows[start : start + 8]
            ids = torch.randint(0, vocab, (len(part) * context,), generator=gen).tolist()
            for row in part:
                runner.req_to_token_pool.write(row, 0, runner.kv_pool.alloc(context))
            inputs = ForwardInputs(ForwardMode.EXTEND, ids, part, [0] * len(part),
                                   [context] * len(part))
            last = [(i + 1) * context - 1 for i in range(len(part))]
            logits, _ = runner.run(inputs, last)
            tokens += logits.argmax(-1).tolist()
        lens = [context] * batch
        times = []
        for _ in range(steps):
            for row, n in zip(rows, lens):
                runner.req_to_token_pool.write(row, n, runner.kv_pool.alloc(1))
            inputs = ForwardInputs(ForwardMode.DECODE, tokens, rows, list(lens), [1] * batch)
            _sync()
            t = time.perf_counter()
            logits, _ = runner.run(inputs, list(range(batch)))
            _sync()
            times.append(time.perf_counter() - t)
            tokens = logits.argmax(-1).tolist()
            lens = [n + 1 for n in lens]
        warm = times[2:] if len(times) > 4 else times  # the first steps compile / settle
        step = statistics.median(warm)
        rows_out.append({
            "batch": batch, "context": context, "steps": steps,
            "step_ms": round(step * 1e3, 3), "tokens_per_s": round(batch / step, 1),
            "graph_replays": runner.decode_graphs.replays if runner.decode_graphs else 0,
        })
        for row, n in zip(rows, lens):  # give the slots back for the next batch size
            runner.kv_pool.free(runner.req_to_token_pool.read(row, n).cpu())
            runner.req_to_token_pool.free(row)
        print(f"  runner {batch:>3} x {context}: {rows_out[-1]['step_ms']:.2f} ms/step, "
              f"{rows_out[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    graphs = runner.decode_graphs.stats() if runner.decode_graphs else None
    for r in rows_out:
        r["load_s"] = round(load_s, 1)
        r["graph_capture_s"] = graphs["capture_seconds"] if graphs else None
    del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows_out


def engine_e2e(model_path: str, config: dict, batches: list[int], context: int,
               max_new_tokens: int, max_bs: int, device: str = "cuda") -> list[dict]:
    import plait

    gen = torch.Generator().manual_seed(1)
    out = []
    with plait.Engine(model_path, device=device, max_running_requests=max_bs,
                      context_length=context + max_new_tokens + 64, **config) as engine:
        vocab = engine.get_server_info()["vocab_size"]
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        warm = torch.randint(0, 100000, (2, 16), generator=gen).tolist()
        engine.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 8})
        for batch in batches:
            prompts = torch.randint(0, min(vocab, 100000), (batch, context), generator=gen)
            before = engine.get_server_info()
            t = time.perf_counter()
            outs = engine.generate(input_ids=prompts.tolist(), sampling_params=params)
            wall = time.perf_counter() - t
            after = engine.get_server_info()
            produced = sum(len(o["output_ids"]) for o in outs)
            # the scheduler's own phase timers (StepTimer) over this call, ms per forward
            forwards = sum(after[k] - before[k] for k in ("extend_forwards", "decode_forwards"))
            phases = {
                p: round(1e3 * (v["seconds"] - before["step_time"].get(p, {"seconds": 0.0})[
                    "seconds"]) / max(1, forwards), 3)
                for p, v in after["step_time"].items()
            }
            out.append({
                "batch": batch, "context": context, "max_new_tokens": max_new_tokens,
                "wall_s": round(wall, 3), "output_tokens": produced,
                "output_tokens_per_s": round(produced / wall, 1),
                "forwards": forwards, "ms_per_forward": phases,
            })
            print(f"  engine {batch:>3} x {context}: {produced} tokens in {wall:.2f} s, "
                  f"{produced / wall:.0f} tok/s; {forwards} forwards, ms each: {phases}",
                  flush=True)
    return out


def _table(results: dict, rate: str, columns: list[str], cells) -> list[str]:
    """One row per (config, batch) with `cells(row)` after config and before the rate's
    ratio to the torch config's at the same batch."""
    lines = ["| config | " + " | ".join(columns) + " | vs torch |",
             "| --- " * (len(columns) + 2) + "|"]
    base = {r["batch"]: r[rate] for r in results.get("torch", [])}
    for name, rows in results.items():
        for r in rows:
            ratio = f"{r[rate] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
            lines.append(f"| {name} | " + " | ".join(cells(r)) + f" | {ratio} |")
    return lines


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# GPU decode: torch vs Triton vs Triton + CUDA graphs",
        "",
        f"{env['device']}, torch {env['torch']}, triton {env.get('triton')}, {report['date']}; "
        f"model {report['model']} (random weights; bf16 on CUDA).",
        "",
        "## Decode step (model runner, median of the timed steps)",
        "",
        *_table(report["runner"], "tokens_per_s", ["batch", "context", "step ms", "tokens/s"],
                lambda r: [str(r["batch"]), str(r["context"]), f"{r['step_ms']:.2f}",
                           f"{r['tokens_per_s']:.0f}"]),
        "",
        "## End to end (plait.Engine, greedy, ignore_eos)",
        "",
        *_table(report["engine"], "output_tokens_per_s",
                ["batch", "context", "new tokens", "wall s", "output tokens/s"],
                lambda r: [str(r["batch"]), str(r["context"]), str(r["max_new_tokens"]),
                           f"{r['wall_s']:.2f}", f"{r['output_tokens_per_s']:.0f}"]),
    ]
    if report["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in report["failures"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-1b", help="embedded checkpoint name or a path")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--engine-batches", default="1,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--speculative-ngram", type=int, default=None,
                   help="the engines' n-gram draft length (default: the server's, which is 0 "
                   "with CUDA graphs and 4 without)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_decode needs a CUDA device (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    from plait.models.embedded import CHECKPOINT_SPECS, ensure_checkpoint

    t = time.perf_counter()
    model = str(ensure_checkpoint(args.model)) if args.model in CHECKPOINT_SPECS else args.model
    print(f"checkpoint {model} ready in {time.perf_counter() - t:.0f} s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    engine_batches = [int(b) for b in args.engine_batches.split(",") if b]
    max_bs = max(batches + engine_batches)
    names = [n for n in args.configs.split(",") if n]
    import triton

    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "environment": {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
        },
        "speculative_ngram": args.speculative_ngram,
        "runner": {}, "engine": {}, "failures": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "gpu_decode.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu_decode.md").write_text(markdown(report))

    for name in names:
        print(f"{name}:", flush=True)
        try:
            report["runner"][name] = runner_steps(
                model, CONFIGS[name], batches, args.context, args.steps, max_bs, args.device
            )
        except Exception as e:  # noqa: BLE001 - recorded, the other configs still run
            traceback.print_exc()
            report["failures"].append(f"runner {name}: {type(e).__name__}: {e}")
        save()
    if not args.skip_engine:
        for name in names:
            print(f"{name} (engine):", flush=True)
            try:
                config = dict(CONFIGS[name])
                if args.speculative_ngram is not None:
                    config["speculative_ngram"] = args.speculative_ngram
                report["engine"][name] = engine_e2e(
                    model, config, engine_batches, args.context, args.max_new_tokens,
                    max_bs, args.device,
                )
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                report["failures"].append(f"engine {name}: {type(e).__name__}: {e}")
            save()
    print(markdown(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
