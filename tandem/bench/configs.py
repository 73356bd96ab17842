"""Benchmark configurations: one registry, name -> how that configuration decodes.

Engine configurations (``target``, ``ngram``, ``draft-model``, ``specformer``, ``context-aware``)
are ``SpeculativeConfig`` values; the runner builds each one's engine with
``tandem.speculation.build_engine`` over the target of the batch size (built once per batch size;
a drafter that reads the target's hidden states, SpecFormer, gets a target of its own). Outside references
(``hf-generate``, ``hf-prompt-lookup``) run Hugging Face ``generate`` on the same checkpoint, at
batch 1. The ablation rows of the context-aware paper (``fixed-k=1`` .. ``fixed-k=<k>``,
``random-length``, ``entropy-threshold``, ``predictor-fixed-tau``, ``predictor-online-tau``,
``budget``, ``full-system``; ``ablation_configs``, what ``tandem bench --ablation`` runs) are
configurations too, over ``--ca-drafter`` at k = ``--num-draft-tokens``, so they share the target
engine, its warm-up and the report. Over a drafter that drafts on the device (SpecFormer) every
row but ``full-system`` (token trees) runs in chained rounds: the policy picks each round's width
from the drafts' scores made inside the round (``tandem.control.DraftPolicy.plan_width``).

Every check a configuration needs (a draft model, a SpecFormer head, a predictor) runs in
``prepare_configs`` before anything is timed, so a bad option fails in a second, not after the
target-only pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..control import CostModel
from ..errors import ConfigError
from ..models.weights import Checkpoint
from ..speculation import MAX_DRAFT_TOKENS, SpeculativeConfig, Speculation, build_draft_policy, build_speculation

DRAFT_MODEL_K = 4  # the draft-model configuration's fixed k (the papers' baseline setting)
ABLATION_FIXED_THRESHOLD = 0.5  # θ of the ablation's predictor-fixed-tau row
SPECFORMER_K = 4  # SpecFormer paper: k = 4 at every batch size


@dataclass(frozen=True)
class BenchOptions:
    """User options the configurations read.

    Attributes:
        num_draft_tokens: k for ``ngram`` and ``hf-prompt-lookup``; k_max for ``context-aware``.
        draft_model: ``--draft-model`` (PATH or truncate:N); None = the shipped draft model.
        specformer: ``--specformer`` (a head from ``tandem train specformer``); None = the shipped head.
        ca_drafter: the drafter ``context-aware`` controls (a registry name).
        predictor: acceptance predictor path; None = the entropy score ``exp(-H(q))``.
        acceptance_threshold: threshold in [0, 1] or "auto" (online threshold controller).
        branch_top_m: hard-position branching of ``context-aware`` (0: off).
    """

    num_draft_tokens: int = 4
    draft_model: str | None = None
    specformer: str | None = None
    ca_drafter: str = "draft-model"
    predictor: str | None = None
    acceptance_threshold: str = "auto"
    branch_top_m: int = 0


@dataclass
class BuildContext:
    """What configurations may use: the target checkpoint, the options, the verifier cost model,
    and (per batch size) the target engine."""

    checkpoint: Checkpoint
    options: BenchOptions
    cost: CostModel | None = None
    engine: object | None = None  # tandem.engine.Engine of the current batch size
    _draft: Checkpoint | None = field(default=None, repr=False)
    _head: object | None = field(default=None, repr=False)

    def draft_checkpoint(self) -> Checkpoint:
        """The draft model's checkpoint (``--draft-model``, else the shipped one), loaded once.

        Raises:
            InvalidRequestError: no ``--draft-model`` and no shipped draft model for this target.
            ModelLoadError: the draft model cannot be loaded or does not match the target.
        """
        if self._draft is None:
            from ..drafters import load_draft_checkpoint
            from ..drafters.factory import drafter_weights

            path = drafter_weights("draft-model", self.options.draft_model, self.checkpoint)
            self._draft = load_draft_checkpoint(path, self.checkpoint)
        return self._draft

    def specformer_head(self):
        """The SpecFormer head (``--specformer``, else the shipped one), loaded once; each engine
        gets its own ``SpecFormerDrafter`` around it.

        Raises:
            InvalidRequestError: no ``--specformer`` and no shipped head for this target.
            ModelLoadError: not a SpecFormer head, or one trained for another target.
        """
        if self._head is None:
            from ..drafters.factory import drafter_weights
            from ..models.specformer import load_specformer

            head = load_specformer(drafter_weights("specformer", self.options.specformer, self.checkpoint,
                                                   option="--specformer"))
            head.config.check_target(self.checkpoint.config)
            self._head = head
        return self._head

    def weights(self, spec: SpeculativeConfig):
        """The loaded weights of ``spec``'s drafter, shared by every engine of the run (None for
        drafters without weights)."""
        if spec.drafter == "draft-model":
            return self.draft_checkpoint()
        if spec.drafter == "specformer":
            return self.specformer_head()
        return None


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration.

    Attributes:
        name: the ``--configs`` name.
        description: one line for tables and ``--help``.
        draft_tokens: k reported in the tables (0: no speculation).
        tokens_per_row: most tokens one verification row can hold (exact kernels pad to it).
        speculation: engine configurations: how the engine speculates (``SpeculativeConfig``),
            from the options (and the checkpoint, for the predictor saved beside a drafter).
        hf_prompt_lookup: outside references: ``prompt_lookup_num_tokens`` for HF generate (0: plain).
        prepare: checks (and loads) what the configuration needs; raises ConfigError / ModelLoadError.
        uses_cost_model: needs the verifier cost model T(b, q).
        uses_predictor: runs the learned acceptance predictor (``--predictor``, else the one saved
            beside the ``--ca-drafter``'s weights), which the results then record.
        router_budget: ``--mode distributed`` only: the replicas measure T(b, q) at start-up and
            the stack's router sets each replica's draft width from the cluster's acceptance and
            the replica's load (``services.router.budget``), on top of this speculation.
    """

    name: str
    description: str
    draft_tokens: Callable[[BenchOptions], int]
    tokens_per_row: Callable[[BenchOptions], int]
    speculation: Callable[[BuildContext], SpeculativeConfig] | None = None
    hf_prompt_lookup: Callable[[BenchOptions], int] | None = None
    prepare: Callable[[BuildContext], object] = lambda ctx: None
    uses_cost_model: bool = False
    uses_predictor: bool = False
    router_budget: bool = False

    @property
    def is_reference(self) -> bool:
        """True for outside references (HF generate): batch 1 only, not our engine."""
        return self.speculation is None

    def build(self, ctx: BuildContext) -> Speculation:
        """The drafter, k and policy of this configuration on ``ctx.engine``'s settings
        (``tandem.speculation.build_speculation``, with the run's loaded weights and cost model)."""
        spec = self.speculation(ctx)
        return build_speculation(spec, ctx.checkpoint, ctx.engine.runner_config, weights=ctx.weights(spec),
                                 cost=ctx.cost)


