"""Host time of a round's grammar masks (structured output), batched against one request at a
time: n JSON-schema requests, each walking 4 drafts (5 masks), on the bundled model's tokenizer.

    .venv/bin/python scripts/mask_walk_timing.py   # prints one line per n (docs/architecture.md quotes it)
"""

from __future__ import annotations

import json
import time

from tandem.models import default_model_path, load_checkpoint
from tandem.structured import GrammarCompiler, Structure, batch_masks
from tandem.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "required": ["name", "age", "colours"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "colours": {"type": "array", "items": {"type": "string"}}}}
TEXT = '{"name": "Ann Smith", "age": 30, "colours": ["red", "blue", "green"]}'


def main() -> None:
    checkpoint = load_checkpoint(default_model_path())
    tokenizer = load_tokenizer(checkpoint)
    compiler = GrammarCompiler(tokenizer.hf, checkpoint.config.vocab_size, tokenizer.eos_token_ids)
    ids = tokenizer.encode(TEXT)
    batch_masks([(compiler.compile(Structure("json_schema", json.dumps(SCHEMA))), ids[:4])])  # warm-up
    for n in (1, 16, 64):
        grammars = [compiler.compile(Structure("json_schema", json.dumps(SCHEMA))) for _ in range(n)]
        for g in grammars:
            g.advance(ids[:5])
        drafts = ids[5:9]
        t = time.perf_counter()
        for _ in range(10):
            for g in grammars:
                batch_masks([(g, drafts)])
        one_by_one = (time.perf_counter() - t) / 10
        t = time.perf_counter()
        for _ in range(10):
            batch_masks([(g, drafts) for g in grammars])
        batched = (time.perf_counter() - t) / 10
        print(f"{n} requests x 5 masks: one by one {one_by_one * 1e3:.2f} ms, batched {batched * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
