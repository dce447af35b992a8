"""Hugging Face interop, the engine-neutral half.

- :mod:`.config`: HF ``config.json`` <-> :class:`~primus.core.config.schema.ModelConfig` (Llama 3.x, Qwen2.5,
  Qwen3, Mistral: RoPE scaling, tied embeddings, qkv bias, qk-norm).
- :mod:`.safetensors_io`: reading a HF folder (one file or shards + ``model.safetensors.index.json``) lazily, and
  writing one (sharded safetensors, index, ``config.json``, tokenizer files).
- :mod:`.contract`: the HF tensor names every backend maps from and to, and the interface a backend's
  importer/exporter implements (:class:`~primus.core.hf.contract.HFInterop`, named by ``BackendSpec.hf``).

Nothing here imports torch at module import time, nor any engine, nor ``transformers``.
"""
