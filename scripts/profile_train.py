"""Profile SpecFormer training steps (torch.profiler, CPU + CUDA): where a step's time goes.

Starts from a trained head (its config gives the shape; e.g. the shipped one), the distilled data
and the target, with the loss of `tandem train specformer --soft-labels W`; times STEPS optimiser
steps after WARMUP unprofiled ones (wall clock, synchronised), then profiles PROFILED more and
writes the operator tables (by CUDA and by CPU time) to OUT_DIR/profile-train-*.txt.

    python3 scripts/profile_train.py MODEL DATA_DIR HEAD_DIR OUT_DIR [--batch-tokens 16384] [--soft-labels 0.5]
"""
import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("head")
    ap.add_argument("out")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--soft-labels", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profiled", type=int, default=5)
    a = ap.parse_args()

    from tandem.models.specformer import load_specformer
    from tandem.train.loop import iter_batches
    from tandem.train.run import load_train_target
    from tandem.train.specformer import SpecFormerObjective

    t = load_train_target(a.model, None, a.data)
    target, seqs, amp, rcfg = t.model, t.sequences, t.amp, t.runner_config
    head = load_specformer(a.head).to(rcfg.device).train()
    objective = SpecFormerObjective(head, target, amp, a.soft_labels)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-5)
    batches = iter_batches(seqs, a.batch_tokens, np.random.default_rng([0, 0]), 1536, None)
    cuda = rcfg.device.startswith("cuda")

    def step() -> None:
        with record_function("batch"):
            batch = next(batches)
        with record_function("loss"):
            loss, _ = objective(batch)
        with record_function("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
        float(loss.detach())  # the training loop reads the loss every step

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / a.steps
    print(f"{ms:.1f} ms/step ({1e3 / ms:.2f} steps/s) over {a.steps} steps, {a.batch_tokens} padded tokens/batch",
          flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(a.profiled):
            step()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for key in (["cuda_time_total"] if cuda else []) + ["cpu_time_total"]:
        table = prof.key_averages().table(sort_by=key, row_limit=40)
        (out / f"profile-train-{key.split('_')[0]}.txt").write_text(table)
        print(prof.key_averages().table(sort_by=key, row_limit=12), flush=True)


if __name__ == "__main__":
    main()
