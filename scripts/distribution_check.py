"""How far the self-distilled training answers are from Spec-Bench's target outputs, and what a
SpecFormer head's mean accepted length is on each (exact greedy replay, ``tandem.bench.replay``).

Prints (1) the share of answer tokens that close an 8-gram already seen earlier in the same answer
(repetition loops) in the distilled answers, in their first CUT tokens and in the Spec-Bench traces,
and (2) for each head, tau_acc by replay on N distilled answers (cut to CUT tokens; these are
mostly answers the head was trained on) and on N Spec-Bench traces. CPU float32 works (minutes).

Usage: python scripts/distribution_check.py DISTILL_DIR TRACES_JSONL N CUT HEAD_DIR [HEAD_DIR ...]
"""
import sys

import numpy as np
import torch

from tandem.bench.replay import GreedyTrace, load_traces, replay, specformer_drafts
from tandem.models.specformer import load_specformer
from tandem.models.transformer import Transformer
from tandem.models.weights import default_model_path, load_checkpoint
from tandem.train.distill import read_distilled


def repeated_share(answers, n: int = 8) -> float:
    rep = total = 0
    for a in answers:
        seen = set()
        for i in range(n, len(a) + 1):
            g = tuple(a[i - n:i])
            rep += g in seen
            seen.add(g)
        total += max(0, len(a) - n + 1)
    return rep / max(total, 1)


def tau(head, target, traces) -> float:
    with torch.inference_mode():
        drafts = specformer_drafts(head, target, traces, batch_tokens=8192)
    return replay(traces, drafts, head.config.num_draft_tokens)[0]["mean_accepted_length"]


def main() -> None:
    distill_dir, traces_file, n, cut, heads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
    ck = load_checkpoint(str(default_model_path()))
    _, seqs = read_distilled(distill_dir)
    answers = [list(s.tokens[s.prompt_len:]) for s in seqs]
    bench = load_traces(traces_file, ck.config.vocab_size)
    print(f"repeated 8-gram share: distilled {repeated_share(answers):.3f}, distilled first {cut} "
          f"{repeated_share([a[:cut] for a in answers]):.3f}, Spec-Bench {repeated_share([t.output_ids for t in bench]):.3f}; "
          f"distilled tokens past {cut}: {sum(max(0, len(a) - cut) for a in answers) / sum(map(len, answers)):.3f}")
    rng = np.random.default_rng(5)
    picked = [seqs[i] for i in rng.permutation(len(seqs))[:n]]
    distilled = [GreedyTrace("", [int(x) for x in s.tokens[:s.prompt_len]], [int(x) for x in s.tokens[s.prompt_len:]][:cut],
                             cut) for s in picked]
    sample = [bench[i] for i in rng.permutation(len(bench))[:n]]
    target = Transformer(ck.config, 4096)
    target.load_weights(ck.tensors)
    target.eval()
    for path in heads:
        head = load_specformer(path).eval()
        print(f"{path}: tau_acc distilled (first {cut} tokens, {n} answers) {tau(head, target, distilled):.2f}; "
              f"Spec-Bench ({n} traces) {tau(head, target, sample):.2f}")


if __name__ == "__main__":
    main()
