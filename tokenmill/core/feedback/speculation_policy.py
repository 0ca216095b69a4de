"""How many tokens to speculate this step, aiming never to be slower than not speculating.

Speculation pays when a forward pass costs about the same for 1 or k + 1 tokens per request
(small batches: reading the weights dominates) and the drafts are often right. At high
concurrency the pass is compute-bound, so every rejected draft is paid for in full, and
speculating makes the server slower. The break-even point depends on the machine, the model,
the draft method and the text, so it is measured rather than modelled.

The policy is a small bandit per batch-size bucket (decoding requests 1, 2-3, 4-7, ...) over
k in 0..max_k: it runs the k with the best measured decode throughput and now and then
(every 16 steps, backing off to every 128 while the best k stays the same) tries a neighbour
of the best, so a change in acceptance (a new kind of prompt) is noticed. The first bucket
tries every k; later ones first compare k = 0 with the best k of the nearest bucket
measured (batch sizes next to each other behave alike), because for a draft model or EAGLE
every switch from k = 0 to drafting costs a catch-up over what the requests verified
meanwhile (bounded per step: spec_decode/catch_up.py). That catch-up is part of proposing,
and a step is charged the proposing of the drafts it verifies (StepObserver.ran),
so exploring k >= 1 pays for it.
Under load most steps also carry prefill chunks of newly admitted requests, so a step's time
is modelled as

    seconds = decode_cost(k) + prefill_cost * prefill_tokens

with the per-token prefill cost shared by every k of a bucket: an exponentially weighted
(decay 0.95: timings on shared cores are noisy) least-squares fit over all steps with
decodes, whose intercept at 0 prefill tokens is the decode cost of k. Its throughput is the
decode tokens per step over that cost. Because verification is lossless and seeded sampling
is keyed on output positions, the k it picks never changes what is generated, only how fast.

Speculation's gain mostly shrinks as the batch grows (the pass turns compute-bound), so once
a bucket has measured every k it tried slower than k = 0 (the best is 0), a larger bucket
runs k = 0 and tries k = 1 only once in `max_explore_every` steps, unless it has measured a
gain of its own: exploring there (a catch-up on every request for a draft model, a losing step
for any method) mostly loses, and on short replies the exploration alone cost more than it
found (issue 48: adaptive EAGLE at 0.78x of off at batch 16). Not strictly: where per-call
overhead dominates (a tiny model on a CPU) a batch amortises the drafts, so a larger bucket
keeps its rare tries. The losing bucket keeps exploring (backing off) and frees the larger
ones if drafting starts to pay there (`off_above`).

It lives in core, beside the scheduler that asks it for k, and knows nothing of proposers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# Steps at k = 0 a bucket needs before its verdict "speculation loses" turns larger ones off.
OFF_EVIDENCE_STEPS = 3


@dataclass
class _StepFit:
    """Exponentially weighted sums over the steps of one (bucket, k): x = prefill tokens,
    y = seconds, t = decode tokens generated."""

    weight: float = 0.0
    fastest: float = float("inf")  # the shortest step seen
    x: float = 0.0
    y: float = 0.0
    t: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, t: float, decay: float) -> None:
        self.weight = decay * self.weight + 1.0
        self.fastest = min(self.fastest, y)
        self.x = decay * self.x + x
        self.y = decay * self.y + y
        self.t = decay * self.t + t
        self.xx = decay * self.xx + x * x
        self.xy = decay * self.xy + x * y

    def covariance(self) -> tuple[float, float]:
        """(sum of (x - mean)(y - mean), sum of (x - mean)^2), weighted."""
        return (
            self.xy - self.x * self.y / self.weight,
            self.xx - self.x * self.x / self.weight,
        )


class SpeculationPolicy:
    def __init__(
        self,
        max_k: int,
        adaptive: bool = True,
        explore_every: int = 16,
        decay: float = 0.95,
        max_explore_every: int = 128,
    ) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.decay = decay
        self.fits: dict[tuple[int, int], _StepFit] = {}  # (bucket, k) -> its steps
        self.steps: defaultdict[int, int] = defaultdict(int)
        # Per bucket: when to explore next, the interval, the best k then, the direction.
        self.next_explore: dict[int, int] = {}
        self.explore_interval: dict[int, int] = {}
        self.best_at_exploration: dict[int, int] = {}
        self.explore_direction: dict[int, int] = {}
        # Per bucket: its throughput by k, until its next observation (choose runs every step).
        self._rates: dict[int, dict[int, float]] = {}

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return max(num_decodes, 1).bit_length()

    def choose(self, num_decodes: int) -> int:
        """k for a step with `num_decodes` decoding requests (0: requests finishing their
        prefill draft as a batch of one would)."""
        if not self.adaptive:
            return self.max_k
        bucket = self.bucket(num_decodes)
        self.steps[bucket] += 1
        off_above = self.off_above()
        if off_above is not None and bucket > off_above and not self._wins(bucket):
            # A smaller batch measured speculation losing: here it is tried once in
            # `max_explore_every` steps only (a gain of its own lifts the switch).
            return 1 if self.steps[bucket] % self.max_explore_every == 0 else 0
        untried = [k for k in range(self.max_k, -1, -1) if (bucket, k) not in self.fits]
        if untried and {b for b, _ in self.fits} <= {bucket}:
            return untried[0]  # the first bucket: try every k
        rates = self.throughput(bucket)
        for k in (0, self._starting_k(bucket)):  # a new bucket compares these two first
            if k not in rates:
                return k
        best = max(rates, key=rates.__getitem__)
        if self.steps[bucket] < self.next_explore.get(bucket, self.explore_every):
            return best
        return self._explore(bucket, best)

    def off_above(self) -> int | None:
        """The smallest bucket that has measured k = 0 (in `OFF_EVIDENCE_STEPS` steps or
        more: a tail of a few steps at a small batch is noise) and some k >= 1 and found k = 0
        the fastest, or None: buckets above it do not speculate."""
        for bucket in sorted({b for b, _ in self.fits}):
            if self.fits.get((bucket, 0), _StepFit()).weight < OFF_EVIDENCE_STEPS:
                continue
            rates = self.throughput(bucket)
            if len(rates) > 1 and max(rates, key=rates.__getitem__) == 0:
                return bucket
        return None

    def _wins(self, bucket: int) -> bool:
        """Whether `bucket` itself measured some k >= 1 faster than k = 0."""
        rates = self.throughput(bucket)
        return 0 in rates and max(rates, key=rates.__getitem__) > 0

    def _starting_k(self, bucket: int) -> int:
        """The best k of the nearest other bucket measured (batch sizes next to each other
        behave alike), else max_k."""
        others = {b for b, _ in self.fits} - {bucket}
        if not others:
            return self.max_k
        nearest = min(others, key=lambda b: (abs(b - bucket), b))
        rates = self.throughput(nearest)
        return max(rates, key=rates.__getitem__)

    def _explore(self, bucket: int, best: int) -> int:
        """A neighbour of `best`: in the direction that last improved it, else the other way
        than last time (first: down). While the best k stays the same, exploration backs off
        (interval doubling up to `max_explore_every`): trying a k that loses has a price (for
        a draft model, catching up on every request's context)."""
        interval = self.explore_interval.get(bucket, self.explore_every)
        previous = self.best_at_exploration.get(bucket)
        if previous == best:
            interval = min(2 * interval, self.max_explore_every)
            direction = -self.explore_direction.get(bucket, 1)
        else:
            interval = self.explore_every
            direction = 1 if previous is not None and best > previous else -1
        self.explore_interval[bucket] = interval
        self.best_at_exploration[bucket] = best
        self.next_explore[bucket] = self.steps[bucket] + interval
        neighbour = best + direction
        if not 0 <= neighbour <= self.max_k:
            direction = -direction
            neighbour = best + direction
        self.explore_direction[bucket] = direction
        return min(max(neighbour, 0), self.max_k)

    def observe(
        self,
        num_decodes: int,
        k: int,
        num_generated: int,
        seconds: float,
        num_prefill_tokens: int = 0,
    ) -> None:
        """One step with `num_decodes` decoding requests that verified `k` drafts each and
        generated `num_generated` tokens, next to `num_prefill_tokens` of prefill; verifying
        plus proposing its drafts (in the step before) plus the prefill took `seconds`."""
        if not self.adaptive or num_decodes == 0 or seconds <= 0:
            return
        key = (self.bucket(num_decodes), min(k, self.max_k))
        self._rates.pop(key[0], None)
        self.fits.setdefault(key, _StepFit()).add(
            num_prefill_tokens, seconds, num_generated, self.decay
        )

    def throughput(self, bucket: int) -> dict[int, float]:
        """Decode tokens per second of decode cost, per k measured in `bucket` (ks never
        tried there are absent)."""
        if bucket not in self._rates:
            self._rates[bucket] = self._measure(bucket)
        return self._rates[bucket]

    def _measure(self, bucket: int) -> dict[int, float]:
        fits = {k: f for (b, k), f in self.fits.items() if b == bucket}
        sums = [f.covariance() for f in fits.values()]
        variance = sum(v for _, v in sums)
        slope = max(0.0, sum(c for c, _ in sums) / variance) if variance > 1e-9 else 0.0
        rates = {}
        for k, fit in fits.items():
            cost = (fit.y - slope * fit.x) / fit.weight
            # A fit can overshoot on few samples: a decode cost under half the shortest step
            # seen is not believed.
            cost = max(cost, 0.5 * fit.fastest)
            rates[k] = fit.t / fit.weight / cost
        return rates
