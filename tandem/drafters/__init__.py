"""Drafters: n-gram (prompt lookup) and draft model. See ``base.Drafter`` for the interface."""

from .base import NUM_FEATURES, DraftProposal, DraftRequest, Drafter, distribution_features
from .draft_model import DraftModelDrafter, load_draft_checkpoint, truncated_checkpoint
from .lookup import LookupIndex
from .ngram import NgramDrafter

__all__ = [
    "NUM_FEATURES", "DraftModelDrafter", "DraftProposal", "DraftRequest", "Drafter", "NgramDrafter",
    "distribution_features", "load_draft_checkpoint", "LookupIndex", "truncated_checkpoint",
]
