"""Difficulty (acceptance) predictor: P(the target accepts this draft token) from drafter features.

Implements the context difficulty predictor of "Accelerating Speculative Decoding via Efficient
Context-Aware Draft Generation" (ACL 2025): a one-hidden-layer MLP over per-position draft
features (entropy of q, top-1 probability, top-1 − top-2 margin, position in the draft;
``tandem.drafters.base.distribution_features``), trained with binary cross-entropy on
verification logs (accepted = 1, the first rejected position = 0; positions after the first
rejection carry no label).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .drafters.base import NUM_FEATURES

FEATURE_NAMES = ("entropy", "top1_prob", "top1_margin", "position")


@dataclass
class VerificationRecord:
    """Labelled draft positions of one verification step.

    Attributes:
        features: ``[n, NUM_FEATURES]`` float32 for the n drafted positions.
        num_accepted: drafts the target accepted (m).
        drafter: drafter name.
        states: ``[n, d]`` the drafter's hidden state at each drafted position, when it recorded
            them (``DraftProposal.states``); else None.
    """

    features: torch.Tensor
    num_accepted: int
    drafter: str
    states: torch.Tensor | None = None

    def labelled_states(self) -> np.ndarray | None:
        """The states ``[L, d]`` (float16) of the positions ``labelled`` returns, or None."""
        if self.states is None:
            return None
        keep = min(self.features.shape[0], self.num_accepted + 1)
        return self.states[:keep].float().numpy().astype(np.float16)

    def labelled(self) -> tuple[np.ndarray, np.ndarray]:
        """(features ``[L, F]``, labels ``[L]``) for positions 1..min(n, m + 1)."""
        n = self.features.shape[0]
        keep = min(n, self.num_accepted + 1)
        labels = np.zeros(keep, dtype=np.float32)
        labels[:min(self.num_accepted, keep)] = 1.0
        return self.features[:keep].numpy().astype(np.float32), labels


class AcceptancePredictor(nn.Module):
    """MLP: standardised features ``[n, F]`` (and, optionally, a learned low-rank projection of the
    drafter's hidden states ``[n, state_dim]`` to ``state_proj`` values) -> acceptance logits ``[n]``.

    Args:
        num_features: F.
        hidden: hidden width.
        state_dim: width of the drafter states it reads (0: features only; the SpecFormer head's
            states, ``DraftProposal.states``, are the target's hidden size).
        state_proj: the states' projection width (ignored when ``state_dim`` is 0).
        drafter: name of the drafter whose verification logs it was trained on ("ngram",
            "specformer", "draft-model"; None: not recorded). Saved with the weights, so a
            predictor used over another drafter can say so (``tandem.speculation.load_predictor``).
    """

    def __init__(self, num_features: int = NUM_FEATURES, hidden: int = 32, state_dim: int = 0,
                 state_proj: int = 8, drafter: str | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("mean", torch.zeros(num_features))
        self.register_buffer("std", torch.ones(num_features))
        self.state_dim = state_dim
        self.state_proj = state_proj if state_dim else 0
        # the states pass the target's final norm already: a plain linear map, no standardisation
        self.proj = nn.Linear(state_dim, state_proj, bias=False) if state_dim else None
        self.net = nn.Sequential(nn.Linear(num_features + self.state_proj, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.hidden = hidden

    def forward(self, features: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[n]``.

        Raises:
            ValueError: ``states`` missing for a predictor that reads them, or of the wrong width.
        """
        x = (features - self.mean) / self.std
        if self.proj is not None:
            if states is None or states.shape[-1] != self.state_dim:
                raise ValueError(f"this predictor reads the drafter's states [n, {self.state_dim}]; got "
                                 f"{None if states is None else tuple(states.shape)}")
            x = torch.cat([x, self.proj(states.to(x.dtype))], dim=-1)
        return self.net(x).squeeze(-1)

    @torch.no_grad()
    def probabilities(self, features: torch.Tensor) -> torch.Tensor:
        """Acceptance probabilities ``[n]`` for features ``[n, F]``, computed on the features'
        device with a copy of the weights kept there (made on the first call for a device, which
        must not be inside a CUDA-graph capture): no host transfer, so a chained round's graph can
        score its drafts (``SpecFormerDrafter.set_acceptance_scorer``)."""
        model = self if self.mean.device == features.device else self._device_copy(features.device)
        return torch.sigmoid(model(features.float()))

    def _device_copy(self, device: torch.device) -> "AcceptancePredictor":
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            clone = AcceptancePredictor(self.mean.numel(), self.hidden, self.state_dim, self.state_proj)
            clone.load_state_dict(self.state_dict())
            copies[device] = clone.to(device).eval()
        return copies[device]

    @torch.no_grad()
    def predict(self, features: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        """Acceptance probabilities ``[n]`` for features ``[n, F]`` (and states ``[n, state_dim]``
        for a predictor that reads them; any device; returns CPU float32)."""
        if features.numel() == 0:
            return torch.zeros(0)
        return torch.sigmoid(self(features.float().cpu(), None if states is None else states.float().cpu()))

    def save(self, path: str | Path, report: "PredictorReport | None" = None) -> None:
        """Write ``path`` (safetensors) and, with a report, ``path.json`` beside it."""
        from safetensors.torch import save_file

        meta = {"num_features": str(self.mean.numel()), "hidden": str(self.hidden), "features": ",".join(FEATURE_NAMES),
                "state_dim": str(self.state_dim), "state_proj": str(self.state_proj)}
        if self.drafter:
            meta["drafter"] = self.drafter
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path), metadata=meta)
        if report is not None:
            # strict JSON: a figure not measured (NaN) is null
            fields = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(report).items()}
            Path(str(path) + ".json").write_text(json.dumps(fields, indent=2, allow_nan=False))

    @classmethod
    def load(cls, path: str | Path, *, features_only: bool = False) -> "AcceptancePredictor":
        """Read a predictor saved by ``save``.

        Args:
            features_only: refuse a predictor that reads the drafter's states (what serving
                needs: its draft policies score features alone).

        ``path`` may also be a directory holding ``predictor.safetensors`` (a drafter's weights).

        Raises:
            FileNotFoundError: no such file; ValueError: not a predictor file, or (with
            ``features_only``) one that reads states.
        """
        from safetensors import safe_open

        p = Path(path)
        if p.is_dir() and (p / "predictor.safetensors").is_file():  # a drafter's weights directory
            p = p / "predictor.safetensors"
        if not p.is_file():
            raise FileNotFoundError(f"no predictor at {p}" + (" (a directory without predictor.safetensors)"
                                                             if p.is_dir() else ""))
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                if "num_features" not in meta:
                    raise ValueError(f"{p} is not a Tandem acceptance predictor")
                model = cls(int(meta["num_features"]), int(meta["hidden"]), int(meta.get("state_dim", 0)),
                            int(meta.get("state_proj", 0)) or 8, meta.get("drafter") or None)
                model.load_state_dict({k: f.get_tensor(k) for k in f.keys()})
        except ValueError:
            raise
        except Exception as exc:  # not safetensors at all, or tensors that do not fit
            raise ValueError(f"{p} is not a Tandem acceptance predictor ({type(exc).__name__})") from None
        if features_only and model.state_dim:
            raise ValueError(f"{p} reads the drafter's hidden states (trained with --state-projection), which "
                             "serving does not supply; train one on the features alone")
        return model.eval()


