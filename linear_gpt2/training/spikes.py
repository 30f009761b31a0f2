"""Loss spikes, counted on the host at no device cost (every run; ``log.spike_margin``)."""

from __future__ import annotations

import collections
import math
import statistics


class SpikeCounter:
    """Loss spikes: a step whose loss exceeds the baseline of the losses before it by more than
    ``margin`` (nats). The baseline is the lower of two: the running mean (an exponential moving
    average with weight ``1 - 1 / window`` on the history, started at the first loss, every
    step included: a lasting jump is absorbed after about ``window`` steps) and the median of
    the last ``RECENT`` losses. The mean alone lags a loss that is still falling fast (a rise
    from 6.9 to 10.4 while the mean sat near 10 went uncounted in the CPU context grid); the
    short median follows the descent and ignores one outlier. Consecutive steps above the line
    are one spike, reported at its first step; the first ``min(window, 10)`` steps only build
    the baseline. ``margin = 0`` turns counting off.

    ``update(step, loss) -> bool`` (True at the first step of a spike); ``count`` and ``steps``
    (the first step of each spike) so far; ``baseline`` the line's base before the next loss.
    Non-finite losses are ignored (the trainer reports those itself)."""

    RECENT = 5

    def __init__(self, margin: float, window: int):
        self.margin, self.window = float(margin), max(1, int(window))
        self.alpha = 1.0 - 1.0 / self.window
        self.warmup = min(self.window, 10)
        self.mean: float | None = None
        self.recent: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self.seen = 0
        self.inside = False
        self.steps: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.margin > 0

    @property
    def count(self) -> int:
        return len(self.steps)

    @property
    def baseline(self) -> float | None:
        if self.mean is None:
            return None
        return min(self.mean, statistics.median(self.recent))

    def update(self, step: int, loss: float) -> bool:
        if not self.enabled or not math.isfinite(loss):
            return False
        spike = False
        if self.mean is not None and self.seen >= self.warmup:
            above = loss > self.baseline + self.margin
            spike = above and not self.inside
            self.inside = above
            if spike:
                self.steps.append(step)
        self.mean = loss if self.mean is None else self.alpha * self.mean + (1 - self.alpha) * loss
        self.recent.append(loss)
        self.seen += 1
        return spike
