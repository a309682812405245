"""The glibc heap settings: a repeated prefill step reuses heap pages instead of faulting in new ones."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import resource, torch
from edgecore.shared.config import CacheConfig, EngineConfig
from edgecore.shared.engine.engine import LLMEngine
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.malloc import retain_freed_memory
engine = LLMEngine.from_dir("models/pydoc-llama", "fp32", "cpu", CacheConfig(num_blocks=1024),
                            EngineConfig(max_num_batched_tokens=2048))
gen = torch.Generator().manual_seed(0)
faults = []
for step in range(4):                  # each step prefills 16 new prompts of 128 tokens
    for i, prompt in enumerate(torch.randint(3, 2048, (16, 128), generator=gen).tolist()):
        engine.add_request(f"{step}-{i}", prompt, SamplingParams(max_tokens=1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(retain_freed_memory(), max(faults[1:]))
"""


def later_step_faults(setting: str) -> tuple[str, int]:
    env = dict(os.environ, EDGECORE_CPU_MALLOC=setting)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc setting")
def test_repeated_prefill_reuses_heap_pages():
    applied, tuned = later_step_faults("1")
    assert applied == "True"
    # A step's activations are ~64 MiB, 16k pages when faulted in anew; with the setting a later step
    # faults almost none (a few thousand at most, when an aligned block cannot reuse a freed one).
    assert tuned < 4000
    applied, default = later_step_faults("0")
    assert applied == "False"
    assert default > 5 * max(tuned, 100)


TRIM_PROBE = """
import torch
from edgecore.shared.malloc import retain_freed_memory, return_free_memory
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024
print(retain_freed_memory())
burst = [torch.ones(2 << 20) for _ in range(40)]      # 40 x 8 MiB from the heap (under the mmap threshold)
del burst
kept = rss_mib()
return_free_memory()
print(kept - rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc setting")
def test_an_idle_engine_can_give_a_burst_back():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) > 200          # of the burst's 320 MiB kept after it, most goes back
