"""Models: where a checkpoint comes from and how it becomes a torch module.

    resolve.py   name or path -> a Hugging Face checkpoint directory (no torch import)
    embedded.py  the deterministic random test checkpoints (plait-tiny, tiny-*, bench-large)
    named.py     named real models fetched from the package registry (smollm2-135m-instruct)
    gguf.py      a GGUF file -> a cached Hugging Face checkpoint directory
    cache.py     plait's cache directory and atomic directory creation
    registry.py  architecture name -> model class (the leaf the model files register in)
    config.py    ModelConfig, normalised from config.json
    weights.py   safetensors -> the model's (fused) parameters
    llama.py     the Llama-family decoder
"""
