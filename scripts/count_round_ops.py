"""Count the operations a chained decode round dispatches, on a CPU, by part of the round.

A round's CUDA graph holds one kernel per dispatched PyTorch operation (views aside) and per Triton
launch, so counting what a round dispatches on a CPU counts the kernels its graph would hold on a
GPU, part by part: the input patch (``RoundState.feed`` with the drafter's lookup), the forward,
and the epilogue (verification, the round-state update, the SpecFormer head, the pack). Run the
bundled model on the CPU with ``--round-kernels triton`` (Triton's interpreter runs the lookup
and greedy-verify kernels as a GPU would, and the fused kernels with ``--kernels fused``) or
``plain`` (the PyTorch ops they replace). Operations the interpreter itself adds to hand tensors to
NumPy (``empty``, ``set_``, ``copy_`` around a launch) are not counted: on a GPU they do not exist
(which leaves out the round's few real copies too). Prints one line per configuration:

    python3 scripts/count_round_ops.py --configs target,ngram,specformer --round-kernels plain
    python3 scripts/count_round_ops.py --configs target,ngram,specformer --round-kernels triton
    python3 scripts/count_round_ops.py --lookup
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before torch/triton load: the CPU runs the Triton kernels

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# the interpreter's marshalling around a launch, and the round's own copies (not told apart here)
NOT_COUNTED = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
               "aten.new_empty.default", "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
               "aten.copy_.default"}
PROMPTS = ["Write a story about a cat and a dog who live in the city.", "List the prime numbers below 50 and explain why.",
           "What is the capital of France? Answer in a sentence.", "Translate to German: the house is red and the sky is blue."]


class OpCounter(TorchDispatchMode):
    """Counts dispatched operations (views aside) and Triton launches by the part of the round set in ``part``."""

    def __init__(self) -> None:
        super().__init__()
        self.part = "other"
        self.names: collections.Counter = collections.Counter()  # (part, operation) -> count

    def add(self, name: str) -> None:
        self.names[self.part, name] += 1

    def by_part(self) -> collections.Counter:
        """Operations counted per part of the round."""
        parts: collections.Counter = collections.Counter()
        for (part, _), n in self.names.items():
            parts[part] += n
        return parts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func) not in NOT_COUNTED:
            self.add(str(func))
        return func(*args, **(kwargs or {}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="target,ngram,specformer")
    ap.add_argument("--round-kernels", choices=("plain", "triton"), default="plain")
    ap.add_argument("--kernels", default="reference", help="RunnerConfig.kernels (fused: the fused layer, slowly)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--detail", action="store_true", help="also list each part's operations, most frequent first")
    ap.add_argument("--lookup", action="store_true",
                    help="count one plain lookup_drafts and lookup_drafts_with_support call (batch 4, width 4) instead")
    args = ap.parse_args()
    if args.lookup:
        from tandem.drafters.lookup import lookup_drafts, lookup_drafts_with_support

        history, last = torch.randint(0, 5, (4, 100)), torch.tensor([50, 60, 70, 99])
        room = torch.full_like(last, 4)
        for fn in (lookup_drafts, lookup_drafts_with_support):
            counter = OpCounter()
            with counter:
                fn(history, last, room, 4, kernel=False)
            print(f"{fn.__name__} in plain ops: {sum(counter.names.values())} operations")
        return 0

    import triton.runtime.interpreter as interpreter

    import tandem.models.runner as runner_mod
    from tandem import target as target_mod
    from tandem.drafters import lookup
    from tandem.models.runner import RunnerConfig
    from tandem.models.weights import default_model_path, load_checkpoint
    from tandem.sampling import SamplingParams
    from tandem.speculation import SpeculativeConfig, build_engine

    counter = OpCounter()
    launch = interpreter.GridExecutor.__call__

    def counted_launch(self, *a, **kw):
        counter.add(f"triton.{getattr(self.fn, '__name__', type(self.fn).__name__)}")
        return launch(self, *a, **kw)

    interpreter.GridExecutor.__call__ = counted_launch
    triton = args.round_kernels == "triton"  # the GPU's default choices, on this CPU
    lookup._on_kernel = lambda history, kernel: kernel if kernel is not None else triton
    target_mod._greedy_on_kernel = lambda s, device: triton and not s.any_sampled and s.adjust is None \
        and s.allowed is None
    step_fn = runner_mod.ModelRunner._step_fn

    def parted_step_fn(self, n, q, attn_len, patch=None, epilogue=None, forward=None):
        forward = forward or self._forward

        def part(name, fn):
            def run(*a, **kw):
                counter.part = name
                try:
                    return fn(*a, **kw)
                finally:
                    counter.part = "forward" if name == "patch" else "other"
            return run
        return step_fn(self, n, q, attn_len, part("patch", patch) if patch else None,
                       part("epilogue", epilogue) if epilogue else None, forward=part("forward", forward))

    runner_mod.ModelRunner._step_fn = parted_step_fn
    ck = load_checkpoint(str(default_model_path()))
    for drafter in args.configs.split(","):
        spec = SpeculativeConfig(drafter="none" if drafter == "target" else drafter, num_draft_tokens=4)
        engine = build_engine(spec, ck, RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=256,
                                                     kernels=args.kernels))
        for p in PROMPTS:
            engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(3):  # admission and the first rounds
            engine.step()
        counter.names.clear()
        with counter:
            for _ in range(args.rounds):
                engine.step()
        per = {k: round(v / args.rounds, 1) for k, v in sorted(counter.by_part().items())}
        outside = per.get("patch", 0) + per.get("epilogue", 0)
        print(f"{drafter}: round kernels {args.round_kernels}, kernels {engine.runner.kernels}: {per}; "
              f"outside the forward {outside:g} a round", flush=True)
        if args.detail:
            for (part, name), n in sorted(counter.names.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
                print(f"  {part:9s} {n / args.rounds:6.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