def _ngram(ctx: BuildContext) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", num_draft_tokens=ctx.options.num_draft_tokens)


def _draft_model(ctx: BuildContext) -> SpeculativeConfig:
    return SpeculativeConfig("draft-model", draft_model=ctx.options.draft_model, num_draft_tokens=DRAFT_MODEL_K)


def _specformer(ctx: BuildContext) -> SpeculativeConfig:
    """SpecFormer drafts come out of the verify pass: the drafter reads the target's hidden states
    (``target_taps``), so its engine gets a target of its own (``build_engine``)."""
    return SpeculativeConfig("specformer", draft_model=ctx.options.specformer, num_draft_tokens=SPECFORMER_K)


def predictor_path(options: BenchOptions, checkpoint: Checkpoint) -> str | None:
    """``--predictor``, else the predictor saved next to the ``--ca-drafter``'s weights, else None."""
    from ..drafters.factory import drafter_predictor

    weights = {"draft-model": options.draft_model, "specformer": options.specformer}.get(options.ca_drafter)
    return options.predictor or drafter_predictor(options.ca_drafter, weights, checkpoint)


def _ca_base(ctx: BuildContext) -> BenchConfig:
    name = ctx.options.ca_drafter
    if name not in CA_DRAFTERS:
        raise ConfigError(f"--ca-drafter must be one of {', '.join(CA_DRAFTERS)}, got {name!r}")
    return CONFIGS[name]


