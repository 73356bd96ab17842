"""How much prompt lookup adds to a SpecFormer head: exact greedy replay (float32, CPU or GPU) of
the committed Spec-Bench traces (480 prompts, max 256 new tokens, k = 4) with the head alone,
lookup alone, rule-based hand-offs between them, and the per-round better of the two (hindsight).

    .venv/bin/python scripts/lookup_handoff.py [HEAD_DIR] [--cache FILE] [--device cpu]

HEAD_DIR: a SpecFormer head (default: the shipped one). --cache: a pickle of the head's drafts
(written on first use, read afterwards; the teacher-forced pass takes ~15 min on 2 CPU cores).
The lookup rule is ``tandem.drafters.lookup``, read per row as ``--lookup-tokens`` heads read it
(``tandem.train.specformer.lookup_rows``).
"""
import argparse
import gzip
import json
import pickle
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1] / "docs/results/2026-12-01/drafters/spec-bench-traces.jsonl.gz"
K = 4


def head_drafts(path, traces, device):
    """Every position's head drafts ``[T, l_d]`` and their top-1 probabilities, per trace."""
    import torch

    from tandem.bench.replay import Replayer, _batches, _padded, load_drafter
    from tandem.models.weights import load_checkpoint
    from tandem.train.specformer import teacher_forced_states

    ck = load_checkpoint(None)
    replayer = Replayer(ck, traces, device, torch.float32)
    head = load_drafter("specformer", path, ck).to(device).eval()
    target = replayer._model(ck)
    ids_out, p_out = [None] * len(traces), [None] * len(traces)
    with torch.inference_mode():
        for idx in _batches(traces, 3000):  # [B*T, l_d, vocab] probabilities fit in a few GB
            tokens = _padded(traces, idx, device)
            B, T = tokens.shape
            probs = target.logits(target.norm(teacher_forced_states(head, target, tokens))).softmax(-1)
            p, ids = probs.max(-1)
            ids, p = ids.view(B, T, -1).cpu().numpy(), p.view(B, T, -1).cpu().numpy()
            for row, i in enumerate(idx):
                n = len(traces[i].tokens)
                ids_out[i], p_out[i] = ids[row, :n], p[row, :n]
    return ids_out, p_out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", nargs="?", default=None, help="SpecFormer head directory (default: the shipped head)")
    ap.add_argument("--cache", default=None, help="pickle of the head's drafts: written on first use, then read")
    ap.add_argument("--device", default="cpu", help="torch device of the teacher-forced pass")
    a = ap.parse_args()
    import torch

    from tandem.bench.replay import GreedyTrace, walk
    from tandem.metrics import SpecDecodeStats
    from tandem.train.specformer import lookup_rows

    traces = [GreedyTrace(**json.loads(line)) for line in gzip.open(TRACES, "rt")]
    if a.cache and Path(a.cache).is_file():
        sf_ids, _ = pickle.load(open(a.cache, "rb"))
    else:
        sf_ids, sf_p = head_drafts(a.head, traces, a.device)
        if a.cache:
            pickle.dump((sf_ids, sf_p), open(a.cache, "wb"))
    look = [lookup_rows(torch.tensor([t.tokens]), K) for t in traces]  # row p reads x[..p+1], as the head does

    def accepted(row, x, p):
        n = 0
        while n < len(row) and p + 2 + n < len(x) and row[n] == x[p + 2 + n]:
            n += 1
        return n

    def rule_head(p, room, sf, lk, x):
        return [int(v) for v in sf[p][:room]]

    def rule_lookup(p, room, sf, lk, x):
        return [int(v) for v in lk[0][p][:room] if v >= 0]

    def handoff(m, agree=False):
        def rule(p, room, sf, lk, x):
            use = lk[1][p] >= m or (agree and lk[1][p] >= 1 and lk[0][p][0] == sf[p][0])
            return rule_lookup(p, room, sf, lk, x) if use else rule_head(p, room, sf, lk, x)
        return rule

    def hindsight(p, room, sf, lk, x):
        a, b = rule_lookup(p, room, sf, lk, x), rule_head(p, room, sf, lk, x)
        return a if accepted(a, x, p) > accepted(b, x, p) else b

    rules = [("head alone", rule_head), ("lookup alone", rule_lookup)]
    rules += [(f"lookup if its match >= {m} tokens, else head", handoff(m)) for m in (1, 2, 3, 4)]
    rules += [("lookup if match >= 2, or >= 1 and it agrees with the head's first draft", handoff(2, True)),
              ("the better of the two per round (hindsight)", hindsight)]
    print(f"head {a.head or 'shipped'}; {len(traces)} Spec-Bench traces, k = {K}")
    print("| drafts | tau_acc | " + " | ".join(sorted({t.category for t in traces})) + " |")
    for name, rule in rules:
        total, cats = SpecDecodeStats(), {}
        for t, sf, lk in zip(traces, sf_ids, look):
            s = walk(t, lambda p, room, sf=sf, lk=lk, x=t.tokens: rule(p, room, sf, lk, x), K)
            total.merge(s)
            cats.setdefault(t.category, SpecDecodeStats()).merge(s)
        print(f"| {name} | {total.to_dict()['mean_accepted_length']:.2f} | "
              + " | ".join(f"{cats[c].to_dict()['mean_accepted_length']:.2f}" for c in sorted(cats)) + " |", flush=True)


if __name__ == "__main__":
    main()
