"""Speculation as one value: ``SpeculativeConfig`` says how an engine speculates (drafter, k,
draft policy); ``build_speculation`` turns it into the parts an engine runs and ``build_engine``
into an engine. The CLI (``tandem generate``, ``collect-logs``, training evaluations), the bench
configurations (``tandem.bench.configs``), the router (``services.router.core``) and the local
stack launcher all describe speculation with this one type and build it with these functions.

Validation happens when the config is made (``SpeculativeConfig.__post_init__``), so a bad
combination fails before any model loads; what needs files (weights, a predictor) fails in
``build_speculation``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .control import CostModel, DraftPolicy, RandomLengthPolicy, entropy_score, parse_acceptance_threshold
from .errors import ConfigError
from .threshold import ThresholdController

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the builders import torch-backed modules when called: the config itself stays light
    from .drafters.base import Drafter
    from .engine import Engine
    from .models.runner import RunnerConfig
    from .models.weights import Checkpoint
    from .target import LocalTarget
    from .tokenizer import Tokenizer

DRAFTERS = ("none", "ngram", "draft-model", "specformer", "remote")
TRAINED_DRAFTERS = ("draft-model", "specformer")  # drafters with weights (and a predictor saved beside them)
POLICIES = ("fixed", "entropy", "predictor", "random", "batch-width")
MAX_DRAFT_TOKENS = 16
MAX_BRANCH_TOP_M = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine speculates, as a value.

    Attributes:
        drafter: "none" (target-only decoding), "ngram" (prompt lookup), "draft-model" (a small
            LM), "specformer" (a head over the target's hidden states), or "remote" (a drafter
            service the caller connects to: the router's ``RemoteDrafter``).
        draft_model: weights of a trained drafter: for "draft-model" a distilled draft, a GGUF /
            HF checkpoint or ``truncate:N``; for "specformer" a head directory; None = the ones
            shipped for the bundled target.
        num_draft_tokens: k, draft tokens per sequence per round at most (1..16); a drafter with
            its own limit (a SpecFormer head's l_d) caps it (``Engine.configured_draft_limit``).
        policy: draft lengths: "fixed" (k for everyone), "entropy" (exp(-entropy of q) under θ),
            "predictor" (the learned acceptance predictor under θ), "random" (uniform in
            0..k per sequence: the ablation's baseline), or "batch-width" (one width for every row
            from the batch size, the cost model and the acceptance per position seen so far:
            ``tandem.batch_width.BatchWidthPolicy``; no θ, no predictor, no scoring).
        predictor: the acceptance predictor of policy "predictor": a ``.safetensors`` path, or
            "auto" (the one saved beside the drafter's weights).
        acceptance_threshold: the threshold on predicted acceptance, a number in [0, 1], or "auto" (learned online
            by the threshold controller).
        branch_top_m: hard-position enhancement: verify the top-m candidates where θ cuts a
            draft (0/1: off; 0..8).
        cost_model: allocate draft tokens across the batch under the verifier's cost model
            T(b, q) (measured on a local target when none is given); False: θ cut only.
        chained_rounds: chain rounds on the device where the drafter allows it
            (``Engine.chains_rounds``); False keeps host-drafted rounds.

    Raises:
        ConfigError: an unknown drafter or policy, k or m out of range, a bad θ, or options that
            do not go together (a predictor or θ without a policy that uses them, a policy
            without a drafter, weights for a drafter that takes none).
    """

    drafter: str = "none"
    draft_model: str | None = None
    num_draft_tokens: int = 4
    policy: str = "fixed"
    predictor: str | None = None
    acceptance_threshold: str | float = "auto"
    branch_top_m: int = 0
    cost_model: bool = True
    chained_rounds: bool = True

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"unknown drafter {self.drafter!r}; choose from {', '.join(DRAFTERS)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown draft policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"num_draft_tokens (k) must be an integer in 1..{MAX_DRAFT_TOKENS}, "
                              f"got {self.num_draft_tokens!r}")
        if not isinstance(self.branch_top_m, int) or not 0 <= self.branch_top_m <= MAX_BRANCH_TOP_M:
            raise ConfigError(f"branch_top_m must be an integer in 0..{MAX_BRANCH_TOP_M}, got {self.branch_top_m!r}")
        acceptance_threshold = parse_acceptance_threshold(self.acceptance_threshold)  # ConfigError: "--acceptance-threshold must be a number in [0, 1] or auto"
        if self.draft_model is not None and self.drafter not in TRAINED_DRAFTERS:
            raise ConfigError("--draft-model needs --drafter draft-model or specformer")
        if self.policy == "fixed":
            if self.predictor is not None:
                raise ConfigError("--predictor needs --policy predictor")
            if self.branch_top_m:
                raise ConfigError("--branch-top-m needs a threshold policy: --policy entropy, or --predictor")
            if acceptance_threshold is not None:
                raise ConfigError("--acceptance-threshold needs a threshold policy: --policy entropy, or --predictor")
            return
        if self.drafter == "none":
            raise ConfigError(f"a draft policy ({self.policy}) needs a --drafter")
        if self.policy == "predictor":
            if self.predictor is not None and not self.predictor.strip():
                raise ConfigError("--predictor is empty: give a predictor file (.safetensors) or auto")
            if not self.predictor:
                raise ConfigError("--policy predictor needs --predictor PATH")
            if self.predictor == "auto" and self.drafter not in (*TRAINED_DRAFTERS, "ngram"):
                raise ConfigError("--predictor auto needs a drafter with a shipped predictor (--drafter ngram, "
                                  "draft-model or specformer)")
        elif self.predictor is not None:
            raise ConfigError(f"--predictor needs --policy predictor, not {self.policy!r}")
        if self.policy == "batch-width":
            if acceptance_threshold is not None or self.branch_top_m:
                raise ConfigError("policy batch-width sets no acceptance threshold and branches nowhere: drop "
                                  "--acceptance-threshold / --branch-top-m")
            if not self.cost_model:
                raise ConfigError("policy batch-width chooses widths under the verifier cost model T(b, q): add "
                                  "--measure-cost")

    @property
    def speculates(self) -> bool:
        """A drafter is configured (False: target-only decoding)."""
        return self.drafter != "none"

    @property
    def measures_cost(self) -> bool:
        """Its draft policy allocates with a verifier cost model T(b, q) that ``build_engine``
        measures on the target at start-up unless one is given (up to a minute or more on a CPU)."""
        return self.policy in ("entropy", "predictor", "batch-width") and bool(self.cost_model)

    @property
    def tokens_per_row(self) -> int:
        """Most tokens one verification row holds: the last token, k drafts and the extra
        branches of a hard position (what the verifier cost model must cover)."""
        return self.num_draft_tokens + 1 + max(self.branch_top_m - 1, 0) if self.speculates else 1


