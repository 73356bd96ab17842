"""Target-only decoding throughput: our engine vs Hugging Face ``generate`` on the same prompts.

Metrics follow ARCHITECTURE.md §4: TPS (output tokens per second for the whole batch), TTFT and
TPOT percentiles per request.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..data import PromptRecord
from ..engine import Engine
from ..sampling import SamplingParams


@dataclass(frozen=True)
class ThroughputResult:
    """One (system, batch size) measurement.

    Attributes:
        system: "tandem" or "hf-generate".
        batch_size: requests decoded together (at most).
        prompts: prompts run; output_tokens: tokens generated in total.
        wall_s: wall time of the timed pass (s); tps: output_tokens / wall_s.
        ttft_p50_ms, tpot_p50_ms, tpot_p99_ms: per-request latency percentiles (ms; NaN for HF).
        peak_mem_gib: peak GPU memory (GiB; 0 on CPU).
    """

    system: str
    batch_size: int
    prompts: int
    output_tokens: int
    wall_s: float
    tps: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    peak_mem_gib: float

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _peak_mem(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def bench_engine(engine: Engine, records: list[PromptRecord], batch_size: int, max_tokens: int,
                 warmup: bool = True) -> tuple[ThroughputResult, list[list[int]]]:
    """Greedy target-only decoding of ``records`` with at most ``batch_size`` running requests.

    A warm-up pass over the same prompts (compiles and captures every CUDA graph shape the timed
    pass will use) precedes the timed pass when ``warmup`` is true.

    Returns:
        The measurement and the generated token ids per prompt (for lossless checks).
    """
    engine.max_running = batch_size
    params = SamplingParams(max_tokens=max_tokens)
    texts = [r.text for r in records]
    if warmup:
        engine.generate(texts, params)
    dev = engine.runner.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    results = engine.generate(texts, params)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    total = sum(r.completion_tokens for r in results)
    tpots = [r.tpot_s * 1e3 for r in results if r.completion_tokens > 1]
    res = ThroughputResult("tandem", batch_size, len(records), total, wall, total / wall,
                           statistics.median(r.ttft_s * 1e3 for r in results), _pct(tpots, 0.5), _pct(tpots, 0.99),
                           _peak_mem(dev))
    return res, [r.token_ids for r in results]


_HF_MODELS: dict[int, object] = {}


def _hf_model(engine: Engine):
    """The HF transformers model for ``engine``'s checkpoint, device and dtype (loaded once)."""
    if id(engine) not in _HF_MODELS:
        from transformers import AutoModelForCausalLM

        ck = engine.checkpoint
        kwargs = {"gguf_file": ck.path.name} if ck.is_gguf else {}
        src = str(ck.path.parent if ck.is_gguf else ck.path)
        _HF_MODELS[id(engine)] = AutoModelForCausalLM.from_pretrained(
            src, dtype=engine.runner_config.dtype, **kwargs).to(engine.runner.device).eval()
    return _HF_MODELS[id(engine)]


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

    def run() -> list[list[int]]:
        outs: list[list[int]] = []
        for lo in range(0, len(encoded), batch_size):
            batch = encoded[lo:lo + batch_size]
            width = max(len(e) for e in batch)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in batch], device=dev)
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in batch], device=dev)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
            for row in out[:, width:].tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                outs.append(row[:cut])
        return outs

    run() if len(encoded) <= batch_size else None  # warm-up (small runs only: HF is slow)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    outs = run()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    total = sum(len(o) for o in outs)
    name = "hf-prompt-lookup" if prompt_lookup else "hf-generate"
    nan = float("nan")
    return ThroughputResult(name, batch_size, len(records), total, wall, total / wall, nan, nan, nan,
                            _peak_mem(dev)), outs
