"""Structured outputs benchmark: the cost of grammar enforcement, side by side in one run.

    python -m benchmarks.structured_outputs [--model PATH] [--repeats 5] [--tokens 64]

With no model: the built-in demo model.
1. Decode step time at batch 1, 8 and 32 with no row constrained, half of them and all of
   them (a JSON schema whose output does not end within --tokens, so the batch stays full),
   sampled at temperature 1.0. Runs interleaved (in a shuffled order); the median over every
   decode step of a cell's runs (on a shared machine a run's mean takes in every burst of
   load from other work; the median of its hundreds of steps does not). Beside it, the time
   spent per step in structured-output code (filling the bitmask, applying it, advancing
   matchers), timed directly: on a shared machine the difference of two step times is
   noisier than the thing measured.
2. Per schema, median of --repeats: validation (on the engine thread, before the request is
   queued) and grammar compile time (on the compile thread), caches bypassed.
3. Constrained rows under n-gram speculation (k = 4, fixed): drafts checked against the
   grammar and verified (rollback) vs no drafts for constrained rows, output tokens/s.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import statistics
import time
from collections.abc import Callable

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.backend import XgrammarBackend, validate
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.request_grammar import RequestGrammar
from tokenmill.worker import batch_inputs  # where the runner finds apply_grammar_bitmask

# Never complete within a few hundred tokens: at least 64 objects, each with free text.
LONG_SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}
SCHEMAS = {
    "flat object (3 fields)": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
    },
    "nested, arrays, enums, ranges": LONG_SCHEMA,
    "20 properties, 3 levels": {
        "type": "object",
        "properties": {
            f"field_{i}": {
                "type": "object",
                "properties": {
                    "value": {"type": "number", "minimum": -1000, "maximum": 1000},
                    "label": {"type": "string", "maxLength": 32},
                    "items": {
                        "type": "array",
                        "items": {"type": "object", "properties": {"id": {"type": "integer"}}},
                    },
                },
                "required": ["value", "label"],
            }
            for i in range(20)
        },
        "additionalProperties": False,
    },
    "json_object": None,
}
PROMPT = "Reverse this list: apple banana cherry dog"


def structured(schema: dict | None) -> StructuredOutputsParams:
    return (
        StructuredOutputsParams(json=schema)
        if schema
        else StructuredOutputsParams(json_object=True)
    )


class GrammarTimer:
    """Seconds spent in the structured-output package's work of a step, by wrapping its public
    entry points: filling the bitmask, applying it to the logits (wrapped where the runner
    calls it), advancing the matchers."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._wrap(StructuredOutputManager, "grammar_bitmask")
        self._wrap(batch_inputs, "apply_grammar_bitmask")
        self._wrap(RequestGrammar, "accept_tokens")

    def _wrap(self, owner: object, name: str) -> None:
        original: Callable = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


TIMER = GrammarTimer()
REQUEST_IDS = itertools.count()


def step_times(
    llm: LLM, batch: int, num_constrained: int, tokens: int
) -> tuple[list[float], list[float]]:
    """Seconds of each decode step generating `tokens` tokens for `batch` rows (the first
    step, which prefills the prompts, left out), and of each the seconds in structured-output
    code."""
    kind = RequestOutputKind.FINAL_ONLY
    free = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, output_kind=kind)
    constrained = SamplingParams(
        temperature=1.0,
        max_tokens=tokens,
        ignore_eos=True,
        structured_outputs=structured(LONG_SCHEMA),
        output_kind=kind,
    )
    engine = llm.engine
    for i in range(batch):
        engine.add_request(
            f"{next(REQUEST_IDS)}", PROMPT, constrained if i < num_constrained else free
        )
    steps: list[float] = []
    grammar: list[float] = []
    finished = []
    while engine.has_unfinished_requests():
        in_grammar, start = TIMER.seconds, time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - start)
        grammar.append(TIMER.seconds - in_grammar)
        finished += [o for o in outputs if o.finished]
    assert len(finished) == batch
    assert all(len(o.outputs[0].token_ids) == tokens for o in finished)
    return steps[1:], grammar[1:]