TARGET_ONLY = SpeculativeConfig()


@dataclass(frozen=True)
class Speculation:
    """What an engine runs for a ``SpeculativeConfig`` (``build_speculation``): the drafter
    (None: target-only), k, the draft policy (None: fixed k) and whether rounds may chain; the
    ``Engine`` arguments of the same names."""

    drafter: "Drafter | None"
    num_draft_tokens: int
    draft_policy: DraftPolicy | None = None
    chained_rounds: bool = True


def resolve_predictor(spec: SpeculativeConfig, checkpoint: Checkpoint | None) -> str | None:
    """The predictor file ``spec`` uses: its path, the one saved beside the drafter's weights for
    "auto", None without policy "predictor".

    Raises:
        ConfigError: "auto" and no predictor saved beside the drafter's weights.
    """
    if spec.policy != "predictor":
        return None
    if spec.predictor != "auto":
        return spec.predictor
    from .drafters.factory import PREDICTOR_FILE, drafter_predictor

    path = drafter_predictor(spec.drafter, spec.draft_model, checkpoint) if checkpoint is not None else None
    if path is None:
        if spec.drafter == "ngram":
            raise ConfigError("--predictor auto: the n-gram drafter's predictor ships for the bundled model only; "
                              "train one for this target (tandem collect-logs, tandem train predictor) and pass its path")
        raise ConfigError(f"--predictor auto: no {PREDICTOR_FILE} next to the {spec.drafter} drafter's weights")
    return path


