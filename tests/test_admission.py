"""Admission batching (``Engine._admission_due``): while requests run, a prefill waits for a share
of the slots to be free or for its oldest request to have waited a few rounds; outputs do not
depend on it."""

from __future__ import annotations

import pytest
from test_chained import PROMPTS

from tandem.engine import Engine
from tandem.models.runner import RunnerConfig
from tandem.sampling import SamplingParams


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint):
    return str(tiny_checkpoint("llama", with_tokenizer=True))


def _run(target_dir: str, share: float, chained: bool, wait: int = 1000) -> tuple[list[list[int]], list[int]]:
    engine = Engine(target_dir, RunnerConfig(device="cpu", max_batch_size=16, max_seq_len=96))
    if not chained:
        engine.target.chains_rounds = False
    engine.admission_share, engine.admission_wait_rounds = share, wait
    sizes: list[int] = []
    launch = engine.target.launch_prefill
    engine.target.launch_prefill = lambda items: sizes.append(len(items)) or launch(items)
    prompts = (PROMPTS * 5)[:40]
    params = [SamplingParams(max_tokens=3 + (7 * i) % 17, ignore_eos=True) for i in range(len(prompts))]
    return [c.token_ids for c in engine.generate(prompts, params)], sizes


def test_admission_waits_for_a_batch_of_free_slots(target_dir):
    """With 16 slots and a share of 1/4 (no wait limit), every prefill after the first admits at
    least 4 requests (the last: what is left of the queue) instead of one per freed slot, and the
    tokens equal those of immediate admission (share 0), chained and host-driven. With a share
    no freeing reaches (all 16 slots) the wait limit still admits the queue."""
    for chained in (True, False):
        want, single = _run(target_dir, 0.0, chained)
        got, batched = _run(target_dir, 0.25, chained)
        assert got == want
        assert sum(batched) == sum(single) == 40
        assert len(batched) < len(single)
        assert batched[0] == 16 and all(n >= 4 for n in batched[1:-1])
    want, _ = _run(target_dir, 0.0, True)
    got, waited = _run(target_dir, 1.0, True, wait=3)
    assert got == want and sum(waited) == 40 and len(waited) > 2