def bench_step_overhead(llm: LLM, repeats: int, tokens: int) -> None:
    print(
        f"\n1. decode step time, {tokens} tokens per row, {repeats} interleaved runs per cell: "
        "median over every decode step of the runs"
    )
    print(
        "| batch | none constrained (ms) | half (ms) | all (ms) | half / none | all / none "
        "| in grammar code, half (ms) | in grammar code, all (ms) | all: grammar / none step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    step_times(llm, 2, 1, 8)  # compile the schema, warm up
    for batch in (1, 8, 32):
        modes = {"none": 0, "half": batch // 2, "all": batch}
        if batch == 1:
            modes.pop("half")
        steps: dict[str, list[float]] = {m: [] for m in modes}
        grammar: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode in random.sample(list(modes), len(modes)):
                step, in_grammar = step_times(llm, batch, modes[mode], tokens)
                steps[mode].extend(step)
                grammar[mode].extend(in_grammar)
        ms = {m: 1000 * statistics.median(v) for m, v in steps.items()}
        gms = {m: 1000 * statistics.median(v) for m, v in grammar.items()}
        half = "half" in ms
        cells = [
            f"{ms['none']:.2f}",
            f"{ms['half']:.2f}" if half else "-",
            f"{ms['all']:.2f}",
            f"{ms['half'] / ms['none']:.3f}" if half else "-",
            f"{ms['all'] / ms['none']:.3f}",
            f"{gms['half']:.2f}" if half else "-",
            f"{gms['all']:.2f}",
            f"{gms['all'] / ms['none']:.1%}",
        ]
        print(f"| {batch} | " + " | ".join(cells) + " |")


def bench_compile(llm: LLM, repeats: int) -> None:
    engine = llm.engine
    start = time.perf_counter()
    backend = XgrammarBackend(engine.tokenizer, engine.vocab_size, engine.parts.eos_token_ids)
    print(f"\n2. compile time (tokenizer table built once: {time.perf_counter() - start:.3f} s)")
    print("| schema | validate, on the engine thread (ms) | compile (ms) |")
    print("|---|---|---|")
    for name, schema in SCHEMAS.items():
        params = structured(schema)
        seconds: dict[Callable, list[float]] = {validate: [], backend.compile: []}
        for _ in range(repeats):
            for step, times in seconds.items():
                start = time.perf_counter()
                step(params)
                times.append(time.perf_counter() - start)
        validating, compiling = (1000 * statistics.median(v) for v in seconds.values())
        print(f"| {name} | {validating:.1f} | {compiling:.1f} |")


def bench_speculation(model: str | None, repeats: int, tokens: int) -> None:
    print("\n3. constrained rows under n-gram speculation (k = 4), output tokens/s")
    print(
        "| batch | speculation off | drafts off for constrained rows | drafts checked + rollback |"
    )
    print("|---|---|---|---|")
    engines = {
        "off": LLM(model=model),
        "spec": LLM(
            model=model,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        ),
    }
    params = SamplingParams(
        temperature=0.0,
        max_tokens=tokens,
        ignore_eos=True,
        structured_outputs=structured(LONG_SCHEMA),
    )
    for batch in (1, 8):
        rates: dict[str, list[float]] = {"off": [], "no drafts": [], "rollback": []}
        for _ in range(repeats):
            for mode in rates:
                llm = engines["off" if mode == "off" else "spec"]
                RequestGrammar.speculate = mode != "no drafts"
                start = time.perf_counter()
                llm.generate([PROMPT] * batch, params, use_tqdm=False)
                rates[mode].append(batch * tokens / (time.perf_counter() - start))
        RequestGrammar.speculate = True
        med = {m: statistics.median(v) for m, v in rates.items()}
        print(f"| {batch} | {med['off']:.0f} | {med['no drafts']:.0f} | {med['rollback']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_num_seqs=32)
    bench_step_overhead(llm, args.repeats, args.tokens)
    bench_compile(llm, args.repeats)
    bench_speculation(args.model, args.repeats, args.tokens)


if __name__ == "__main__":
    main()
