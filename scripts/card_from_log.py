"""Rebuild a shipped drafter's model card (card.json + README.md) from its training log (tqdm
progress: steps, elapsed time, per-step loss), the distillation manifest and, optionally, a
Spec-Bench evaluation written by scripts/device_eval.py. Used when a device call's time box cut
`tandem train` after the weights were saved but before it wrote the card itself.

Usage: python scripts/card_from_log.py WEIGHTS_DIR KIND TRAIN_LOG DISTILL_DIR "COMMAND" LR [EVAL_JSON]
"""
import json
import re
import sys

import numpy as np
from safetensors import safe_open

from tandem.train.card import model_card
from tandem.train.distill import DistillManifest

out, kind, log, distill_dir, command, lr = sys.argv[1:7]
eval_json = sys.argv[7] if len(sys.argv) > 7 else None
steps, elapsed = {}, 0.0
for line in open(log).read().replace("\r", "\n").split("\n"):
    m = re.search(r"\|\s*(\d+)/(\d+) \[(\d+):(\d+)<.*loss=([\d.]+)", line)
    if m:
        steps[int(m.group(1))] = float(m.group(5))
        elapsed = max(elapsed, 60 * int(m.group(3)) + int(m.group(4)))
losses = [steps[k] for k in sorted(steps)]
window = max(1, len(losses) // 10)
manifest = DistillManifest.load(distill_dir)
with safe_open(f"{out}/model.safetensors", "pt") as f:
    meta = f.metadata()
extra = json.loads(meta["config"]) if "config" in meta else {"init_layers": json.loads(meta["init_layers"])}
report = None
if eval_json:
    ev = json.load(open(eval_json))
    report = {"prompts": ev["prompts"], "max_tokens": 256, "num_draft_tokens": ev["k"], "overall": ev["overall"],
              "per_category": ev["per_category"]}
card = {"kind": kind, "command": command,
        "data": {"answers": len(manifest.records), "answer_tokens": sum(r.answer_len for r in manifest.records),
                 "target": manifest.target, "settings": manifest.settings},
        "training": {"lr": float(lr), "warmup_frac": 0.03, "max_batch_tokens": 16384, "seed": 0, "steps": max(steps),
                     "wall_s": elapsed, "first_loss": float(np.mean(losses[:window])),
                     "final_loss": float(np.mean(losses[-window:])), "metrics": {}, "log": log},
        "extra": extra, "spec_bench": report}
json.dump(card, open(f"{out}/card.json", "w"), indent=2)
open(f"{out}/README.md", "w").write(model_card(card))
print(kind, card["training"]["steps"], elapsed, card["training"]["first_loss"], card["training"]["final_loss"])
