"""Put a drafter's measured Spec-Bench acceptance into its model card (card.json + README.md),
from a `tandem replay --out` JSON (exact greedy replay on all prompts) or a `tandem bench` run.

Usage: python scripts/card_add_measurement.py WEIGHTS_DIR REPLAY_JSON DRAFTER_SPEC "HOW MEASURED"
"""
import json
import sys
from pathlib import Path

from tandem.train.card import model_card

out, replay_json, spec, how = sys.argv[1:5]
rep = json.loads(Path(replay_json).read_text())
r = rep["drafters"][spec]
card_file = Path(out) / "card.json"
card = json.loads(card_file.read_text())
card["spec_bench"] = {"prompts": rep["prompts"], "max_tokens": 256, "num_draft_tokens": r["k"], "overall": r["overall"],
                      "per_category": r["per_category"], "method": how}
card_file.write_text(json.dumps(card, indent=2))
(Path(out) / "README.md").write_text(model_card(card))
print(spec, r["overall"]["acceptance_rate"], r["overall"]["mean_accepted_length"])
