"""Where does a decode step's time go? T(b, q) of the forward alone, then a profile of engine
steps. Usage: python3 scripts/device_profile.py MODEL.gguf"""

import cProfile
import pstats
import sys
import time

import torch

from tandem.data import bundled_spec_bench, load_prompts, round_robin_by_category
from tandem.engine import Engine
from tandem.models.runner import default_runner_config
from tandem.sampling import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else None
engine = Engine(model, default_runner_config(max_batch_size=128, max_seq_len=2048))
r = engine.runner
print("T(b, q) ms, context 512 (forward incl. host-side step overhead):")
for b in (1, 16, 64, 128):
    row = [f"{r.measure_step_ms(b, q, 512):.3f}" for q in (1, 2, 4, 5, 8)]
    print(f"  b={b:4d}  q=1,2,4,5,8: {' '.join(row)}")
recs = round_robin_by_category(load_prompts(bundled_spec_bench()), 32)
params = SamplingParams(max_tokens=128)
for b in (1, 16):
    engine.max_running = b
    engine.generate([x.text for x in recs[:max(2 * b, 4)]], params)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    res = engine.generate([x.text for x in recs[:max(2 * b, 4)]], params)
    prof.disable()
    wall = time.perf_counter() - t0
    n = sum(x.completion_tokens for x in res)
    print(f"\nbatch {b}: {n} tokens in {wall:.2f} s = {n / wall:.0f} tok/s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
engine.max_running = 16
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    engine.generate([x.text for x in recs[:16]], SamplingParams(max_tokens=32))
print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
