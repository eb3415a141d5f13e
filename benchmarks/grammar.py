"""Constrained-generation benchmark (issue 4), both grammar backends side by side.

    python -m benchmarks.grammar [--model DIR] [--backends xgrammar,outlines] [--dev-tokens 48]
        [--repeats 3] [--only-extraction | --only-long | --only-dev-costs] [--skip-dev]
        [--dev-cost-tokens 32] [--only-budgets 16,32,64] [--only-dev-compile]

1. extraction: 32 JSON-schema requests (a schema with fixed keys: name, age, tags) vs the same
   32 prompts unconstrained (ignore_eos, as many tokens as the constrained run produced on
   average): output tokens/s, constrained / unconstrained (both warmed up, then timed in
   turns, --repeats times: medians), and validity of the outputs. Also against the same
   prompts unconstrained at lengths matched request by request (each as many tokens as its
   constrained output): the constrained outputs' lengths vary (SmolLM2: 22-61 tokens, median
   24), and the longest decodes alone at the end, a tail that the mean-length run, all 32 in
   step, does not have; the matched ratio is the grammar's own cost, the mean-length one also
   the length spread's.
2. jump-forward: model forward passes per request (the scheduler's `request_forwards` counter)
   for the same constrained requests with jump-forward on and off, and whether the texts agree.
3. compile time per schema: cold (first submit) and cached (second submit), GrammarManager on
   the extraction schema and on five dev schemas.
4. per-token cost of long-length schemas (a signup form: nine strings of 1024-2048
   characters; one field at 2048; one of minLength 5000) and of regexes with counted groups:
   seconds per output token constrained vs unconstrained (same prompts, same lengths), and the unconstrained requests' per-token time when one
   heavy-schema request shares their batch vs when it does not.
5. the 200 JSONSchemaBench dev schemas through the Engine (greedy, --dev-tokens): share accepted,
   share of finished outputs that validate, refusals grouped by keyword.
6. the dev schemas' per-token cost (`--dev-cost-tokens`, 0 skips; `--only-dev-costs` alone,
   written to grammar-devcosts[-MODEL].json):
   each accepted schema's request alone (batch 1), constrained up to that many tokens, against
   the same prompt unconstrained for as many tokens; the median, the maximum and every schema
   above 2x (issue 13: no dev schema may cost over 2x an unconstrained token).

7. `--only-budgets 16,32,64` alone: the dev schemas greedy at each max_new_tokens: how many
   end whole (and valid) and which run out (`length`, incomplete), written to
   grammar-budgets[-MODEL].json: the budget closing's reach on real schemas.

8. `--only-dev-compile` alone: every dev schema compiled cold, one at a time (as 3.), written
   to grammar-compile[-MODEL].json with the total and the slowest ten printed.

Writes benchmarks/results/grammar.json and grammar.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import time
from pathlib import Path

from benchmarks import workloads as wl

RESULTS = Path(__file__).parent / "results"
DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev"
DEV_PROMPT = "Output the JSON now:"  # the dev schemas' requests (acceptance and per-token cost)


def _stats_delta(engine, before: dict) -> dict:
    after = engine.get_server_info()
    return {k: after[k] - before[k] for k in ("request_forwards", "forced_tokens")}


def extraction(model: str, backend: str, n: int = 32, repeats: int = 3) -> dict:
    import statistics

    import jsonschema

    import plait

    from plait.models.config import ModelConfig

    w = wl.json_constrained(ModelConfig.from_dir(model).vocab_size, n=n)
    schema = json.loads(w.json_schema)
    cons = {"max_new_tokens": w.max_new_tokens, "temperature": 0, "json_schema": w.json_schema}
    out: dict = {}

    def timed(eng, params, logprobs: bool = False) -> tuple[float, list, dict]:
        eng.flush_cache()
        before = eng.get_server_info()
        t = time.perf_counter()
        res = eng.generate(input_ids=w.prompts, sampling_params=params, return_logprob=logprobs)
        return time.perf_counter() - t, res, _stats_delta(eng, before)

    for jf in (True, False):
        with plait.Engine(model, grammar_backend=backend, disable_jump_forward=not jf) as eng:
            eng.generate(input_ids=w.prompts[:2], sampling_params=cons)  # compile + warm-up
            secs, res, delta = timed(eng, cons)
            texts = [r["text"] for r in res]
            tokens = sum(r["meta_info"]["completion_tokens"] for r in res)
            finished = [r for r in res if r["meta_info"]["finish_reason"]["type"] == "stop"]
            valid = 0
            for r in finished:
                try:
                    jsonschema.validate(json.loads(r["text"]), schema,
                                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
                    valid += 1
                except Exception:  # noqa: BLE001 - counted as invalid
                    pass
            row = {
                "seconds": secs, "output_tokens": tokens, "out_tok_s": tokens / secs,
                "forwards_per_request": delta["request_forwards"] / n,
                "forced_tokens": delta["forced_tokens"], "finished": len(finished) / n,
                "finished_valid": valid / max(1, len(finished)), "texts": texts,
                "lengths": [r["meta_info"]["completion_tokens"] for r in res],
            }
            if jf:
                # unconstrained on the same engine: same prompts, the same mean output length
                # (ignore_eos). Both are warmed up first (the first batch of a shape pays for
                # the thread tuner's probes and one-time builds), then timed in turns: medians
                per = max(1, round(tokens / n))
                free = {"max_new_tokens": per, "temperature": 0, "ignore_eos": True}
                # and each request as long as its own constrained output
                matched = [{"max_new_tokens": max(1, r["meta_info"]["completion_tokens"]),
                            "temperature": 0, "ignore_eos": True} for r in res]
                timed(eng, free)
                timed(eng, matched)
                timed(eng, cons, logprobs=True)
                cons_s, free_s, matched_s, lp_s = [], [], [], []
                for _ in range(repeats):
                    cons_s.append(timed(eng, cons)[0])
                    # the same requests returning logprobs (each forced token's from the
                    # extend that feeds jump-forward's text; before session 40 they turned
                    # jump-forward off and decoded every forced token a step of its own)
                    lsecs, lres, ldelta = timed(eng, cons, logprobs=True)
                    lp_s.append(lsecs)
                    usecs, ures, _ = timed(eng, free)
                    free_s.append(usecs)
                    msecs, mres, _ = timed(eng, matched)
                    matched_s.append(msecs)
                row["seconds"] = statistics.median(cons_s)
                row["out_tok_s"] = tokens / row["seconds"]
                row["repeats"] = {"constrained_s": cons_s, "unconstrained_s": free_s,
                                  "matched_s": matched_s, "logprobs_s": lp_s}
                row["with_logprobs"] = {
                    "seconds": statistics.median(lp_s),
                    "out_tok_s": tokens / statistics.median(lp_s),
                    "forwards_per_request": ldelta["request_forwards"] / n,
                    "same_text": sum(a["text"] == b for a, b in zip(lres, texts)) / n,
                    "logprobs_per_token": sum(
                        len(r["meta_info"]["output_token_logprobs"]) for r in lres) / tokens,
                }
                for key, results, secs_list in (("unconstrained", ures, free_s),
                                                ("unconstrained_matched", mres, matched_s)):
                    utok = sum(r["meta_info"]["completion_tokens"] for r in results)
                    usecs = statistics.median(secs_list)
                    out[key] = {"seconds": usecs, "output_tokens": utok,
                                "out_tok_s": utok / usecs}
            out["jump_forward_on" if jf else "jump_forward_off"] = row
    on, off = out["jump_forward_on"], out["jump_forward_off"]
    off.pop("lengths")
    out["same_text_jf_on_off"] = sum(a == b for a, b in zip(on.pop("texts"), off.pop("texts"))) / n
    out["constrained_vs_unconstrained"] = on["out_tok_s"] / out["unconstrained"]["out_tok_s"]
    out["constrained_vs_unconstrained_matched"] = (
        on["out_tok_s"] / out["unconstrained_matched"]["out_tok_s"])
    out["output_lengths"] = sorted(on.pop("lengths"))
    out["forwards_saved"] = 1 - on["forwards_per_request"] / off["forwards_per_request"]
    return out


def compile_times(model: str, backend: str, schemas: dict[str, str]) -> dict:
    from transformers import AutoTokenizer

    from plait.grammar.base import GrammarError
    from plait.grammar.manager import GrammarManager
    from plait.models.config import ModelConfig

    cfg = ModelConfig.from_dir(model)
    tok = AutoTokenizer.from_pretrained(model)
    manager = GrammarManager(backend, tok, cfg.vocab_size, list(cfg.eos_token_ids),
                             compile_timeout=30)
    manager.backend  # vocabulary tables built before timing
    out = {}
    try:
        for name, spec in schemas.items():
            row = {}
            for label in ("cold_ms", "cached_ms"):
                t = time.perf_counter()
                try:
                    manager.submit("json_schema", spec).result(timeout=60)
                except GrammarError as e:
                    row["refused"] = str(e)[:120]
                    break
                row[label] = (time.perf_counter() - t) * 1000
            out[name] = row
    finally:
        manager.shutdown()
    return out


SIGNUP_FIELDS = [("first_name", 1024), ("last_name", 1024), ("email", 2048), ("password", 2048),
                 ("address", 2048), ("city", 1024), ("country", 1024), ("bio", 2048),
                 ("website", 2048)]
LONG_SCHEMAS = {
    "signup (9 x maxLength 1024-2048)": {
        "type": "object", "properties": {k: {"type": "string", "maxLength": n}
                                         for k, n in SIGNUP_FIELDS},
        "required": [k for k, _ in SIGNUP_FIELDS], "additionalProperties": False},
    "one string maxLength 2048": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 2048}},
        "required": ["text"], "additionalProperties": False},
    # a long minimum (session 46: its counted repetition took 0.4-0.8 s a mask fill on
    # plait-tiny's 100k vocabulary, and the request held its server's every other for minutes)
    "one string minLength 5000": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 5000}},
        "required": ["text"], "additionalProperties": False},
}
# regexes with counted repetitions of a group (session 47: `(\w+ ){5,}` took 13 ms a mask fill
# on plait-tiny's 100k vocabulary, 0.2 ms once spelled out; regex_syntax.spell_out_counts)
COUNTED_REGEXES = {
    "regex (\\w+ ){5,}": r"(\w+ ){5,}",
    "regex (?:\\w+ ){0,3}\\w+": r"(?:\w+ ){0,3}\w+",
    "regex (- [^\\n]+\\n){3,8}": r"(- [^\n]+\n){3,8}",
    # past the spelling budget: 64 copies spelled, the rest counted inside the last
    "regex (\\w+ ){3,200}": r"(\w+ ){3,200}",
}


def long_strings(model: str, backend: str, n: int = 8, max_tokens: int = 48) -> dict:
    """Per-token cost of long-length schemas (and of regexes with counted groups) against
    unconstrained requests."""
    import plait

    from plait.models.config import ModelConfig

    prompts = wl.json_constrained(ModelConfig.from_dir(model).vocab_size, n=n).prompts
    out: dict = {}
    with plait.Engine(model, grammar_backend=backend) as eng:
        constraints = [(name, {"json_schema": json.dumps(s)}) for name, s in LONG_SCHEMAS.items()]
        constraints += [(name, {"regex": r}) for name, r in COUNTED_REGEXES.items()]
        for name, constraint in constraints:
            cons = {"max_new_tokens": max_tokens, "temperature": 0, **constraint}
            eng.generate(input_ids=prompts[:1], sampling_params=cons)  # compile + warm-up
            eng.flush_cache()
            t = time.perf_counter()
            res = eng.generate(input_ids=prompts, sampling_params=cons)
            csecs = time.perf_counter() - t
            ctok = sum(r["meta_info"]["completion_tokens"] for r in res)
            per = max(1, round(ctok / n))
            free = {"max_new_tokens": per, "temperature": 0, "ignore_eos": True}
            eng.flush_cache()
            t = time.perf_counter()
            ures = eng.generate(input_ids=prompts, sampling_params=free)
            usecs = time.perf_counter() - t
            utok = sum(r["meta_info"]["completion_tokens"] for r in ures)
            # the same unconstrained requests with one heavy-schema request in their batch
            eng.flush_cache()
            t = time.perf_counter()
            mixed = eng.generate(input_ids=prompts + prompts[:1],
                                 sampling_params=[free] * n + [cons])
            msecs = time.perf_counter() - t
            mtok = sum(r["meta_info"]["completion_tokens"] for r in mixed)
            row = {
                "constrained_s_per_token": csecs / max(1, ctok),
                "unconstrained_s_per_token": usecs / max(1, utok),
                "mixed_s_per_token": msecs / max(1, mtok),
                "constrained_tokens": ctok, "unconstrained_tokens": utok,
            }
            row["cost_ratio"] = row["constrained_s_per_token"] / row["unconstrained_s_per_token"]
            row["mixed_ratio"] = row["mixed_s_per_token"] / row["unconstrained_s_per_token"]
            out[name] = row
            print(f"  {name}: constrained/unconstrained per-token cost {row['cost_ratio']:.2f}x, "
                  f"batch with one heavy request {row['mixed_ratio']:.2f}x", flush=True)
    return out


KEYWORD = re.compile(r"keyword '([^']+)'")


def dev_schemas(model: str, backend: str, max_tokens: int) -> dict:
    import plait

    if not sorted(DEV.glob("*/*.json")):
        return {"error": f"no schemas at {DEV}"}
    with plait.Engine(model, grammar_backend=backend, grammar_compile_timeout=10.0,
                      max_total_tokens=65536) as eng:
        return _dev_run(eng, max_tokens)


def dev_budgets(model: str, backend: str, budgets: list[int]) -> dict:
    """The dev schemas at each of `budgets` max_new_tokens (greedy, one Engine): how many end
    whole and valid, and which run out of budget (`length`, incomplete: a schema whose
    shortest output is longer than the budget, or a closing the planner did not find)."""
    import plait

    with plait.Engine(model, grammar_backend=backend, grammar_compile_timeout=10.0,
                      max_total_tokens=65536, log_level="error") as eng:
        _dev_run(eng, 8)  # compiles every schema once: the budgets' runs find them cached
        out = {}
        for b in budgets:
            r = out[str(b)] = _dev_run(eng, b)
            print(f"  budget {b:4d}: {r['finished']} of {r['accepted']} accepted end whole "
                  f"({r['finished_valid']:.0%} of them valid), {r['length']} run out "
                  f"({r['seconds']:.0f} s)", flush=True)
        return out


def _dev_run(eng, max_tokens: int) -> dict:
    import jsonschema

    files = sorted(DEV.glob("*/*.json"))

    async def run(eng) -> list:
        sem = asyncio.Semaphore(16)

        async def one(path: Path):
            spec = path.read_text()
            async with sem:
                try:
                    r = await eng.async_generate(
                        DEV_PROMPT,
                        {"max_new_tokens": max_tokens, "temperature": 0, "json_schema": spec},
                    )
                    return path, spec, r, None
                except ValueError as e:
                    return path, spec, None, str(e)

        return await asyncio.gather(*(one(f) for f in files))

    t = time.perf_counter()
    results = asyncio.run(run(eng))
    secs = time.perf_counter() - t
    accepted = finished = valid = 0
    refusals: collections.Counter = collections.Counter()
    invalid: list[str] = []
    ran_out: list[str] = []
    for path, spec, r, err in results:
        if err is not None:
            m = KEYWORD.search(err)
            if m:
                reason = m.group(1)
            elif "exceeded" in err:
                reason = "compile timeout"
            elif "busy" in err:
                reason = "compiler busy"
            else:
                reason = err.split(":")[-1].strip()[:60]
            refusals[reason] += 1
            continue
        accepted += 1
        if r["meta_info"]["finish_reason"]["type"] != "stop":
            ran_out.append(path.relative_to(DEV).as_posix())
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(r["text"]), json.loads(spec),
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            valid += 1
        except Exception:  # noqa: BLE001 - a guarantee failure: reported by name
            invalid.append(path.name)
    return {
        "schemas": len(files), "accepted": accepted, "accepted_share": accepted / len(files),
        "finished": finished, "finished_valid": valid / max(1, finished), "invalid": invalid,
        "length": len(ran_out), "ran_out": ran_out,
        "refusals": dict(refusals.most_common()), "seconds": secs,
    }


def dev_costs(model: str, backend: str, max_tokens: int, files: list[Path] | None = None,
              repeats: int = 2, speculative_ngram: int | None = 0) -> dict:
    """Per-token cost of each dev schema against the same request unconstrained: one request at
    a time (batch 1, where a grammar's own work weighs most against the forward), the schema
    compiled and the prompt cached first; constrained greedy up to `max_tokens`, then the same
    prompt unconstrained for exactly as many tokens (ignore_eos); the better of `repeats` timed
    runs each. cost = (constrained s / token) / (unconstrained s / token).

    n-gram speculation is off on both sides by default (speculative_ngram 0; None: the
    engine's default): with it on, a step yields as many tokens as the model's text repeats
    itself, and a random-weight model's free babble ("Rig Rig Rig ...") repeats more than its
    JSON, so the ratio measured how repetitive two texts were rather than what the grammar
    costs (plait-tiny: 9 steps for 32 free tokens, 19 for 32 constrained)."""
    import plait

    files = sorted(DEV.glob("*/*.json")) if files is None else files
    if not files:
        return {"error": f"no schemas at {DEV}"}
    rows: dict[str, dict] = {}
    refused = 0

    def timed(eng, params: dict) -> tuple[float, dict]:
        t = time.perf_counter()
        r = eng.generate(DEV_PROMPT, params)
        return time.perf_counter() - t, r

    spec = {} if speculative_ngram is None else {"speculative_ngram": speculative_ngram}
    with plait.Engine(model, grammar_backend=backend, grammar_compile_timeout=10.0,
                      **spec) as eng:
        for path in files:
            cons = {"max_new_tokens": max_tokens, "temperature": 0,
                    "json_schema": path.read_text()}
            try:
                eng.generate(DEV_PROMPT, {**cons, "max_new_tokens": 1})
            except ValueError:
                refused += 1
                continue
            c = [timed(eng, cons) for _ in range(repeats)]
            tokens = c[0][1]["meta_info"]["completion_tokens"]
            if tokens == 0:  # nothing to compare per token
                continue
            free = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
            u = [timed(eng, free) for _ in range(repeats)]
            assert all(r["meta_info"]["completion_tokens"] == tokens for _, r in c + u), path
            cs, us = min(t for t, _ in c) / tokens, min(t for t, _ in u) / tokens
            name = path.relative_to(DEV).as_posix() if path.is_relative_to(DEV) else path.name
            rows[name] = {
                "tokens": tokens, "constrained_s_per_token": cs,
                "unconstrained_s_per_token": us, "cost_ratio": cs / us}
    ratios = sorted(r["cost_ratio"] for r in rows.values())
    worst = sorted(rows.items(), key=lambda kv: -kv[1]["cost_ratio"])
    out = {"measured": len(rows), "refused": refused, "max_tokens": max_tokens,
           "speculative_ngram": "default" if speculative_ngram is None else speculative_ngram,
           "max_ratio": ratios[-1] if ratios else None,
           "median_ratio": ratios[len(ratios) // 2] if ratios else None,
           "over_2x": {k: v["cost_ratio"] for k, v in worst if v["cost_ratio"] > 2.0},
           "worst": dict(worst[:5]), "schemas": rows}
    if ratios:
        print(f"  {len(rows)} schemas: per-token cost median {out['median_ratio']:.2f}x, "
              f"max {out['max_ratio']:.2f}x ({worst[0][0]}), {len(out['over_2x'])} above 2x",
              flush=True)
    return out


def _git_rev() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def markdown(res: dict) -> str:
    git = f", git {res['git']}" if res.get("git") else ""
    lines = [f"## Constrained generation — {res['model_name']}", "",
             f"`python -m benchmarks.grammar --model {res['model_name']}` ({res['when']}{git}); "
             f"greedy{'; random weights' if res['model_name'] == 'plait-tiny' else ''}.",
             "", "| backend | constrained tok/s | unconstrained tok/s | ratio | "
             "ratio, lengths matched | forwards/req JF on | JF off | fewer forwards | "
             "same text on/off | finished | valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b, r in res["backends"].items():
        if "extraction" not in r:
            continue
        e = r["extraction"]
        on, off, u = e["jump_forward_on"], e["jump_forward_off"], e["unconstrained"]
        lines.append(
            f"| {b} | {on['out_tok_s']:.0f} | {u['out_tok_s']:.0f} | "
            f"{e['constrained_vs_unconstrained']:.2f}x | "
            f"{e.get('constrained_vs_unconstrained_matched', float('nan')):.2f}x | "
            f"{on['forwards_per_request']:.1f} | "
            f"{off['forwards_per_request']:.1f} | {e['forwards_saved']:.0%} | "
            f"{e['same_text_jf_on_off']:.0%} | {on['finished']:.0%} | {on['finished_valid']:.0%} |")
    lines += ["", "Compile time (ms), cold / cached:", "",
              "| schema | " + " | ".join(res["backends"]) + " |",
              "|---|" + "---|" * len(res["backends"])]
    names = list(next(iter(res["backends"].values())).get("compile", {}))
    for n in names:
        cells = []
        for r in res["backends"].values():
            c = r["compile"][n]
            cells.append("refused" if "refused" in c else
                         f"{c['cold_ms']:.1f} / {c.get('cached_ms', float('nan')):.3f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Long-maxLength schemas, seconds per output token (constrained / unconstrained; "
              "a batch of unconstrained requests plus one heavy-schema request / without it):",
              "", "| backend | schema | constrained ms/tok | unconstrained ms/tok | ratio | "
              "mixed batch ratio |", "|---|---|---|---|---|---|"]
    for b, r in res["backends"].items():
        for name, row in r.get("long_strings", {}).items():
            lines.append(f"| {b} | {name} | {row['constrained_s_per_token'] * 1e3:.1f} | "
                         f"{row['unconstrained_s_per_token'] * 1e3:.1f} | "
                         f"{row['cost_ratio']:.2f}x | {row['mixed_ratio']:.2f}x |")
    lines += ["", "200 JSONSchemaBench dev schemas:", "",
              "| backend | accepted | finished outputs valid | refusals by keyword |",
              "|---|---|---|---|"]
    for b, r in res["backends"].items():
        d = r.get("dev", {"error": "not run"})
        if "error" in d:
            lines.append(f"| {b} | {d['error']} | | |")
            continue
        top = ", ".join(f"{k} {v}" for k, v in list(d["refusals"].items())[:8])
        lines.append(f"| {b} | {d['accepted']}/{d['schemas']} ({d['accepted_share']:.0%}) | "
                     f"{d['finished_valid']:.0%} of {d['finished']} | {top} |")
    return "\n".join(lines + dev_costs_lines(res)) + "\n"


def dev_costs_lines(res: dict) -> list[str]:
    """The dev schemas' per-token cost table (markdown lines; none when it was not run)."""
    costs = {b: r["dev_costs"] for b, r in res["backends"].items()
             if r.get("dev_costs", {}).get("measured")}
    if not costs:
        return []
    lines = ["", ("Dev schemas' per-token cost, one request at a time (constrained s/token / "
                  "the same prompt unconstrained for as many tokens):"), "",
             "| backend | schemas | median | max | above 2x | worst |", "|---|---|---|---|---|---|"]
    for b, d in costs.items():
        worst = ", ".join(f"{k} {v['cost_ratio']:.2f}x" for k, v in list(d["worst"].items())[:3])
        spec = d.get("speculative_ngram", "default")
        b = f"{b} (n-gram speculation {'off' if spec == 0 else spec})"
        lines.append(f"| {b} | {d['measured']} | {d['median_ratio']:.2f}x | "
                     f"{d['max_ratio']:.2f}x | {len(d['over_2x'])} | {worst} |")
    return lines


def main(argv=None) -> int:
    import datetime as dt

    from plait.models.resolve import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="plait-tiny")
    ap.add_argument("--backends", default="xgrammar,outlines")
    ap.add_argument("--dev-tokens", type=int, default=48)
    ap.add_argument("--skip-dev", action="store_true")
    ap.add_argument("--dev-cost-tokens", type=int, default=32,
                    help="dev schemas' per-token cost check: tokens a request (0: skip it)")
    ap.add_argument("--only-dev-costs", action="store_true",
                    help="only the dev schemas' per-token cost check")
    ap.add_argument("--dev-cost-ngram", default="0",
                    help="the per-token cost check's n-gram speculation on both sides: 0 (off, "
                         "the default: the grammar's own cost), a draft length, or 'default' "
                         "(the engine's)")
    ap.add_argument("--n", type=int, default=32, help="extraction requests")
    ap.add_argument("--repeats", type=int, default=3,
                    help="extraction: constrained and unconstrained timed in turns (medians)")
    ap.add_argument("--only-extraction", action="store_true",
                    help="only the extraction comparison (printed, no files written)")
    ap.add_argument("--only-long", action="store_true",
                    help="only the per-token-cost check of long lengths (maxLength, minLength) "
                         "and counted-group regexes")
    ap.add_argument("--only-budgets", default="",
                    help="only the dev schemas at these max_new_tokens (e.g. 16,32,64): how "
                         "many end whole; written to grammar-budgets[-MODEL].json")
    ap.add_argument("--only-dev-compile", action="store_true",
                    help="only every dev schema's cold compile time; written to "
                         "grammar-compile[-MODEL].json")
    args = ap.parse_args(argv)
    ngram = None if args.dev_cost_ngram == "default" else int(args.dev_cost_ngram)
    model = resolve_model_path(args.model)  # a directory, a GGUF, or a name (plait-tiny, smollm2)
    schemas = {"extraction": json.dumps(wl.PERSON_SCHEMA, sort_keys=True)}
    schemas.update({name: json.dumps(s) for name, s in LONG_SCHEMAS.items()})
    for f in sorted(DEV.glob("*/*.json"))[::40][:5]:
        schemas[f.relative_to(DEV).as_posix()] = f.read_text()
    res = {"model_name": args.model, "when": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
           "git": _git_rev(), "backends": {}}
    for backend in args.backends.split(","):
        if args.only_dev_compile:
            print(f"[{backend}] dev schemas: cold compile times", flush=True)
            res["backends"][backend] = {"compile": compile_times(
                model, backend, {f.relative_to(DEV).as_posix(): f.read_text()
                                 for f in sorted(DEV.glob("*/*.json"))})}
            continue
        if args.only_budgets:
            print(f"[{backend}] dev schemas within budgets", flush=True)
            res["backends"][backend] = {"budgets": dev_budgets(
                model, backend, [int(b) for b in args.only_budgets.split(",")])}
            continue
        if args.only_dev_costs:
            print(f"[{backend}] dev schemas: per-token cost", flush=True)
            res["backends"][backend] = {"dev_costs": dev_costs(
                model, backend, args.dev_cost_tokens, speculative_ngram=ngram)}
            continue
        if args.only_extraction:
            res["backends"][backend] = {"extraction": extraction(model, backend, args.n,
                                                                 args.repeats)}
            continue
        print(f"[{backend}] long-maxLength schemas: per-token cost", flush=True)
        r = {"long_strings": long_strings(model, backend)}
        if args.only_long:
            res["backends"][backend] = r
            continue
        print(f"[{backend}] extraction + jump-forward", flush=True)
        r["extraction"] = extraction(model, backend, args.n, args.repeats)
        print(f"[{backend}] compile times", flush=True)
        r["compile"] = compile_times(model, backend, schemas)
        if not args.skip_dev:
            print(f"[{backend}] 200 dev schemas", flush=True)
            r["dev"] = dev_schemas(model, backend, args.dev_tokens)
        else:
            r["dev"] = {"error": "skipped"}
        if not args.skip_dev and args.dev_cost_tokens > 0:
            print(f"[{backend}] dev schemas: per-token cost", flush=True)
            r["dev_costs"] = dev_costs(model, backend, args.dev_cost_tokens,
                                       speculative_ngram=ngram)
        res["backends"][backend] = r
    stem = "grammar" if args.model == "plait-tiny" else f"grammar-{Path(args.model).name}"
    if args.only_budgets:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"{stem.replace('grammar', 'grammar-budgets', 1)}.json"
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")
        return 0
    if args.only_dev_compile:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"{stem.replace('grammar', 'grammar-compile', 1)}.json"
        out.write_text(json.dumps(res, indent=1))
        for backend, r in res["backends"].items():
            cold = {n: c["cold_ms"] for n, c in r["compile"].items() if "cold_ms" in c}
            print(f"{backend}: {len(cold)} compiled in {sum(cold.values()) / 1e3:.1f} s, "
                  f"{len(r['compile']) - len(cold)} refused; slowest:")
            for n in sorted(cold, key=cold.get, reverse=True)[:10]:
                print(f"  {cold[n] / 1e3:6.2f} s  {n}")
        print(f"wrote {out}")
        return 0
    if args.only_dev_costs:  # its own file: the per-schema figures
        RESULTS.mkdir(exist_ok=True)
        suffix = "" if ngram == 0 else f"-ngram{ngram if ngram is not None else ''}"
        out = RESULTS / f"{stem.replace('grammar', 'grammar-devcosts', 1)}{suffix}.json"
        out.write_text(json.dumps(res, indent=1))
        print("\n".join(dev_costs_lines(res)))
        print(f"wrote {out}")
        return 0
    if args.only_long or args.only_extraction:
        print(json.dumps(res, indent=1))
        return 0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
