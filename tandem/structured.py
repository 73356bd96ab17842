"""Structured output: a request's output constrained by a grammar (any JSON object, a JSON
schema, a Lark grammar or a regular expression), losslessly under speculation.

The grammar engine is llguidance (Microsoft's, the Rust engine vLLM and SGLang use): it compiles
a JSON schema or a grammar against the tokenizer and gives, for a parser state, the set of allowed
next tokens as a bitmask (one bit per token id), in tens of microseconds, and it rolls back.

How a structured request is verified (``Grammar.masks`` then ``Grammar.advance``):

1. Before a round, the host cuts the request's drafts at the first its grammar forbids
   (``cut_drafts``): the target's masked distribution gives a forbidden token probability 0, so
   verification would reject it (and everything after it) anyway; dropping them changes nothing
   but the wasted work. While the round's forward runs, a thread walks the kept drafts through the
   grammar (``MaskWalk``): the mask at the position after the last emitted token, then after each
   kept draft; the walk is rolled back.
2. Verification masks the target's logits at every position (``-inf`` where the bitmask is 0,
   after the logit adjustments) before the argmax and the sampling transform, so greedy and
   speculative sampling emit exactly what target-only decoding under the grammar would.
3. After the round, the grammar consumes the emitted tokens (accepted drafts and the bonus token).

A request's grammar lives on the host, so its rounds are host-driven (``Engine.chains_rounds``
is off while a structured request runs); drafters draft as they do in any host round.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from .errors import InvalidRequestError
from .models.transfer import to_device

log = logging.getLogger(__name__)

STRUCTURE_KINDS = ("json_object", "json_schema", "lark", "regex")


@dataclass(frozen=True)
class Structure:
    """What a structured request's output must match.

    Attributes:
        kind: ``json_object`` (any JSON object), ``json_schema`` (``spec`` is a JSON schema, as
            text), ``lark`` (``spec`` is a Lark grammar, llguidance's dialect) or ``regex``.
        spec: the schema or grammar text ("" for ``json_object``).
        param: the request field it came from, named in errors (``response_format``, ``tools``).
    """

    kind: str
    spec: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURE_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(STRUCTURE_KINDS)}, "
                                      f"got {self.kind!r}", param=self.param)
        if self.kind != "json_object" and not self.spec:
            what = {"json_schema": "JSON schema", "regex": "regular expression"}.get(self.kind, "grammar")
            raise InvalidRequestError(f"{self.param}: the {what} is empty", param=self.param)

    def grammar(self) -> str:
        """llguidance's grammar text for this structure.

        Raises:
            InvalidRequestError: a JSON schema that is not a JSON object.
        """
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param=self.param) from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("the JSON schema must be a JSON object", param=self.param)
            try:
                return LLMatcher.grammar_from_json_schema(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"bad JSON schema: {exc}", param=self.param) from None
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.spec)
        return LLMatcher.grammar_from_regex(self.spec)


def _one_line(error: str, kind: str) -> str:
    """llguidance's multi-line error (a message, an excerpt with a caret, "error: ..." details) as
    one line: the message and the details. For a regex the position is left out: it points into
    the grammar llguidance wraps the expression in, not into the user's text."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected by the grammar engine"
    head = re.sub(r"^(at )?\d+\(\d+\):\s*", "", lines[0]) if kind == "regex" else lines[0]
    details = [line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")]
    return f"{head.rstrip(':')}: {'; '.join(details)}" if details else head


class GrammarCompiler:
    """Compiles structures against one tokenizer (an engine's or a router's).

    Args:
        hf_tokenizer: the model's Hugging Face (fast) tokenizer.
        vocab_size: the target's vocabulary (its logits' width; may exceed the tokenizer's).
        eos_token_ids: the ids that end a sequence (allowed where the grammar is complete).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @cached_property
    def tokenizer(self):
        """llguidance's view of the tokenizer (built once, on first use: ~0.1 s)."""
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                            eos_token=self.eos_token_ids[0] if self.eos_token_ids else None)

    def check(self, structure: Structure) -> None:
        """Compile ``structure`` once to validate it (a router does this at the boundary).

        Raises:
            InvalidRequestError: a malformed schema or grammar, naming ``structure.param``.
        """
        self.compile(structure)

    def compile(self, structure: Structure) -> "Grammar":
        """A fresh grammar state for one request.

        Raises:
            InvalidRequestError: a malformed schema or grammar.
        """
        from llguidance import LLMatcher

        text = structure.grammar()
        error = LLMatcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"bad {structure.kind.replace('_', ' ')}: {_one_line(error, structure.kind)}",
                                      param=structure.param)
        matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"bad {structure.kind.replace('_', ' ')}: "
                                      f"{_one_line(matcher.get_error(), structure.kind)}", param=structure.param)
        return Grammar(matcher, self.vocab_size, self.eos_token_ids)


