"""When waiting requests join a running batch (continuous batching's prefill timing).

A prefill runs eagerly: its host cost (launching every kernel of every layer) is about the same
whatever its row count, and the rounds queued behind it wait for it. A slot left free while
requests wait loses one row of every round. Admitting at every freed slot pays the first cost
over and over (at batch 64 with one or two requests per prefill it was most of a run's wall time);
waiting for many free slots pays the second. ``AdmissionPolicy`` balances the two.
"""

from __future__ import annotations

# (share, wait_rounds, overlap, intake_s) by default: ``tandem serve verifier`` and ``tandem bench``
# take them as ``--admission-share`` / ``--admission-wait-rounds`` / ``--[no-]admission-overlap`` /
# ``--admission-intake-ms`` (overlap off: lossless on a GPU, but +1-2% at batch 64 in one run and
# -6% / -13% (target-only / SpecFormer) in another, a round slowing while a prefill runs beside it;
# beside the rounds on a replica, 0.54x for SpecFormer at 64: docs/benchmarks.md; intake off)
ADMISSION_DEFAULTS = (1 / 8, 64, False, 0.0)
INTAKE_CAP = 4  # an intake window defers no request past this many windows after its arrival
MAX_INTAKE_S = 1.0  # the longest intake window (s): --admission-intake-ms takes up to 1000


def admission_settings(settings: tuple = ADMISSION_DEFAULTS) -> tuple[float, int, bool, float]:
    """``(share, wait_rounds, overlap, intake_s)``: ``settings`` with what they leave out at its
    default (``(share, wait_rounds)`` alone: overlap's and intake's), checked as ``AdmissionPolicy``
    checks them.

    Raises:
        ValueError: as ``AdmissionPolicy``.
    """
    full = (*settings, *ADMISSION_DEFAULTS[len(settings):])
    AdmissionPolicy(*full)
    return full


class AdmissionPolicy:
    """Whether the waiting requests are admitted now, while others run.

    Admit when any of:
    - ``share`` of the batch (``max_running``) is free, or every waiting request fits;
    - ``balance`` and the idle slot-rounds since the last prefill (each round, the free slots that
      waiting requests could use), times the mean round time, reach ``max_running`` times the
      measured cost of a prefill: the rows lost to waiting then equal the rows a prefill stalls
      (the ski-rental rule: keep paying the waiting cost until it matches the one-off cost, since
      when the next slots free is unknown);
    - a free slot has waited ``wait_rounds`` rounds for a waiting request (a bound on the time to
      first token beyond queueing). The count starts when a slot is free while requests wait, not
      when a request arrives: requests queued long before a slot frees (a burst) would otherwise
      all be "late" at once and every freed slot would be filled alone.

    An admission's prefill overlaps the rounds where the target can run it on a second stream
    (``overlap`` and ``LocalTarget.overlaps_admission``): the rounds of the running requests go
    on while it runs, and the admitted requests join the first round after it is done.

    With an intake window (``intake_s`` > 0), none of the above admits while requests are still
    arriving: while the newest waiting request came less than ``intake_s`` ago and the waiting
    ones leave slots free, admission waits, at most until ``INTAKE_CAP`` windows after the oldest
    waiting one's arrival (``intake_deadline``). A burst that reaches a replica over tens of
    milliseconds (requests forwarded one by one by a router) then fills its free slots in a few
    prefills instead of one small prefill a round (dynamic batching's queue delay, as in Triton
    Inference Server's ``max_queue_delay_microseconds``); a request alone waits ``intake_s``
    more for its first token. Where every request is queued at once (``generate``), the window
    only adds that wait.

    Attributes:
        share: fraction of ``max_running`` in [0, 1] (0: admit whenever a slot is free).
        wait_rounds: rounds, >= 0.
        overlap: run prefills beside the rounds where the target can (off: every prefill stops
            the rounds until it is done).
        intake_s: the intake window (s), in [0, ``MAX_INTAKE_S``] (0: off).
        balance: use the cost balance (off: share and wait_rounds only).
        prefill_s: smoothed host time of a prefill (s), None before the first one.
        idle_slot_rounds: slot-rounds left idle with requests waiting since the last prefill.
        idle_rounds: rounds with a slot idle and requests waiting since the last prefill.
        prefills, prefill_total_s: prefills noted and their host time in all (s).
    """

    def __init__(self, share: float = ADMISSION_DEFAULTS[0], wait_rounds: int = ADMISSION_DEFAULTS[1],
                 overlap: bool = ADMISSION_DEFAULTS[2], intake_s: float = ADMISSION_DEFAULTS[3],
                 balance: bool = True) -> None:
        """Raises: ValueError: ``share`` outside [0, 1] (or NaN), ``wait_rounds`` < 0, ``intake_s``
        outside [0, ``MAX_INTAKE_S``] (or NaN)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"admission share must be in [0, 1], got {share}")
        if wait_rounds < 0:
            raise ValueError(f"admission wait_rounds must be >= 0, got {wait_rounds}")
        if not 0.0 <= intake_s <= MAX_INTAKE_S:  # (NaN fails it too)
            raise ValueError(f"admission intake window must be in [0, {MAX_INTAKE_S:g}] s, got {intake_s}")
        self.share = share
        self.wait_rounds = wait_rounds
        self.overlap = bool(overlap)
        self.intake_s = float(intake_s)
        self.balance = balance
        self.prefill_s: float | None = None
        self.idle_slot_rounds = 0.0
        self.idle_rounds = 0
        self.prefills = 0
        self.prefill_total_s = 0.0

    def note_round(self, free: int, waiting: int) -> None:
        """A round ran with ``free`` usable slots and ``waiting`` requests queued."""
        self.idle_slot_rounds += min(free, waiting)
        self.idle_rounds += min(free, waiting) > 0

    def note_prefill(self, seconds: float) -> None:
        """A prefill took ``seconds`` of host time (smoothed, weight 0.2 for the newest)."""
        self.prefill_s = seconds if self.prefill_s is None else 0.8 * self.prefill_s + 0.2 * seconds
        self.prefills += 1
        self.prefill_total_s += seconds
        self.idle_slot_rounds = 0.0
        self.idle_rounds = 0

    def intake_deadline(self, free: int, waiting: int, oldest_s: float, newest_s: float, now: float) -> float | None:
        """While the intake window holds admission back, the time (``time.perf_counter`` seconds)
        it ends; else None (see the class docstring).

        Args:
            free: slots a new request could take now; waiting: queued requests.
            oldest_s, newest_s: arrival times of the oldest and the newest waiting request.
            now: the time now.
        """
        if self.intake_s <= 0.0 or not waiting or waiting >= free:
            return None
        end = min(newest_s + self.intake_s, oldest_s + INTAKE_CAP * self.intake_s)
        return end if now < end else None

    def due(self, free: int, waiting: int, max_running: int, round_s: float) -> bool:
        """Whether to admit now (see the class docstring).

        Args:
            free: slots a new request could take now (KV slots and the running limit).
            waiting: queued requests (>= 1).
            max_running: the batch limit.
            round_s: mean wall time of a round (s); 0 before any.
        """
        if free >= min(waiting, max(1, int(max_running * self.share))):
            return True
        if free and self.idle_rounds >= self.wait_rounds:
            return True
        if not self.balance or free == 0 or self.prefill_s is None or round_s <= 0:
            return False
        return self.idle_slot_rounds * round_s >= max_running * self.prefill_s
