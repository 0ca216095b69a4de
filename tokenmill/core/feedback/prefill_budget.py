"""How many prompt tokens each request may compute in one step, beyond the token budget.

Three limits, all off by default (then a step's prefill is bounded by the token budget alone):

- an inter-token-latency target (`--itl-target-ms`): the step's predicted time (a
  `CostModel`) must stay within the target once the running decodes are paid for, as
  Sarathi-Serve sizes its chunks; except that a step always gets a floor of prefill *time*
  (half the decodes' predicted time), so a long prompt progresses even when the decodes
  take the whole target, and a floor chunk deep into a long context costs no more than
  one at its start;
- vLLM's `--long-prefill-token-threshold`: at most this many tokens per request and step;
- vLLM's `--max-num-partial-prefills`: how many prompts may be cut mid-way in one step (so a
  long prompt can't take every step's prefill while short prompts queue behind it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill.core.feedback.cost_model import CostModel, StepShape

# The prefill time a step may always take under a latency target, as a share of the decodes'
# predicted time: prompts progress (a third of each step) even when the decodes alone take
# the whole target, and a floor step stays within 1.5x the decodes' time (a floor counted
# in tokens, 16 before, cost 1-2x the target once those tokens attended to 4,000 cached
# positions). With the target at 1.5x the decodes or more, the floor fits within it.
PREFILL_FLOOR_SHARE = 0.5


class PredictionError:
    """How far measured steps with prompt tokens ran over the cost model's predictions lately:
    the `quantile` of measured / predicted over the last `window` such steps, between 1 and
    `cap`. The model fits the mean, so about half the steps sized to a target land over it;
    sizing to the target divided by this factor puts the `quantile` of steps within it
    (measured: with the plain fit, 50-60% of the steps under a target went over it). The
    ratio is of whole steps: a shared machine slows decodes and chunks alike, and the
    chunks' added time alone over its prediction is a noisier ratio (it carries the decodes'
    error too; in one side-by-side run it gave 1.4x the TTFT at the same p99)."""

    def __init__(
        self, window: int = 64, quantile: float = 0.9, cap: float = 2.0, min_steps: int = 8
    ) -> None:
        self.ratios: deque[float] = deque(maxlen=window)
        self.quantile = quantile
        self.cap = cap
        self.min_steps = min_steps

    def observe(self, predicted: float, seconds: float) -> None:
        if predicted > 0 and seconds > 0:
            self.ratios.append(seconds / predicted)

    @property
    def factor(self) -> float:
        if len(self.ratios) < self.min_steps:
            return 1.0
        ordered = sorted(self.ratios)
        upper = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
        return min(max(upper, 1.0), self.cap)


@dataclass
class PrefillLimits:
    """The engine-wide settings (see the module docstring)."""

    itl_target: float | None = None  # seconds
    cost_model: CostModel | None = None  # required with a target
    long_prefill_token_threshold: int = 0  # 0: no per-request cap
    max_num_partial_prefills: int = 1
    floor_share: float = PREFILL_FLOOR_SHARE
    prediction_error: PredictionError = field(default_factory=PredictionError)

    def __post_init__(self) -> None:
        if self.itl_target is not None and self.cost_model is None:
            raise ValueError("an ITL target needs a cost model")

    @property
    def active(self) -> bool:
        """Whether any limit binds beyond the token budget (with a token budget alone at most
        one prompt per step is ever cut, so the partial-prefill cap never binds)."""
        return self.itl_target is not None or self.long_prefill_token_threshold > 0


class PrefillBudget:
    """One step's prefill allowance: the decodes are reserved first, then `grant` sizes each
    prompt chunk in scheduling order and `take` books it."""

    def __init__(self, limits: PrefillLimits, num_decode_tokens: int) -> None:
        self.limits = limits
        self.shape = StepShape(num_decode_tokens=num_decode_tokens)
        self.decode_seconds = 0.0  # the decodes' predicted time, with a target
        if limits.cost_model is not None:
            self.decode_seconds = limits.cost_model.predict(self.shape)
        self.num_partial = 0
        self.num_granted = 0  # prompt tokens given this step
        self.wanted = False  # whether any prompt asked for tokens this step

    def grant(self, num_left: int, num_cached: int, token_budget: int) -> int:
        """Tokens (0 to `num_left`) that a prompt with `num_left` tokens to compute after
        `num_cached` may compute this step, with `token_budget` tokens left in the step."""
        self.wanted = True
        limits = self.limits
        num = min(num_left, token_budget)
        if limits.long_prefill_token_threshold > 0:
            num = min(num, limits.long_prefill_token_threshold)
        if limits.itl_target is not None:
            fitting = self._tokens_within(num, num_cached, self._step_limit())
            if self.num_granted == 0 and num > 0:
                fitting = max(fitting, self._floor_tokens(num, num_cached), 1)
            num = min(num, fitting)
        if num < num_left and self.num_partial >= limits.max_num_partial_prefills:
            return 0
        return num

    def take(self, num_tokens: int, num_left: int, num_cached: int) -> None:
        self.shape = self.shape.plus_chunk(num_tokens, num_cached)
        self.num_granted += num_tokens
        if num_tokens < num_left:
            self.num_partial += 1

    def _step_limit(self) -> float:
        """The predicted step time the prompt chunks may fill up to: the target, shrunk by
        how far steps ran over their predictions lately."""
        target = self.limits.itl_target
        assert target is not None
        return target / self.limits.prediction_error.factor

    def _floor_tokens(self, upper: int, num_cached: int) -> int:
        """The tokens (<= upper) that fit the progress floor: a share of the decodes'
        predicted time, on top of them."""
        floor = self.limits.floor_share * self.decode_seconds
        return self._tokens_within(upper, num_cached, self.decode_seconds + floor)

    def _tokens_within(self, upper: int, num_cached: int, limit: float) -> int:
        """The most tokens (<= upper) whose chunk keeps the step predicted within `limit`
        seconds: a binary search, as the cost of a chunk grows with its length for any sane
        model."""
        model = self.limits.cost_model
        assert model is not None
        if model.predict(self.shape.plus_chunk(upper, num_cached)) <= limit:
            return upper
        low, high = 0, upper  # predict(low) fits (or low = 0), predict(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if model.predict(self.shape.plus_chunk(middle, num_cached)) <= limit:
                low = middle
            else:
                high = middle
        return low
