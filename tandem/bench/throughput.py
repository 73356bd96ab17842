"""Outside reference: Hugging Face ``generate`` (greedy or prompt lookup) on our engine's checkpoint.

TPS as docs/architecture.md ("Metrics") defines it (output tokens per second for the whole batch); HF does not
expose per-request latency or acceptance counts.
"""

from __future__ import annotations

import math

import time
from dataclasses import asdict, dataclass

import torch

from ..data import PromptRecord
from ..engine import Engine


@dataclass(frozen=True)
class ThroughputResult:
    """One HF ``generate`` measurement.

    Attributes:
        system: "hf-generate" or "hf-prompt-lookup".
        batch_size: prompts per ``generate`` call (left-padded).
        prompts: prompts run; output_tokens: tokens generated in total (cut after EOS).
        wall_s: wall time of the timed pass (s); tps: output_tokens / wall_s.
        peak_mem_gib: peak GPU memory (GiB; NaN on CPU, where it is not measured).
    """

    system: str
    batch_size: int
    prompts: int
    output_tokens: int
    wall_s: float
    tps: float
    peak_mem_gib: float

    def to_dict(self) -> dict:
        return asdict(self)


def _peak_mem(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan


_HF_MODELS: dict[tuple, object] = {}


def _hf_model(engine: Engine):
    """The HF transformers model for ``engine``'s checkpoint, device and dtype (loaded once)."""
    ck = engine.checkpoint
    key = (str(ck.path), str(engine.runner.device), engine.runner_config.dtype)
    if key not in _HF_MODELS:
        from transformers import AutoModelForCausalLM

        kwargs = {"gguf_file": ck.path.name} if ck.is_gguf else {}
        src = str(ck.path.parent if ck.is_gguf else ck.path)
        _HF_MODELS.clear()  # one reference model at a time
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(
            src, dtype=engine.runner_config.dtype, **kwargs).to(engine.runner.device).eval()
    return _HF_MODELS[key]


def bench_hf_generate(engine: Engine, records: list[PromptRecord], batch_size: int, max_tokens: int,
                      prompt_lookup: int = 0) -> tuple[ThroughputResult, list[list[int]]]:
    """Hugging Face ``generate`` (greedy; prompt-lookup decoding when ``prompt_lookup`` > 0) on the
    same checkpoint, device and dtype as ``engine``, batches of ``batch_size`` left-padded prompts.
    """
    model = _hf_model(engine)
    dev = engine.runner.device
    tok = engine.tokenizer.hf
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    eos = list(engine.tokenizer.eos_token_ids)
    encoded = [engine.encode_prompt(r.text) for r in records]
    gen_kwargs = dict(do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    if prompt_lookup:
        gen_kwargs["prompt_lookup_num_tokens"] = prompt_lookup

    def run(prompts: list[list[int]]) -> list[list[int]]:
        outs: list[list[int]] = []
        for lo in range(0, len(prompts), batch_size):
            batch = prompts[lo:lo + batch_size]
            width = max(len(e) for e in batch)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in batch], device=dev)
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in batch], device=dev)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
            for row in out[:, width:].tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                outs.append(row[:cut])
        return outs

    run(encoded[:batch_size])  # warm-up on the first batch (HF is slow; its eager kernels need no capture)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    outs = run(encoded)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    total = sum(len(o) for o in outs)
    name = "hf-prompt-lookup" if prompt_lookup else "hf-generate"
    return ThroughputResult(name, batch_size, len(records), total, wall, total / wall, _peak_mem(dev)), outs
