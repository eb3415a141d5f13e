"""The `plait` command (also `python -m plait`).

    plait serve [--model PATH_OR_NAME] [--port 30000] [--api-key KEY] [server args...]
    plait serve --dp N [--router [--router-policy cache_aware]] ...   # replicas (replicas.py)
    plait generate --prompt TEXT [--raw] [--max-new-tokens N] [--temperature T] [engine args...]

With no --model both use the default model, SmolLM2-135M-Instruct (fetched once from the
package registry). `generate` wraps the prompt in the model's chat template as a user turn
(--raw sends it as is) and decodes greedily unless given a --temperature.

Server flags derive from ServerArgs (`plait serve --help` lists them; `plait generate` takes
the Engine's, not those of the HTTP server alone). Heavy modules (torch, transformers, uvicorn)
load only after the arguments parsed, so `--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import json
import sys

from plait.args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="plait: a runtime for LLM programs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP (SGLang-native and OpenAI-compatible APIs)",
        description="Serve a model over HTTP: /generate (SGLang-native), /v1/completions and "
        "/v1/chat/completions (OpenAI), /health, /metrics.",
    )
    ServerArgs.add_cli_args(serve)

    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt with the offline Engine and print it",
        description="Generate text for one prompt with the offline Engine (no HTTP) and print it.",
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as is, not as a user turn in the model's chat template",
    )
    gen.add_argument("--max-new-tokens", type=int, default=128, help="(default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    gen.add_argument("--top-p", type=float, default=None, help="(default: 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help="(default: -1, off)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument(
        "--json", action="store_true",
        help="print the whole output (text, output_ids, meta_info) as JSON once it is done "
        "(with --stream too)",
    )
    ServerArgs.add_cli_args(gen, serve=False, log_level="warning")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        print(f"plait {ns.command}: {e}", file=sys.stderr)
        return 2
    try:
        if ns.command == "serve" and (args.dp_size > 1 or args.router):
            from plait.server.replicas import launch_replicas

            return launch_replicas(args)
        if ns.command == "serve":
            from plait.server.http_server import launch_server

            launch_server(args)
            return 0
        return generate(ns, args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError) as e:  # the model or a child failed to start
        if args.log_level == "debug":
            raise
        print(f"plait {ns.command}: {e}", file=sys.stderr)
        return 1


def generate(ns: argparse.Namespace, args: ServerArgs) -> int:
    import dataclasses

    from plait.engine import Engine

    sampling = {
        "max_new_tokens": ns.max_new_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "seed": ns.seed,
        "stop": ns.stop,
    }
    sampling = {k: v for k, v in sampling.items() if v is not None}
    try:
        from plait.sampling import SamplingParams

        SamplingParams.from_dict(sampling)
    except ValueError as e:
        print(f"plait generate: {e}", file=sys.stderr)
        return 2
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    with Engine(**fields) as engine:
        prompt = ns.prompt if ns.raw else chat_prompt(engine.tokenizer, ns.prompt)
        if ns.stream and not ns.json:
            for chunk in engine.generate(prompt, sampling, stream=True):
                print(chunk["text"], end="", flush=True)
            print()
            return 0
        out = engine.generate(prompt, sampling)
    print(json.dumps(out, indent=2) if ns.json else out["text"])
    return 0


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as a user turn in the tokenizer's chat template, ready for the answer; the text
    itself when the model has no template (a base model)."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


if __name__ == "__main__":
    sys.exit(main())
