"""The feedback loop: what the engine learns from its measured steps (the observer, the step
cost model, the step records) and the two budgets the scheduler reads from it: drafts per
step (the speculation policy) and prompt tokens per step (the prefill budget)."""
