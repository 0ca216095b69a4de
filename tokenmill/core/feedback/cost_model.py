"""What an engine step costs, learned from measured step times (plain Python, no tensors).

A step's time is modelled as linear in four features:

    seconds = fixed + per_decode * decode tokens + per_prefill * prefill tokens
              + per_context * context attended by the prefill tokens

where the last feature sums, over the step's prefill tokens, how many positions each one
attends to (a chunk of n tokens after c cached ones: n * c + n * (n + 1) / 2). That term is
why a fixed token budget cannot hold a latency: the last chunks of a long prompt cost many
times the first. Decode tokens include speculative drafts being verified.

The fit is an exponentially weighted least-squares over recent steps (they drift as the
batch and the machine's load change), made robust to the noise of a shared machine by
down-weighting steps far from the prediction (Huber weights: a step slowed 3x by another
job counts a quarter as much as one on the model), kept from wandering where recent steps
carry no information (only decodes: nothing about prefill) by a weak pull towards the
start-up calibration, and never negative per feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NUM_FEATURES = 4
# Steps observed before outliers are down-weighted (a cold model's predictions mean little).
MIN_STEPS_BEFORE_HUBER = 8.0

Coefficients = tuple[float, float, float, float]


@dataclass(frozen=True)
class StepShape:
    """The features of one step that its cost depends on."""

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_prefill_context: int = 0  # sum over prefill tokens of the positions each attends to

    def features(self) -> Coefficients:
        return (1.0, self.num_decode_tokens, self.num_prefill_tokens, self.num_prefill_context)

    def plus_chunk(self, num_tokens: int, num_cached: int) -> StepShape:
        """This step with one more prefill chunk of `num_tokens` after `num_cached` tokens."""
        return StepShape(
            self.num_decode_tokens,
            self.num_prefill_tokens + num_tokens,
            self.num_prefill_context + chunk_context(num_tokens, num_cached),
        )


def chunk_context(num_tokens: int, num_cached: int) -> int:
    """Positions attended to by a chunk of `num_tokens` after `num_cached` (causal)."""
    return num_tokens * num_cached + num_tokens * (num_tokens + 1) // 2


class CostModel(Protocol):
    """What the scheduler needs of a cost model (tests pass a fake)."""

    def describe(self) -> str:
        fixed, decode, prefill, context = (1000 * c for c in self.coefficients)
        return (
            f"{fixed:.2f} ms + {decode:.3f} ms/decode token + {prefill:.3f} ms/prompt token "
            f"+ {1000 * context:.3f} ms/1000 context positions"
        )

    def predict(self, shape: StepShape) -> float: ...

    def observe(self, shape: StepShape, seconds: float) -> None: ...


class StepCostModel:
    """The online fit described above.

    `prior` is the coefficients to fall back on (fixed, per decode token, per prefill token,
    per context position); its pull equals `prior_weight` steps whose features are `typical`.
    """

    def __init__(
        self,
        prior: Coefficients,
        typical: Coefficients = (1.0, 32.0, 256.0, 65536.0),
        *,
        decay: float = 0.98,
        prior_weight: float = 1.0,
        huber: float = 0.5,
    ) -> None:
        self.prior = list(prior)
        self.decay = decay
        self.huber = huber  # relative residual beyond which a step is down-weighted
        self.min_weight_for_huber = MIN_STEPS_BEFORE_HUBER
        self.ridge = [prior_weight * max(t, 1e-9) ** 2 for t in typical]
        self.xx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self.xy = [0.0] * NUM_FEATURES
        self.weight = 0.0  # decayed number of steps observed
        self.coefficients = [max(c, 0.0) for c in prior]

    @classmethod
    def calibrated(
        cls, samples: list[tuple[StepShape, float]], *, prior_weight: float = 1.0
    ) -> StepCostModel:
        """A model that starts from `samples` (the start-up calibration): their least-squares
        fit becomes the prior, and they count as the first steps observed. With no samples
        (a KV cache too small to calibrate in) it starts from nothing and learns online."""
        if not samples:
            return cls((0.0,) * NUM_FEATURES, prior_weight=1e-3)
        typical = tuple(
            max(max(abs(s.features()[i]) for s, _ in samples), 1.0) for i in range(NUM_FEATURES)
        )
        model = cls((0.0,) * NUM_FEATURES, typical, prior_weight=1e-6)  # type: ignore[arg-type]
        model.min_weight_for_huber = float("inf")  # every calibration step counts in full
        for shape, seconds in samples:
            model.observe(shape, seconds)
        model.min_weight_for_huber = MIN_STEPS_BEFORE_HUBER
        model.prior = list(model.coefficients)
        model.ridge = [prior_weight * t**2 for t in typical]
        return model

    def describe(self) -> str:
        fixed, decode, prefill, context = (1000 * c for c in self.coefficients)
        return (
            f"{fixed:.2f} ms + {decode:.3f} ms/decode token + {prefill:.3f} ms/prompt token "
            f"+ {1000 * context:.3f} ms/1000 context positions"
        )

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, shape.features(), strict=True))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0:
            return
        x = shape.features()
        weight = 1.0
        if self.weight >= self.min_weight_for_huber:
            predicted = self.predict(shape)
            relative = abs(seconds - predicted) / max(predicted, 1e-9)
            if relative > self.huber:
                weight = self.huber / relative
        d = self.decay
        for i in range(NUM_FEATURES):
            self.xy[i] = d * self.xy[i] + weight * x[i] * seconds
            row = self.xx[i]
            for j in range(NUM_FEATURES):
                row[j] = d * row[j] + weight * x[i] * x[j]
        self.weight = d * self.weight + 1.0
        self.coefficients = self._solve()

    def _solve(self) -> list[float]:
        """Ridge least squares towards the prior, with negative coefficients fixed at zero
        (a feature that seems to make steps faster is noise) and the rest re-solved."""
        active = list(range(NUM_FEATURES))
        while active:
            a = [[self.xx[i][j] for j in active] for i in active]
            for k, i in enumerate(active):
                a[k][k] += self.ridge[i]
            b = [self.xy[i] + self.ridge[i] * self.prior[i] for i in active]
            solution = _solve_linear(a, b)
            negative = {i for i, c in zip(active, solution, strict=True) if c < 0}
            if not negative:
                break
            active = [i for i in active if i not in negative]
        coefficients = [0.0] * NUM_FEATURES
        for i, c in zip(active, solution if active else [], strict=True):
            coefficients[i] = c
        return coefficients


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a small symmetric positive definite system (Gaussian elimination, scaled by the
    diagonal: the features differ by six orders of magnitude)."""
    n = len(b)
    scale = [1.0 / max(a[i][i], 1e-300) ** 0.5 for i in range(n)]
    m = [[a[i][j] * scale[i] * scale[j] for j in range(n)] + [b[i] * scale[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            m[col][col] = 1e-12
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    y = [0.0] * n
    for r in range(n - 1, -1, -1):
        y[r] = (m[r][n] - sum(m[r][c] * y[c] for c in range(r + 1, n))) / m[r][r]
    return [y[i] * scale[i] for i in range(n)]
