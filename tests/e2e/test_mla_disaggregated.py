"""A DeepSeek (MLA) model disaggregated over real processes: the core streams latent KV chunks (one
latent vector per token per layer), the edge writes them into its latent cache and decodes; lossless
equals single node, with one core process and with a TP=2 core (whose replicated latent is sent once)."""

import shutil

import pytest

from edgecore.shared.models.config import ModelConfig
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import MODEL_DIR, make_engine
from tests.e2e.procs import get_json, metric, post_json, start_core, start_edge
from tests.shared.deepseek_checkpoints import deepseek_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    path, _ = deepseek_checkpoint(tmp_path_factory.mktemp("mla"), "v3-qlora-yarn-grouped", vocab_size=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):       # the bundled model's tokenizer: text prompts
        shutil.copy(MODEL_DIR / name, path / name)
    return path


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_lossless_disaggregated_equals_single_node(mla_dir, secret_file, tokenizer, heldout, tp):
    core, port, core_http = start_core(secret_file, "--model", str(mla_dir), "--tp", str(tp))
    edge, http = start_edge("--model", str(mla_dir), "--local-prefill-below", "0", "--codec", "lossless",
                            cores=[port], secret_file=secret_file)
    try:
        ids = tokenizer.encode(heldout)
        prompts = [ids[i * 100: i * 100 + n] for i, n in enumerate((7, 60, 300))]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        ref = make_engine(mla_dir).generate(prompts, params)
        for p, r in zip(prompts, ref):
            out = post_json(f"http://127.0.0.1:{http}/v1/completions",
                            {"prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
            assert out["choices"][0]["text"] == r["text"], f"prompt of {len(p)} tokens"
        assert metric(http, 'edgecore:remote_prefills_total{codec="lossless"') == 3    # no local fallback
        config = ModelConfig.from_dir(mla_dir)
        latent = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
        received = metric(http, 'edgecore:kv_raw_bytes_received_total{codec="lossless"')
        sent = metric(core_http, 'edgecore:core_kv_raw_bytes_total{codec="lossless"')
        # One latent vector per token per layer (fp32 on CPU), sent once: by rank 0 even at TP=2.
        assert received == sent == sum(map(len, prompts)) * config.num_hidden_layers * latent * 4
        assert get_json(f"http://127.0.0.1:{http}/stats")["cores"][0]["stream_connections"] == 0
    finally:
        edge.stop()
        core.stop()