# (predictor path, drafter) pairs already warned about: an engine's build checks its predictor
# before the cost model's timing and loads it again for the policy, and a bench builds one engine
# per configuration; the mismatch is said once a process
_WARNED_PREDICTORS: set[tuple[str, str]] = set()


def load_predictor(spec: SpeculativeConfig, checkpoint: Checkpoint | None = None):
    """The ``AcceptancePredictor`` ``spec.predictor`` names ("auto": the one beside the drafter's
    weights for ``checkpoint``); its ``predict`` scores on the host, its ``probabilities`` on the
    drafts' device. A predictor trained on another drafter's logs runs (the features are the
    same) and is logged as such, once a process.

    Raises:
        ConfigError: an unreadable predictor, or "auto" without one.
    """
    from .predictor import AcceptancePredictor

    path = resolve_predictor(spec, checkpoint)
    try:
        predictor = AcceptancePredictor.load(path, features_only=True)
    except Exception as exc:  # missing file, not safetensors, not a predictor
        raise ConfigError(f"cannot load predictor {path!r}: {exc}") from None
    if predictor.drafter is not None and predictor.drafter != spec.drafter \
            and (str(path), spec.drafter) not in _WARNED_PREDICTORS:
        # same features, so it runs; but its calibration is another drafter's acceptance
        _WARNED_PREDICTORS.add((str(path), spec.drafter))
        log.warning("predictor %s was trained on the %s drafter's verification logs and now scores the %s "
                    "drafter's drafts: its probabilities are not calibrated for them (tandem collect-logs "
                    "--drafter %s, then tandem train predictor)", path, predictor.drafter, spec.drafter, spec.drafter)
    return predictor


def build_draft_policy(spec: SpeculativeConfig, checkpoint: Checkpoint | None = None, cost: CostModel | None = None,
                       store=None, store_key: str = "acceptance_threshold", predictor=None) -> DraftPolicy | None:
    """The draft policy of ``spec`` (None for policy "fixed").

    Args:
        spec: the configuration.
        checkpoint: the target (finds the predictor of ``predictor="auto"``).
        cost: the verifier cost model T(b, q) for the batch allocation; used only when
            ``spec.cost_model``.
        store, store_key: share the threshold controller's state through a ``tandem.state`` store.
        predictor: ``load_predictor(spec, checkpoint)`` already made (policy "predictor"), so the
            file is read once; None: loaded here.

    Raises:
        ConfigError: an unreadable predictor, or "auto" without one.
    """
    if spec.policy == "fixed":
        return None
    if spec.policy == "random":
        return RandomLengthPolicy(seed=0)
    if spec.policy == "batch-width":
        if cost is None:
            raise ConfigError("policy batch-width needs the verifier cost model T(b, q) (build_engine measures it)")
        from .batch_width import BatchWidthPolicy

        return BatchWidthPolicy(cost)
    if spec.policy == "predictor":
        predictor = predictor if predictor is not None else load_predictor(spec, checkpoint)
        score, device_score = predictor.predict, predictor.probabilities
    else:
        score = device_score = entropy_score
    acceptance_threshold = parse_acceptance_threshold(spec.acceptance_threshold)
    controller = ThresholdController() if acceptance_threshold is None else None
    return DraftPolicy(score, controller=controller, cost=cost if spec.cost_model else None,
                       acceptance_threshold=0.5 if acceptance_threshold is None else acceptance_threshold,
                       branch_top_m=spec.branch_top_m, store=store, store_key=store_key, device_score=device_score)


