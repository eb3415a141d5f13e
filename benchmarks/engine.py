"""Offline engine benchmark (issue 2): plait with the radix cache on and off vs Hugging Face
transformers `generate` one request at a time, on the judge and decode workloads.

    python -m benchmarks.engine [--model PATH] [--repeats 3] [--workloads judge,decode]

Engines run in one process, alternated per repetition so machine drift hits all alike; each
figure is the median of the repetitions. Writes benchmarks/results/engine.json and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import workloads as wl

RESULTS = Path(__file__).parent / "results"


def build_cpu_kernels() -> None:
    """Build (or load) plait's CPU kernels here, before any engine starts: a scheduler loads
    each one in a background thread and runs torch's operators until it is ready, so an
    engine started while one compiles (a minute the first time) would be timed beside the
    compiler, on the fallback path."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return
    from plait.kernels.cpu_attention import start_decode_kernel
    from plait.kernels.cpu_extend import start_extend_kernel
    from plait.kernels.fused_ops import start_fused_ops
    from plait.kernels.screen_kernel import start_screen_kernel
    from plait.kernels.woq import start_linear_kernels

    start_decode_kernel(block=True)
    start_extend_kernel(block=True)
    start_fused_ops(block=True)
    start_linear_kernels(block=True)  # fp32 and the quantized linears alike
    start_screen_kernel(block=True)  # the logit screen's, where the CPU has AMX or AVX512-BF16


class PlaitEngine:
    def __init__(self, name: str, model: str, **kwargs) -> None:
        import plait

        self.name = name
        self._spec = (model, kwargs)
        self.engine = plait.Engine(model, **kwargs)

    def warm_up(self, seconds: float = 6.0) -> None:
        """Untimed requests for `seconds` (8 distinct 250-token prompts, prefilled in one
        2000-token forward, then 16 decode steps): the scheduler's background kernel loads
        finish and the thread tuner has measured small and large forwards before the first
        timed run. One constrained request first: the scheduler builds its grammar backend
        in the background once it idles (~2 s of a core on SmolLM2), which would otherwise
        happen while another engine's repetition is timed; built now, there is nothing left
        to build."""
        prompts = [[11 + (7 * j + i) % 997 for i in range(250)] for j in range(8)]
        self.generate(prompts[:1], 4, json_schema='{"type": "object"}', ignore_eos=False)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.engine.flush_cache()
            self.generate(prompts, 16)

    def restart(self) -> None:
        """A fresh engine (after one whose scheduler died)."""
        import plait

        try:
            self.engine.shutdown()
        except Exception:
            pass
        model, kwargs = self._spec
        self.engine = plait.Engine(model, **kwargs)

    def run(self, w: wl.Workload) -> int:
        self.engine.flush_cache()  # every repetition starts cold
        outs = self.engine.generate(
            input_ids=w.prompts,
            sampling_params={"max_new_tokens": w.max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        return sum(len(o["output_ids"]) for o in outs)

    # the suite interface (benchmarks/run.py): generate for workloads.run_workload, timed run
    def generate(self, prompts, max_new_tokens, json_schema=None, ignore_eos=True) -> list[list[int]]:
        sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
        if json_schema:
            sp["json_schema"] = json_schema
        return [o["output_ids"] for o in self.engine.generate(input_ids=prompts, sampling_params=sp)]

    def run_suite(self, w: wl.SuiteWorkload) -> tuple[float, list[list[int]]]:
        self.engine.flush_cache()
        return _timed(self.generate, w)

    def thread_counts(self) -> dict[str, int]:
        """The scheduler's forwards so far per torch thread count, and the thread tuner's
        probes and switches ({} with a fixed --num-threads): benchmarks.run records each
        run's difference."""
        th = self.engine.get_server_info().get("threads") or {}
        counts = {f"forwards@{n}": c for n, c in (th.get("forwards_by_threads") or {}).items()}
        for k in ("probes", "switches"):
            if k in th:
                counts[k] = th[k]
        return counts

    def close(self) -> None:
        self.engine.shutdown()


def _timed(generate, w: wl.SuiteWorkload) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = wl.run_workload(generate, w)
    return time.perf_counter() - start, outputs


class HFOneAtATime:
    def __init__(self, model: str) -> None:
        from transformers import AutoModelForCausalLM

        self.name = "transformers (one at a time)"
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(self, w: wl.Workload) -> int:
        total = 0
        for p in w.prompts:
            g = self.model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=w.max_new_tokens, min_new_tokens=w.max_new_tokens,
                do_sample=False, pad_token_id=0,
            )
            total += g.shape[1] - len(p)
        return total

    # the suite interface (benchmarks/run.py)
    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, json_schema=None, ignore_eos=True) -> list[list[int]]:
        return [self._generate_batch([p], max_new_tokens, json_schema, ignore_eos)[0] for p in prompts]

    def _generate_batch(self, prompts, max_new_tokens, json_schema, ignore_eos) -> list[list[int]]:
        """Greedy generate for a batch, left-padded; outputs cut at the first EOS."""
        pad = self.model.generation_config.pad_token_id
        pad = pad if isinstance(pad, int) else 0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        kwargs = {}
        if json_schema:
            kwargs["logits_processor"] = [self._json_processor(json_schema)]
        if ignore_eos:
            kwargs["min_new_tokens"] = max_new_tokens
        g = self.model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=pad, **kwargs,
        )
        outs = g[:, width:].tolist()
        if ignore_eos:
            return outs
        eos = set(self._eos_ids())
        return [o[: next((i for i, t in enumerate(o) if t in eos), len(o))] for o in outs]

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def _json_processor(self, schema: str):
        """xgrammar's transformers LogitsProcessor (one per generate call)."""
        import xgrammar as xgr
        from transformers import AutoTokenizer
        from xgrammar.contrib.hf import LogitsProcessor

        if getattr(self, "_compiler", None) is None:
            tok = AutoTokenizer.from_pretrained(self.model.name_or_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tok, vocab_size=self.model.config.vocab_size, stop_token_ids=self._eos_ids()
            )
            self._compiler = xgr.GrammarCompiler(info)
            self._compiled = {}
        if schema not in self._compiled:
            self._compiled[schema] = self._compiler.compile_json_schema(schema)
        return LogitsProcessor(self._compiled[schema])

    def run_suite(self, w: wl.SuiteWorkload) -> tuple[float, list[list[int]]]:
        return _timed(self.generate, w)

    def close(self) -> None:
        pass


