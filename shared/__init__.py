"""What both node kinds run (the name means shared by core and edge, not "utilities"):

- the engine: `engine/` (LLMEngine, scheduler, sampler, the typed `EngineHandle` and its in-thread
  `AsyncEngine`), `kv/` (paged KV pool, prefix cache, KV slices for transfer), `parallel.py`;
- models: `models/` (families), `config.py`, `weights.py` (checkpoint reading), `pack/` (lossless packing);
- text and API: `tokenizer.py`, `token_bytes.py`, `openai/` (request parsing, responses, errors, routes);
- node plumbing: `settings.py` and `node_settings.py` (settings defined once), `secrets.py`, `link_auth.py`,
  `tls.py`, `http_server.py`, `metrics.py`, `service.py`, `env.py`, `malloc.py`, `log_budget.py`, `cli.py`.

shared/ imports protocol/ but never core/, edge/ or deploy/ (tests/test_layering.py).
"""