def _over_ca_drafter(ctx: BuildContext, **policy) -> SpeculativeConfig:
    """The ``--ca-drafter`` drafter at k = ``--num-draft-tokens`` under ``policy`` (fields of
    ``SpeculativeConfig``)."""
    return replace(_ca_base(ctx).speculation(ctx), num_draft_tokens=ctx.options.num_draft_tokens, **policy)


def _context_aware(ctx: BuildContext) -> SpeculativeConfig:
    """The predictor (``predictor_path``), else the entropy score; ``--acceptance-threshold`` and ``--branch-top-m``."""
    o = ctx.options
    path = predictor_path(o, ctx.checkpoint)
    return _over_ca_drafter(ctx, policy="predictor" if path else "entropy", predictor=path, acceptance_threshold=o.acceptance_threshold,
                            branch_top_m=o.branch_top_m)


def _prepare_context_aware(ctx: BuildContext) -> None:
    _ca_base(ctx).prepare(ctx)
    build_draft_policy(_context_aware(ctx), ctx.checkpoint)  # a bad --acceptance-threshold / --predictor fails now


def _ablation_predictor(ctx: BuildContext) -> str:
    """The learned predictor of the ablation rows that use it.

    Raises:
        ConfigError: neither ``--predictor`` nor a predictor saved next to the drafter's weights.
    """
    from ..drafters.factory import PREDICTOR_FILE

    o = ctx.options
    path = predictor_path(o, ctx.checkpoint)
    if path is None and o.ca_drafter == "ngram":
        raise ConfigError("the ablation's predictor rows need a predictor trained on n-gram verification logs "
                          "(--predictor PATH); none ships, since n-gram's one-hot drafts give it nothing to score")
    if path is None:
        raise ConfigError(f"the ablation's predictor rows need --predictor (or a {PREDICTOR_FILE} next to the "
                          f"{o.ca_drafter} drafter's weights)")
    return path


def _full_system_m(o: BenchOptions) -> int:
    return max(o.branch_top_m, 2)


def _ablation_predictor_row(ctx: BuildContext, branch_top_m: int = 0, **policy) -> SpeculativeConfig:
    return _over_ca_drafter(ctx, policy="predictor", predictor=_ablation_predictor(ctx), branch_top_m=branch_top_m,
                            **policy)


def _prepare_ablation(uses_predictor: bool) -> Callable[[BuildContext], None]:
    def prepare(ctx: BuildContext) -> None:
        _ca_base(ctx).prepare(ctx)
        if uses_predictor:
            build_draft_policy(_ablation_predictor_row(ctx), ctx.checkpoint)  # an unreadable predictor fails now
    return prepare


def _host(speculation: Callable[[BuildContext], SpeculativeConfig]) -> Callable[[BuildContext], SpeculativeConfig]:
    """The same decoding with host-drafted rounds."""
    return lambda ctx: replace(speculation(ctx), chained_rounds=False)


def _k(o: BenchOptions) -> int:
    return o.num_draft_tokens