class HFStaticBatch(HFOneAtATime):
    """transformers `generate` on static batches of `batch_size` prompts, left-padded."""

    def __init__(self, model: str, batch_size: int = 16) -> None:
        super().__init__(model)
        self.name = f"transformers (static batch {batch_size})"
        self.batch_size = batch_size

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, json_schema=None, ignore_eos=True) -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            chunk = prompts[i : i + self.batch_size]
            outs += self._generate_batch(chunk, max_new_tokens, json_schema, ignore_eos)
        return outs


def measure(engines, workloads, repeats: int) -> dict:
    results: dict = {w.name: {e.name: [] for e in engines} for w in workloads}
    for w in workloads:
        for e in engines:  # warm-up (not timed)
            e.run(wl.Workload(w.name, w.prompts[:2], 2, ""))
        for r in range(repeats):
            for e in engines if r % 2 == 0 else engines[::-1]:
                start = time.perf_counter()
                tokens = e.run(w)
                secs = time.perf_counter() - start
                results[w.name][e.name].append({"seconds": secs, "output_tokens": tokens})
                print(f"  {w.name:7s} {e.name:32s} {secs:7.2f} s  {tokens} tokens", flush=True)
    return results


def summarize(results: dict, workloads) -> dict:
    summary = {}
    for w in workloads:
        rows = {}
        for name, runs in results[w.name].items():
            secs = statistics.median(r["seconds"] for r in runs)
            tokens = runs[0]["output_tokens"]
            rows[name] = {"req_s": w.num_requests / secs, "out_tok_s": tokens / secs, "seconds": secs}
        summary[w.name] = rows
    return summary


def markdown(summary: dict, base: str, others: list[str]) -> str:
    lines = ["| workload | engine | req/s | out tok/s | plait (cache on) / this |", "|---|---|---|---|---|"]
    for w, rows in summary.items():
        ref = rows[base]["req_s"]
        for name, r in rows.items():
            ratio = "—" if name == base else f"{ref / r['req_s']:.2f}x"
            lines.append(f"| {w} | {name} | {r['req_s']:.2f} | {r['out_tok_s']:.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: plait's embedded plait-tiny)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="judge,decode")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args(argv)
    from plait.models.embedded import ensure_checkpoint
    from plait.models.config import ModelConfig

    model = args.model or str(ensure_checkpoint("plait-tiny"))
    vocab = ModelConfig.from_dir(model).vocab_size
    names = args.workloads.split(",")
    workloads = [getattr(wl, n)(vocab) for n in names]
    engines = [
        PlaitEngine("plait (radix cache on)", model),
        PlaitEngine("plait (radix cache off)", model, disable_radix_cache=True),
    ]
    if not args.no_hf:
        engines.append(HFOneAtATime(model))
    try:
        results = measure(engines, workloads, args.repeats)
    finally:
        for e in engines:
            e.close()
    summary = summarize(results, workloads)
    table = markdown(summary, "plait (radix cache on)", [])
    RESULTS.mkdir(exist_ok=True)
    out = {"model": model, "repeats": args.repeats, "threads": torch.get_num_threads(),
           "workloads": {w.name: w.description for w in workloads}, "summary": summary, "runs": results}
    (RESULTS / "engine.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "engine.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