class Grammar:
    """One request's grammar state (an llguidance matcher) and its token masks.

    Args:
        matcher: the request's ``llguidance.LLMatcher``.
        vocab_size: the target's vocabulary.
        eos_token_ids: ids allowed when the grammar is complete.
    """

    def __init__(self, matcher, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.failed = False  # the matcher entered an error state: masks stop (logged once)

    def masks(self, drafts: list[int]) -> tuple[torch.Tensor, int]:
        """Token bitmasks of the positions a round verifies, and how many drafts to keep.

        Args:
            drafts: the request's draft tokens for the round.

        Returns:
            ``([m + 1, words]`` int32 bitmask (bit ``t % 32`` of word ``t // 32`` is token t; row j
            is the position after the j-th kept draft), m``): the drafts the grammar allows, in
            order, up to the first it forbids. The grammar is left where it was. (A round's
            requests are done together: ``batch_masks``.)
        """
        return batch_masks([(self, drafts)])[0]

    def _allowed_drafts(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar allows in a row (EOS ends the run: not a draft to walk)."""
        if self.failed or not drafts:
            return 0
        ok = self.matcher.validate_tokens(list(drafts))
        return next((i for i, t in enumerate(drafts[:ok]) if t in self.eos_token_ids), ok)

    def _finish_masks(self, out: torch.Tensor) -> None:
        """A failed grammar allows everything; a position with nothing allowed (the grammar is
        complete) allows EOS."""
        if self.failed:
            out.fill_(-1)
            return
        for row in out:
            if not bool(row.any()):
                for t in self.eos_token_ids:
                    row[t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)

    def advance(self, tokens: list[int]) -> None:
        """Consume the tokens a round emitted (EOS ends the sequence: not consumed)."""
        if self.failed:
            return
        for tok in tokens:
            if tok in self.eos_token_ids:
                return
            if not self.matcher.consume_token(tok):
                self._fail(f"token {tok}")
                return

    def _fail(self, where: str) -> None:
        self.failed = True
        log.error("grammar matcher failed at %s: %s; the request continues unconstrained", where,
                  self.matcher.get_error())


_EXECUTOR = None  # llguidance's thread pool for the masks of a whole batch (made on first use)


def cut_drafts(work: list[tuple["Grammar", list[int]]]) -> list[int]:
    """How many of each request's drafts its grammar allows in a row (``(grammar, drafts)`` per
    request): the drafts a round verifies. Cheap (no mask is computed)."""
    return [g._allowed_drafts(d) for g, d in work]


def batch_masks(work: list[tuple["Grammar", list[int]]], kept: list[int] | None = None
                ) -> list[tuple[torch.Tensor, int]]:
    """``Grammar.masks`` of many requests at once: each request's drafts are cut at the first its
    grammar forbids (``cut_drafts``, or ``kept`` when already cut), then every mask of every
    request is computed in one call to llguidance's executor (Rust threads, without the GIL),
    walking and rolling back the kept drafts.

    Args:
        work: ``(grammar, drafts)`` per structured request of a round.
        kept: ``cut_drafts(work)``, when the caller has it.

    Returns:
        Per request, as ``Grammar.masks``: ``([m + 1, words]`` int32 bitmask, m``).
    """
    global _EXECUTOR
    if not work:
        return []
    if _EXECUTOR is None:
        from llguidance import LLExecutor

        _EXECUTOR = LLExecutor()
    kept = cut_drafts(work) if kept is None else kept
    words = work[0][0].words
    rows = sum(m + 1 for m in kept)
    bits = torch.zeros(rows, words, dtype=torch.int32)
    walks, plain, starts, at = [], [], [], 0  # (the executor takes a request without drafts separately)
    for (g, drafts), m in zip(work, kept):
        starts.append(at)
        if not g.failed:
            (walks if m else plain).append((g.matcher, at, list(drafts[:m])) if m else (g.matcher, at))
        at += m + 1
    if walks:
        _EXECUTOR.unsafe_compute_mask_ptr_with_draft_token(walks, bits.data_ptr(), words * 4, rows)
    if plain:
        _EXECUTOR.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, rows)
    out = []
    for (g, _), m, start in zip(work, kept, starts):
        if g.matcher.is_error():
            g._fail("walking the drafts")
        masks = bits[start:start + m + 1].clone()
        g._finish_masks(masks)
        out.append((masks, m))
    return out


class MaskWalk:
    """A round's grammar masks computed on a background thread (``batch_masks``), so the host
    walks the grammars while the device runs the round's forward; ``result()`` waits for them.
    The grammars are not to be touched until then.

    Args:
        work: ``(grammar, drafts)`` per structured request, the drafts already cut (``cut_drafts``).
        keys: each request's key in ``result`` (its KV slot).
    """

    _pool = None

    def __init__(self, work: list[tuple["Grammar", list[int]]], keys: list) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if MaskWalk._pool is None:
            MaskWalk._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-masks")
        self.keys = list(keys)
        self._future = MaskWalk._pool.submit(batch_masks, work, [len(d) for _, d in work])

    def result(self) -> dict:
        """Key -> the request's ``[len(drafts) + 1, words]`` int32 bitmask."""
        return {key: mask for key, (mask, _) in zip(self.keys, self._future.result())}


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[..., words]`` int32 bitmasks -> ``[..., vocab_size]`` bool (True: allowed), on their device."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :vocab_size]


def with_masks(items: list, masks) -> list:
    """``items`` with the grammar masks of ``masks`` (a ``MaskWalk``, waited for) as ``allowed``."""
    if masks is None:
        return items
    ready = masks.result()
    return [replace(it, allowed=ready[it.slot]) if it.slot in ready else it for it in items]


def step_masks(items: list, Q: int, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``[len(items), Q, vocab_size]`` bool grammar masks of a step's rows (row i: ``items[i]``,
    None or without ``allowed``: every token), on ``device``; None when no item has one."""
    if not any(it is not None and it.allowed is not None for it in items):
        return None
    words = (vocab_size + 31) // 32
    bits = torch.full((len(items), Q, words), -1, dtype=torch.int32)
    for i, it in enumerate(items):
        if it is not None and it.allowed is not None:
            bits[i, :it.allowed.shape[0]] = it.allowed
    return unpack_bitmask(to_device(bits, device), vocab_size)


def constrain_drafts(reqs: list, proposals: list) -> "MaskWalk | None":
    """A round's drafts under its structured requests' grammars: each such request's proposal
    (``proposals[i]`` of ``reqs[i]``, replaced in place) keeps its drafts up to the first its
    grammar forbids (a token tree keeps its chain: no branching under a grammar), and their masks
    start being walked (``MaskWalk``, keyed by slot). None when no request has a grammar."""
    from .drafters.base import DraftProposal

    structured = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not structured:
        return None
    chains = [proposals[i].tokens[:proposals[i].chain_length] for i in structured]
    for i, chain, m in zip(structured, chains, cut_drafts([(reqs[i].grammar, c) for i, c in zip(structured, chains)])):
        p = proposals[i]
        if p.parents is not None:
            p = DraftProposal(chain, None if p.probs is None else p.probs[:len(chain)], p.features[:len(chain)],
                              scores=None if p.scores is None else p.scores[:len(chain)])
        proposals[i] = p.truncated(m)
    return MaskWalk([(reqs[i].grammar, proposals[i].tokens) for i in structured], [reqs[i].slot for i in structured])
