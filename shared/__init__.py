"""What both node kinds run (the name means shared by core and edge, not "utilities"):

- the engine: `engine/` (`LLMEngine`, scheduler, sampler, the typed `EngineHandle` and the `EngineThread` that
  runs an engine behind it), `kv/` (paged KV pool, prefix cache, disk tier, KV slices for transfer);
- models: `models/` (families, `config.py`, checkpoint reading `weights.py` and `gguf_file.py`, quantized
  weights, LoRA, the tensor/pipeline-parallel state `parallel.py`, the model `fingerprint.py`), `pack/`
  (lossless packing for shipping weights);
- text and API: `text/` (tokenizer, token bytes), `openai/` (request parsing, responses, errors, routes);
- node plumbing: `node/` (settings defined once, secrets, link credentials, TLS, HTTP server, metrics, tenants,
  tracing, environment, the CLI's common parts); `errors.py`, the exceptions a user can cause.

shared/ imports protocol/ but never core/, edge/ or deploy/ (tests/test_layering.py).
"""
