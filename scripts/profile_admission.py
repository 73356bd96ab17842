"""Where an admission's host time goes: the prefill launch, a SpecFormer head's observe of the
prompts and its first drafts, and the rounds, timed on the host (no device sync added) over a
Spec-Bench run like `tandem bench`'s; then the same run with the device synchronised around each
call site, so CUDA events give each one's own GPU time (what an admission's GPU window is made
of); then the same run under cProfile (the host's Python
functions by own time: where a round's host work goes) and under torch.profiler, writing the
operator tables (by self CPU time and by CUDA time) of the admission calls only.

    python3 scripts/profile_admission.py MODEL OUT_DIR [--drafter specformer] [--batch-size 64] [--limit 384]

A warm-up pass over the same prompts first (every CUDA graph captured), then the timed pass, then
the profiled pass. Prints one line per call site: calls, mean host ms, total s.
"""
import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tandem.bench.spec_bench import bench_prompts
from tandem.data import bundled_spec_bench, load_prompts
from tandem.models.runner import default_runner_config
from tandem.models.weights import load_checkpoint
from tandem.sampling import SamplingParams
from tandem.speculation import SpeculativeConfig, build_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--drafter", default="specformer")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--limit", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prefill-graphs", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = a.device.startswith("cuda")
    cfg = default_runner_config(a.device, max_batch_size=a.batch_size, compile=False,
                                prefill_graphs=bool(a.prefill_graphs) and cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = build_engine(SpeculativeConfig(drafter=a.drafter), load_checkpoint(a.model), cfg)
    prompts = [r.text for r in bench_prompts(load_prompts(bundled_spec_bench()), a.batch_size, a.limit)]
    params = SamplingParams(max_tokens=a.max_tokens)
    times: dict[str, list[float]] = defaultdict(list)
    gpu: dict[str, list[float]] = defaultdict(list)
    recording = [False]
    fenced = [False]  # synchronise around each call and time its device work with events

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if fenced[0] and cuda:
                sync()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                res = fn(*args, **kwargs)
                end.record()
                sync()
                gpu[label].append(start.elapsed_time(end))
                return res
            t0 = time.perf_counter()
            with record_function(label) if recording[0] else nullcontext():
                res = fn(*args, **kwargs)
            times[label].append(time.perf_counter() - t0)
            return res
        setattr(obj, name, timed)

    wrap(engine.target, "launch_prefill", "admission.launch_prefill")
    wrap(engine.target, "prime_drafts", "admission.prime_drafts")
    wrap(engine.target, "launch_chained", "round.launch_chained")
    wrap(engine.target, "collect", "round.collect")
    wrap(engine, "_finish", "round.finish")
    if engine.drafter is not None:
        wrap(engine.drafter, "observe", "admission.observe")
    engine.generate(prompts, params)  # warm-up
    times.clear()
    sync()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t0
    lines = [f"{a.drafter} b{a.batch_size}, {len(prompts)} prompts, prefill graphs {bool(a.prefill_graphs)}: "
             f"timed pass {wall:.3f} s"]
    for label, ts in sorted(times.items()):
        lines.append(f"  {label:28s} calls {len(ts):5d}  mean {1e3 * sum(ts) / len(ts):7.2f} ms  total {sum(ts):6.3f} s")
    times.clear()
    if cuda:
        fenced[0] = True
        engine.generate(prompts, params)
        fenced[0] = False
        lines.append("  GPU time per call, the device synchronised around each (ms; rounds serialised too):")
        for label, ts in sorted(gpu.items()):
            lines.append(f"  {label:28s} calls {len(ts):5d}  mean {sum(ts) / len(ts):7.2f} ms  total {1e-3 * sum(ts):6.3f} s")
    host = cProfile.Profile()
    host.enable()
    engine.generate(prompts, params)
    sync()
    host.disable()
    buf = io.StringIO()
    pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(45)
    name = f"admission-{a.drafter}-b{a.batch_size}"
    (out / f"{name}-host.txt").write_text(buf.getvalue())
    times.clear()
    recording[0] = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        sync()
    averages = prof.key_averages(group_by_input_shape=False)
    (out / f"{name}.txt").write_text(
        "\n".join(lines) + "\n\nby self CPU time\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
        + "\n\nby CUDA time\n" + averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