def build_speculation(spec: SpeculativeConfig, checkpoint: Checkpoint | None = None,
                      runner_config: RunnerConfig | None = None, *, drafter: Drafter | None = None, weights=None,
                      cost: CostModel | None = None, store=None, predictor=None) -> Speculation:
    """Build what ``spec`` describes: the one place speculation is assembled.

    Args:
        spec: the configuration.
        checkpoint: the target (trained drafters check against it; the shipped weights are its
            defaults).
        runner_config: the target's runner settings (a draft model runs with them).
        drafter: an already built drafter of kind ``spec.drafter``: required for "remote" (the
            router's drafter-service client); otherwise built here.
        weights: the drafter's weights already loaded (a draft model's ``Checkpoint`` or a
            SpecFormer head), so several engines share one load (the bench).
        cost: the verifier cost model for a context-aware policy (``spec.cost_model``).
        store: θ state kept in a state store (verifier replicas).
        predictor: the policy's predictor already loaded (``build_draft_policy``).

    Raises:
        ConfigError: a remote drafter not given, a drafter given for another kind, a bad predictor.
        InvalidRequestError: no weights for this target; ModelLoadError: unloadable weights.
    """
    if not spec.speculates:
        return Speculation(None, spec.num_draft_tokens, None, spec.chained_rounds)
    if drafter is None:
        if spec.drafter == "remote":
            raise ConfigError("a remote drafter is connected by its caller: pass drafter=")
        from .drafters.factory import build_drafter

        if spec.drafter in TRAINED_DRAFTERS and (runner_config is None or checkpoint is None):
            raise ConfigError(f"the {spec.drafter} drafter needs the target's checkpoint and runner settings")
        drafter = build_drafter(spec.drafter, spec.draft_model, checkpoint, runner_config, weights=weights)
    elif spec.drafter != "remote" and drafter.name != spec.drafter:
        raise ConfigError(f"a {drafter.name} drafter given for drafter {spec.drafter!r}")
    policy = build_draft_policy(spec, checkpoint, cost, store, predictor=predictor)
    if policy is not None and policy.device_score is not None and spec.chained_rounds and policy.chains:
        # chained rounds: the drafter scores its drafts inside the round, the policy sets widths from them
        drafter.set_acceptance_scorer(policy.device_score, spec.num_draft_tokens)
    return Speculation(drafter, spec.num_draft_tokens, policy, spec.chained_rounds)


def measure_target_cost(target: "LocalTarget", max_tokens_per_row: int) -> CostModel:
    """The verifier cost model a context-aware policy allocates with: T(b, q) on the target's own
    runner for b in {1, its slots} and q = 1..``max_tokens_per_row`` (3 steps a timing), measured
    at start-up (``build_engine``, ``tandem serve verifier --measure-cost``)."""
    log.info("measuring the verifier cost model T(b, q) for b in %s, q = 1..%d (context-aware policies "
             "allocate with it, routers budget draft widths with it)", sorted({1, target.info.num_slots}),
             max_tokens_per_row)
    return CostModel.measure(target.runner, sorted({1, target.info.num_slots}), max_tokens_per_row, iters=3)


def _policy_cost(spec: SpeculativeConfig, drafter: "Drafter", target: "LocalTarget") -> CostModel:
    """``measure_target_cost`` up to k + max(m, 1) + 1 tokens a row (k capped by the drafter's
    own limit, m = ``branch_top_m``)."""
    cap = drafter.max_draft_tokens
    k = spec.num_draft_tokens if cap is None else min(spec.num_draft_tokens, cap)
    return measure_target_cost(target, k + max(spec.branch_top_m, 1) + 1)


