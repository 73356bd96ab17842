"""Profile SpecFormer rounds at batch 1 (torch.profiler, CPU + CUDA): where a round's time goes.
   python3 scripts/profile_round.py MODEL HEAD OUT_DIR"""
import sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from tandem.cli.common import _engine
from tandem.speculation import SpeculativeConfig
from tandem.sampling import SamplingParams

model, head, out = sys.argv[1:4]
prompt = "Explain how a transformer language model generates text, step by step."
for kind, path in (("none", None), ("specformer", head)):
    eng = _engine(model, None, 1, 2048, SpeculativeConfig(kind, draft_model=path, num_draft_tokens=4))
    p = SamplingParams(max_tokens=128, ignore_eos=True)
    eng.generate([prompt], p)  # warm-up (graph capture)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    c = eng.generate([prompt], p)[0]
    torch.cuda.synchronize(); dt = time.perf_counter() - t0
    steps = getattr(c.spec, "num_steps", 0) or len(c.token_ids)
    print(f"{kind}: {len(c.token_ids)} tokens in {dt * 1e3:.0f} ms, {steps} rounds, {dt * 1e3 / max(steps, 1):.2f} ms/round", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.generate([prompt], p)
    tab = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    open(f"{out}/profile-{kind}.txt", "w").write(tab)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