@dataclass
class PredictorReport:
    """Held-out quality and cost of a trained predictor.

    Attributes:
        n_train, n_val: labelled positions used.
        positive_rate: share of accepted labels (validation).
        auc: ROC AUC of the predictor (validation).
        entropy_auc: AUC of the entropy-only rule (score = −entropy) on the same data.
        position_auc: AUC of the draft position alone (the better of its two directions) on the
            same data: all a predictor could read from a one-hot drafter's features.
        ece: expected calibration error, 10 equal-width bins (validation).
        features_only_auc: for a predictor that reads the drafter's states, the AUC of the same
            MLP trained without them on the same split and seed (NaN otherwise): what the states add.
        cost_us_per_token: predictor time per drafted position (µs, CPU, batch of 64).
    """

    n_train: int
    n_val: int
    positive_rate: float
    auc: float
    entropy_auc: float
    ece: float
    cost_us_per_token: float
    position_auc: float = float("nan")  # (reports written before it have none)
    features_only_auc: float = float("nan")  # with states: the same MLP without them, same split and seed


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the Mann–Whitney rank statistic (ties get average ranks); NaN if one class."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    order = scores.argsort(kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def calibration_bins(probs: np.ndarray, labels: np.ndarray, bins: int = 10):
    """Per equal-width bin: (mean predicted, observed rate, count)."""
    probs, labels = np.asarray(probs, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    idx = np.minimum((probs * bins).astype(int), bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        out.append((probs[m].mean() if m.any() else np.nan, labels[m].mean() if m.any() else np.nan, int(m.sum())))
    return out


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int = 10) -> float:
    """ECE = Σ_b (n_b / N) |mean predicted_b − observed rate_b|."""
    n = len(probs)
    return float(sum(c / n * abs(p - y) for p, y, c in calibration_bins(probs, labels, bins) if c))


def reliability_diagram(probs: np.ndarray, labels: np.ndarray, path: str | Path, title: str = "") -> None:
    """Write a reliability diagram (predicted vs observed acceptance per bin) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = [(p, y, c) for p, y, c in calibration_bins(probs, labels) if c]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    ax.plot([b[0] for b in bins], [b[1] for b in bins], "o-", label="predictor")
    ax.set_xlabel("predicted acceptance probability")
    ax.set_ylabel("observed acceptance rate")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(title or f"ECE {expected_calibration_error(probs, labels):.3f}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def validation_split(n: int, val_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(validation indices, training indices) of n examples: the split ``train_predictor`` uses."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(n * val_fraction))
    return perm[:n_val], perm[n_val:]


def train_predictor(features: np.ndarray, labels: np.ndarray, *, hidden: int = 32, epochs: int = 40,
                    lr: float = 3e-3, batch_size: int = 1024, val_fraction: float = 0.2, seed: int = 0,
                    states: np.ndarray | None = None, state_proj: int = 8) -> tuple[AcceptancePredictor, PredictorReport]:
    """Fit the MLP with binary cross-entropy (AdamW) and report held-out AUC / ECE.

    Args:
        features: ``[N, F]`` float32; labels: ``[N]`` in {0, 1}.
        states: ``[N, d]`` the drafter's hidden states at the same positions (``tandem
            collect-logs --states``): the predictor then also reads a learned ``state_proj``-wide
            projection of them, and the report gives the features-only MLP's AUC beside its own.

    Raises:
        ValueError: fewer than 20 examples, mismatched lengths, or a single class.
    """
    features = np.asarray(features, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.float32)
    if len(features) != len(labels) or len(labels) < 20:
        raise ValueError(f"need >= 20 labelled positions with matching features, got {len(features)} / {len(labels)}")
    if states is not None and (states.ndim != 2 or len(states) != len(labels)):
        raise ValueError(f"states must be [N, d] with N = {len(labels)} labelled positions, got {states.shape}")
    if labels.min() == labels.max():
        raise ValueError("labels have a single class; collect logs where some drafts are rejected and some accepted")
    val, tr = validation_split(len(labels), val_fraction, seed)
    st = None if states is None else torch.from_numpy(np.asarray(states, dtype=np.float32))

    def fit(with_states: bool) -> AcceptancePredictor:
        torch.manual_seed(seed)
        model = AcceptancePredictor(features.shape[1], hidden, st.shape[1] if with_states else 0, state_proj)
        x_tr, y_tr = torch.from_numpy(features[tr]), torch.from_numpy(labels[tr])
        s_tr = st[tr] if with_states else None
        model.mean.copy_(x_tr.mean(0))
        model.std.copy_(x_tr.std(0).clamp_min(1e-6))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
        loss_fn = nn.BCEWithLogitsLoss()
        for _ in range(epochs):
            order = torch.randperm(len(tr))
            for i in range(0, len(tr), batch_size):
                b = order[i:i + batch_size]
                opt.zero_grad()
                loss_fn(model(x_tr[b], None if s_tr is None else s_tr[b]), y_tr[b]).backward()
                opt.step()
        return model.eval()

    model = fit(st is not None)
    s_val = None if st is None else st[val]
    p_val = model.predict(torch.from_numpy(features[val]), s_val).numpy()
    features_only = float("nan")
    if st is not None:
        features_only = roc_auc(fit(False).predict(torch.from_numpy(features[val])).numpy(), labels[val])
    sample, s_sample = torch.from_numpy(features[val][:64]), None if s_val is None else s_val[:64]
    t0 = time.perf_counter()
    for _ in range(200):
        model.predict(sample, s_sample)
    cost_us = (time.perf_counter() - t0) / 200 / len(sample) * 1e6
    report = PredictorReport(
        n_train=len(tr), n_val=len(val), positive_rate=float(labels[val].mean()),
        auc=roc_auc(p_val, labels[val]), entropy_auc=roc_auc(-features[val][:, 0], labels[val]),
        ece=expected_calibration_error(p_val, labels[val]), cost_us_per_token=cost_us,
        position_auc=max(roc_auc(features[val][:, 3], labels[val]), roc_auc(-features[val][:, 3], labels[val])),
        features_only_auc=features_only)
    return model, report