def build_engine(spec: SpeculativeConfig, checkpoint: Checkpoint | None = None,
                 runner_config: RunnerConfig | None = None, *, share: Engine | None = None,
                 tokenizer: Tokenizer | None = None, weights=None, cost: CostModel | None = None,
                 verification_sink=None, drafter: Drafter | None = None, store=None,
                 on_measure: Callable[[], None] | None = None) -> Engine:
    """An engine that speculates as ``spec`` says.

    Args:
        spec: the configuration.
        checkpoint, runner_config: the target and its runner settings (a new target is built).
        share: instead, run on this engine's target (its runner, KV cache and captured graphs)
            and tokenizer, e.g. target-only and speculative decoding of the same prompts. ``share``
            must hold no requests (a round it launched past their end is collected first) and
            stay idle while the new engine runs. A drafter that reads target states the shared
            runner does not tap gets a target of its own with the shared target's settings.
        tokenizer: reuse a loaded tokenizer.
        weights, cost: as ``build_speculation``; without ``cost`` a context-aware policy with
            ``spec.cost_model`` measures T(b, q) on the new engine's runner at start-up.
        verification_sink: per-draft verification records (``Engine``).
        drafter: an already built drafter (required for ``spec.drafter == "remote"``: a verifier
            replica's drafter-service client), as ``build_speculation``.
        store: the draft policy's θ state shared through a state store (verifier replicas).
        on_measure: called just before T(b, q) is timed (a CLI says it will take a while), after a
            bad predictor has failed.

    Raises:
        ValueError: ``share`` with requests, or with a checkpoint / runner_config.
        ConfigError, InvalidRequestError, ModelLoadError: as ``build_speculation``.
    """
    from .engine import Engine
    from .models.weights import Checkpoint
    from .target import LocalTarget
    from .tokenizer import load_tokenizer

    if spec.drafter == "remote" and drafter is None:
        raise ConfigError("a remote drafter is connected by its caller: pass drafter=")
    if share is not None:
        if checkpoint is not None or runner_config is not None:
            raise ValueError("give either share or a checkpoint / runner_config, not both")
        if share.requests or share.waiting:
            raise ValueError("an engine's target is shared only while it is idle (no requests)")
        if not isinstance(share.target, LocalTarget):
            raise ValueError("only a local target is shared")
        while share.has_unfinished():  # a chained round launched past its requests' end: collect it (frees slots)
            share.step()
        checkpoint, runner_config = share.checkpoint, share.runner_config
        tokenizer = share.tokenizer
    if checkpoint is None or not isinstance(checkpoint, Checkpoint):
        from .models.weights import load_checkpoint

        checkpoint = load_checkpoint(checkpoint)
    if runner_config is None:
        from .models.runner import default_runner_config

        runner_config = default_runner_config()
    needs_policy_cost = spec.measures_cost and cost is None
    if not needs_policy_cost:
        speculation = build_speculation(spec, checkpoint, runner_config, drafter=drafter, weights=weights, cost=cost,
                                        store=store)
        drafter = speculation.drafter
    elif drafter is None:  # the policy's cost model is measured on the engine's runner, built after the drafter
        from .drafters.factory import build_drafter

        drafter = build_drafter(spec.drafter, spec.draft_model, checkpoint, runner_config, weights=weights)
    taps = tuple(drafter.target_taps) if drafter is not None and drafter.target_taps else ()
    if share is not None and (not taps or tuple(share.runner_config.taps) == taps):
        target = share.target
    else:
        target = LocalTarget(checkpoint, replace(runner_config, taps=taps) if taps else runner_config)
    if needs_policy_cost:
        # a bad predictor fails before the seconds of timing below, and is read once
        predictor = load_predictor(spec, checkpoint) if spec.policy == "predictor" else None
        if on_measure is not None:
            on_measure()
        speculation = build_speculation(spec, checkpoint, runner_config, drafter=drafter,
                                        cost=_policy_cost(spec, drafter, target), store=store, predictor=predictor)
    return Engine(tokenizer=tokenizer or load_tokenizer(checkpoint), target=target,
                  drafter=speculation.drafter, num_draft_tokens=speculation.num_draft_tokens,
                  draft_policy=speculation.draft_policy, chained_rounds=speculation.chained_rounds,
                  verification_sink=verification_sink)
