"""A ``tandem.v1.Router`` gRPC client that turns answers, streamed or whole (``final_only``), into
``Completion`` objects (what ``tandem bench --mode distributed`` measures), with at most N requests
in flight."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common import params_to_pb, traced_aio_channel
from services.proto.tandem.v1 import router_pb2, router_pb2_grpc
from tandem.data import PromptRecord
from tandem.engine import Completion
from tandem.metrics import SpecDecodeStats
from tandem.sampling import SamplingParams


async def _one(stub, record: PromptRecord, params: SamplingParams, sem: asyncio.Semaphore,
               timeout_s: float, final_only: bool, prompt_ids: list[int] | None) -> Completion:
    async with sem:
        prompt = ({"prompt_ids": prompt_ids} if prompt_ids is not None
                  else {"messages": [router_pb2.ChatMessage(role="user", content=record.text)]})
        req = router_pb2.GenerateRequest(**prompt, params=params_to_pb(params), category=record.category,
                                         final_only=final_only)
        t0 = time.perf_counter()
        ttft = None
        ids: list[int] = []
        text: list[str] = []
        last = None
        async for msg in stub.Generate(req, timeout=timeout_s):
            if msg.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
                if msg.finished:  # all of it at once (final_only): the first token came as long before the
                    ttft -= max(0.0, msg.usage.e2e_s - msg.usage.ttft_s)  # end as the router saw it
            ids.extend(msg.token_ids)
            text.append(msg.text)
            if msg.finished:
                last = msg
        e2e = time.perf_counter() - t0
        if last is None:
            raise RuntimeError(f"the router's stream for prompt {record.prompt_id} ended without a final message")
        u = last.usage
        spec = SpecDecodeStats(num_steps=u.num_verify_steps, num_emitted=max(0, u.completion_tokens - 1),
                               num_drafted=u.num_draft_tokens, num_accepted=u.num_accepted_tokens)
        ttft = ttft if ttft is not None else e2e
        n = len(ids)
        return Completion(last.request_id, "".join(text), ids, last.finish_reason, u.prompt_tokens, ttft, e2e,
                          (e2e - ttft) / (n - 1) if n > 1 else 0.0, spec)


def generate_all(address: str, records: list[PromptRecord], params: SamplingParams, concurrency: int,
                 timeout_s: float = 600.0, on_finish=None, final_only: bool = False,
                 prompt_ids: dict[str, list[int]] | None = None) -> list[Completion]:
    """Send every record (first turn, chat template) to ``Router.Generate`` at ``address`` with at
    most ``concurrency`` in flight; completions in record order. ``prompt_ids``: each record's
    prompt already tokenized (chat template included), by prompt id, sent as
    ``GenerateRequest.prompt_ids`` (the router then tokenizes nothing). TTFT / latency are measured on
    the client (s), so they include the network; with ``final_only`` (each answer in one message,
    no per-step messages) the first token's time is the answer's arrival less the router's
    first-token-to-end interval.

    Raises:
        grpc.RpcError: a request failed (e.g. UNAVAILABLE when the verifier is down).
    """

    async def main() -> list[Completion]:
        sem = asyncio.Semaphore(max(1, concurrency))
        async with traced_aio_channel(address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            async def run(r: PromptRecord) -> Completion:
                c = await _one(stub, r, params, sem, timeout_s, final_only,
                               None if prompt_ids is None else prompt_ids[r.prompt_id])
                if on_finish is not None:
                    on_finish(c)
                return c

            return list(await asyncio.gather(*(run(r) for r in records)))

    return asyncio.run(main())