def _k1(o: BenchOptions) -> int:
    return o.num_draft_tokens + 1


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in [
    BenchConfig("target", "target-only decoding (the baseline)", lambda o: 0, lambda o: 1,
                speculation=lambda ctx: SpeculativeConfig()),
    BenchConfig("ngram", "prompt-lookup n-gram drafter, k = --num-draft-tokens", _k, _k1, speculation=_ngram),
    BenchConfig("draft-model", f"small draft LM (--draft-model), k = {DRAFT_MODEL_K}", lambda o: DRAFT_MODEL_K,
                lambda o: DRAFT_MODEL_K + 1, speculation=_draft_model, prepare=BuildContext.draft_checkpoint),
    BenchConfig("specformer", f"SpecFormer draft head (--specformer), k = {SPECFORMER_K}", lambda o: SPECFORMER_K,
                lambda o: SPECFORMER_K + 1, speculation=_specformer, prepare=BuildContext.specformer_head),
    BenchConfig("context-aware", "adaptive length + cost-model batch budget + online acceptance threshold over --ca-drafter "
                "(--predictor, else the entropy score), k_max = --num-draft-tokens",
                _k, lambda o: o.num_draft_tokens + 1 + max(o.branch_top_m - 1, 0),
                speculation=_context_aware, prepare=_prepare_context_aware, uses_cost_model=True, uses_predictor=True),
    # The router's cluster-level draft budget over fixed-k drafting (--mode distributed only): the
    # same drafters as ngram / specformer, each replica's width set by the router's budget.
    BenchConfig("ngram-router-budget", "n-gram drafter, k = --num-draft-tokens, each round's width set by the router's "
                "cluster-level draft budget (--mode distributed)", _k, _k1, speculation=_ngram, router_budget=True),
    BenchConfig("specformer-router-budget", f"SpecFormer, k = {SPECFORMER_K}, each round's width set by the router's "
                "cluster-level draft budget (--mode distributed)", lambda o: SPECFORMER_K, lambda o: SPECFORMER_K + 1,
                speculation=_specformer, prepare=BuildContext.specformer_head, router_budget=True),
    # The context-aware paper's ablation table, over --ca-drafter (tandem bench --ablation runs these).
    BenchConfig("fixed-k", "ablation: fixed k = --num-draft-tokens over --ca-drafter", _k, _k1,
                speculation=_over_ca_drafter, prepare=_prepare_ablation(False)),
    BenchConfig("random-length", "ablation: draft length uniform in 0..k per sequence", _k, _k1,
                speculation=lambda ctx: _over_ca_drafter(ctx, policy="random"), prepare=_prepare_ablation(False)),
    BenchConfig("entropy-threshold", "ablation: entropy score exp(-H(q)) with the online acceptance threshold, no learned predictor",
                _k, _k1, speculation=lambda ctx: _over_ca_drafter(ctx, policy="entropy", cost_model=False),
                prepare=_prepare_ablation(False)),
    BenchConfig("predictor-fixed-tau", f"ablation: learned predictor under a fixed acceptance threshold "
                f"{ABLATION_FIXED_THRESHOLD}, no cost model",
                _k, _k1, speculation=lambda ctx: _ablation_predictor_row(
                    ctx, acceptance_threshold=ABLATION_FIXED_THRESHOLD, cost_model=False),
                prepare=_prepare_ablation(True), uses_predictor=True),
    BenchConfig("predictor-online-tau", "ablation: learned predictor + online acceptance threshold, no cost model",
                _k, _k1, speculation=lambda ctx: _ablation_predictor_row(ctx, cost_model=False),
                prepare=_prepare_ablation(True), uses_predictor=True),
    BenchConfig("batch-width", "ablation: one width for every row from the batch size, the verifier cost model "
                "T(b, q) and the acceptance per position seen so far; no predictor, nothing scored",
                _k, _k1, speculation=lambda ctx: _over_ca_drafter(ctx, policy="batch-width"),
                prepare=_prepare_ablation(False), uses_cost_model=True),
    BenchConfig("budget", "ablation: learned predictor + online acceptance threshold + batch budget under the "
                "verifier cost model T(b, q), no enhancement",
                _k, _k1, speculation=_ablation_predictor_row, prepare=_prepare_ablation(True), uses_cost_model=True,
                uses_predictor=True),
    BenchConfig("full-system", "ablation: predictor + online acceptance threshold + batch allocation + top-m hard-position branching "
                "(m = max(--branch-top-m, 2))", _k, lambda o: o.num_draft_tokens + _full_system_m(o),
                speculation=lambda ctx: _ablation_predictor_row(ctx, _full_system_m(ctx.options)),
                prepare=_prepare_ablation(True), uses_cost_model=True, uses_predictor=True),
    # The same decodings with host-drafted rounds (each round launched once the previous one is
    # back, drafts proposed on the host): the chained device rounds measured against them.
    BenchConfig("target-host", "target-only with host-driven rounds (no chaining)", lambda o: 0, lambda o: 1,
                speculation=lambda ctx: SpeculativeConfig(chained_rounds=False)),
    BenchConfig("ngram-host", "n-gram drafter with host-drafted rounds (LookupIndex), k = --num-draft-tokens",
                _k, _k1, speculation=_host(_ngram)),
    BenchConfig("specformer-host", f"SpecFormer with host-drafted rounds (observe, then propose), k = {SPECFORMER_K}",
                lambda o: SPECFORMER_K, lambda o: SPECFORMER_K + 1, speculation=_host(_specformer),
                prepare=BuildContext.specformer_head),
    BenchConfig("hf-generate", "Hugging Face generate, greedy (batch 1)", lambda o: 0, lambda o: 0,
                hf_prompt_lookup=lambda o: 0),
    BenchConfig("hf-prompt-lookup", "Hugging Face prompt-lookup decoding, k = --num-draft-tokens (batch 1)",
                _k, lambda o: 0, hf_prompt_lookup=lambda o: o.num_draft_tokens),
]}

