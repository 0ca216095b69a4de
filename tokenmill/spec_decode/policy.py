"""How many tokens to speculate this step: never slower than not speculating.

Speculation pays when a forward pass costs about the same for 1 or k + 1 tokens per request
(small batches: reading the weights dominates) and the drafts are often right. At high
concurrency the pass is compute-bound, so every rejected draft is paid for in full, and
speculating makes the server slower. The break-even point depends on the machine, the model,
the draft method and the text, so it is measured rather than modelled.

The policy is a small bandit per batch-size bucket (decoding requests 1, 2-3, 4-7, ...): it
keeps an exponential moving average (decay 0.95: a step's timing is noisy on shared cores)
of generated tokens per second of step time for each
k in 0..max_k, runs the best, tries each k once first, and every `explore_every` steps tries
a neighbour of the best so a change in acceptance (a new kind of prompt) is noticed. Only
pure-decode steps are measured: a prefill chunk in the step would dominate its time. Because
verification is lossless and seeded sampling is keyed on output positions, the k it picks
never changes what is generated, only how fast.
"""

from __future__ import annotations

from collections import defaultdict


class SpeculationPolicy:
    def __init__(
        self, max_k: int, adaptive: bool = True, explore_every: int = 16, decay: float = 0.95
    ) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.explore_every = explore_every
        self.decay = decay
        self.throughput: dict[tuple[int, int], float] = {}  # (bucket, k) -> tokens/s EMA
        self.steps: defaultdict[int, int] = defaultdict(int)
        self.last_choice: dict[int, int] = {}

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return max(num_decodes, 1).bit_length()

    def choose(self, num_decodes: int) -> int:
        if not self.adaptive or num_decodes == 0:
            return self.max_k
        bucket = self.bucket(num_decodes)
        self.steps[bucket] += 1
        untried = [k for k in range(self.max_k, -1, -1) if (bucket, k) not in self.throughput]
        if untried:
            choice = untried[0]
        else:
            choice = max(range(self.max_k + 1), key=lambda k: self.throughput[(bucket, k)])
            if self.steps[bucket] % self.explore_every == 0:
                step = 1 if (self.steps[bucket] // self.explore_every) % 2 else -1
                neighbour = choice + step
                if not 0 <= neighbour <= self.max_k:
                    neighbour = choice - step
                choice = min(max(neighbour, 0), self.max_k)
        self.last_choice[bucket] = choice
        return choice

    def observe(self, num_decodes: int, k: int, num_generated: int, seconds: float) -> None:
        """One pure-decode step: `k` drafts per request were verified, `num_generated` tokens
        came out, and the step (proposing included) took `seconds`."""
        if not self.adaptive or num_decodes == 0 or seconds <= 0:
            return
        key = (self.bucket(num_decodes), min(k, self.max_k))
        rate = num_generated / seconds
        old = self.throughput.get(key)
        self.throughput[key] = rate if old is None else self.decay * old + (1 - self.decay) * rate
