"""Drafters by name, with the shipped weights as defaults (``tandem.speculation`` builds every
drafter through ``build_drafter``)."""

from __future__ import annotations

from pathlib import Path

from ..models.runner import RunnerConfig
from ..models.weights import Checkpoint
from .base import Drafter

DRAFTER_KINDS = ("ngram", "draft-model", "specformer")


def drafter_weights(kind: str, path: str | None, checkpoint: Checkpoint, option: str = "--draft-model") -> str:
    """The weights a trained drafter loads: ``path`` when given, else the ones shipped for the
    bundled target (``DEFAULT_DRAFT_MODEL`` / ``DEFAULT_SPECFORMER``).

    Args:
        kind: "draft-model" or "specformer".
        path: the user's choice (``option`` names it in errors), or None.
        checkpoint: the target.

    Raises:
        InvalidRequestError: an empty path, or no path and no shipped weights for this target.
    """
    from ..errors import InvalidRequestError
    from ..models.weights import is_bundled_model
    from .draft_model import DEFAULT_DRAFT_MODEL
    from .specformer import DEFAULT_SPECFORMER

    if path is not None:
        if not str(path).strip():
            raise InvalidRequestError(f"{option} is empty; give a weights directory, or leave it out for the "
                                      "shipped weights")
        return path
    default = DEFAULT_DRAFT_MODEL if kind == "draft-model" else DEFAULT_SPECFORMER
    if not is_bundled_model(checkpoint.path):
        raise InvalidRequestError(f"{kind} needs {option} PATH for a target other than the bundled model "
                                  f"(train one with tandem train {kind})")
    if not (default / "model.safetensors").is_file():
        raise InvalidRequestError(f"the shipped {kind} weights are missing at {default}; pass {option} PATH")
    return str(default)


def build_drafter(kind: str, path: str | None, checkpoint: Checkpoint, config: RunnerConfig,
                  weights=None) -> Drafter | None:
    """The drafter of kind ``kind`` (None for "none"); trained drafters default to the shipped
    ones when the target is the bundled model (``drafter_weights``). Called by
    ``tandem.speculation.build_speculation``, which holds the rest of a speculative setup.

    Args:
        kind: "none", "ngram", "draft-model" or "specformer".
        path: a trained drafter's weights (None: the shipped ones).
        checkpoint, config: the target and its runner settings (a draft model runs with them).
        weights: the weights already loaded (a draft model's ``Checkpoint``, a SpecFormer head):
            ``path`` is then not read again.

    Raises:
        InvalidRequestError: no weights for this target; ModelLoadError: unloadable drafter.
    """
    from .draft_model import DraftModelDrafter, load_draft_checkpoint
    from .ngram import NgramDrafter
    from .specformer import SpecFormerDrafter, load_specformer

    if kind == "ngram":
        return NgramDrafter()
    if kind not in DRAFTER_KINDS:
        return None
    if weights is None:
        path = drafter_weights(kind, path, checkpoint)
        weights = load_specformer(path) if kind == "specformer" else load_draft_checkpoint(path, checkpoint)
    if kind == "specformer":
        return SpecFormerDrafter(weights)
    return DraftModelDrafter(weights, config)


PREDICTOR_FILE = "predictor.safetensors"  # an acceptance predictor lives next to its drafter's weights
# the n-gram drafter's predictor for the bundled target (n-gram has no weights to sit beside)
NGRAM_PREDICTOR_DIR = Path(__file__).parent / "weights" / "ngram-smollm2-135m"


def drafter_predictor(kind: str, path: str | None, checkpoint: Checkpoint) -> str | None:
    """The acceptance predictor saved next to a trained drafter's weights (``path``, or the shipped
    weights for the bundled target); for n-gram, which has no weights, the one shipped for the
    bundled target (``NGRAM_PREDICTOR_DIR``); None when there is none."""
    from pathlib import Path

    from ..models.weights import is_bundled_model

    if kind == "ngram":
        candidate = NGRAM_PREDICTOR_DIR / PREDICTOR_FILE
        bundled = checkpoint is not None and is_bundled_model(checkpoint.path)
        return str(candidate) if bundled and candidate.is_file() else None
    if kind not in ("draft-model", "specformer"):
        return None
    try:
        weights = Path(drafter_weights(kind, path, checkpoint))
    except Exception:  # no weights for this target: no predictor either
        return None
    candidate = (weights if weights.is_dir() else weights.parent) / PREDICTOR_FILE
    return str(candidate) if candidate.is_file() else None