CA_DRAFTERS = ("ngram", "draft-model", "specformer")
ABLATION_POLICIES = ("random-length", "entropy-threshold", "predictor-fixed-tau", "predictor-online-tau", "batch-width",
                     "budget", "full-system")


def ablation_configs(k: int) -> tuple[str, ...]:
    """What ``tandem bench --ablation`` runs at k = ``--num-draft-tokens``: target, the fixed
    lengths ``fixed-k=1`` .. ``fixed-k=<k>`` (a sweep), then the policies of ``ABLATION_POLICIES``."""
    return ("target", *(f"fixed-k={n}" for n in range(1, k + 1)), *ABLATION_POLICIES)


def _fixed_k(n: int) -> BenchConfig:
    """``fixed-k=<n>``: the ``--ca-drafter`` at a fixed k = n (the ablation's length sweep)."""
    return BenchConfig(f"fixed-k={n}", f"ablation: fixed k = {n} over --ca-drafter", lambda o: n, lambda o: n + 1,
                       speculation=lambda ctx: replace(_over_ca_drafter(ctx), num_draft_tokens=n),
                       prepare=_prepare_ablation(False))


def config(name: str) -> BenchConfig:
    """The configuration called ``name`` (``CONFIGS``, or ``fixed-k=<n>`` for n in 1..16).

    Raises:
        ConfigError: an unknown name.
    """
    if name in CONFIGS:
        return CONFIGS[name]
    prefix = "fixed-k="
    if name.startswith(prefix):
        n = name[len(prefix):]
        if not (n.isdigit() and 1 <= int(n) <= MAX_DRAFT_TOKENS):
            raise ConfigError(f"{name!r}: fixed-k=<n> takes an integer n in 1..{MAX_DRAFT_TOKENS}")
        return _fixed_k(int(n))
    raise ConfigError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)} "
                      f"or fixed-k=<n> (n in 1..{MAX_DRAFT_TOKENS})")


def parse_configs(spec: str) -> list[BenchConfig]:
    """``--configs`` (comma-separated names) -> configurations, ``target`` first (every other
    configuration is compared with it), duplicates dropped.

    Raises:
        ConfigError: an unknown name or an empty list.
    """
    names = [n.strip() for n in spec.split(",")]
    if not any(names):
        raise ConfigError("--configs is empty")
    if not all(names):
        raise ConfigError(f"--configs {spec!r} has an empty item")
    ordered = ["target"] + [n for n in dict.fromkeys(names) if n != "target"]
    return [config(n) for n in ordered]


def prepare_configs(configs: list[BenchConfig], ctx: BuildContext) -> None:
    """Run every configuration's checks (and loads) before the benchmark starts.

    Raises:
        ConfigError, ModelLoadError: as the configuration's ``prepare`` raises them.
    """
    for c in configs:
        c.prepare(ctx)
