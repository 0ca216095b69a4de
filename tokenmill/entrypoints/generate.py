"""`tokenmill generate`: text for a few prompts, offline.

Sampling flags left unset take the model's generation_config.json values, as the fields a
server request leaves unset do (`--generation-config vllm`: none); `--temperature 0` decodes
greedily."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from tokenmill.sampling_params import SamplingParams

# SamplingParams fields with a flag of the same name: (type, help).
_SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "temperature": (float, "0 = greedy"),
    "top_p": (float, "sample from the smallest set of tokens this likely together"),
    "top_k": (int, "sample from the k likeliest tokens; 0 = all"),
    "min_p": (float, "drop tokens less likely than this times the likeliest"),
    "repetition_penalty": (float, "divide the logits of tokens seen so far by this (> 1)"),
    "presence_penalty": (float, "subtract this from the logits of tokens generated so far"),
    "frequency_penalty": (float, "subtract this times its count from each generated token"),
}


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt; repeat for a batch"
    )
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument(
        "--stop", action="append", default=None, help="a string that ends the output; repeatable"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens"
    )
    parser.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of every request (default: none)"
    )
    group = parser.add_argument_group(
        "sampling", "unset: the model's generation_config.json value, else the one shown"
    )
    builtin = {f.name: f.default for f in fields(SamplingParams)}
    for name, (value_type, help_text) in _SAMPLING_FLAGS.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=value_type,
            default=None,
            help=f"{help_text} (default: the model's, else {builtin[name]})",
        )


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `SamplingParams` fields the command line sets; the model's defaults fill the rest."""
    overrides = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    overrides = {name: value for name, value in overrides.items() if value is not None}
    return {
        **overrides,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "seed": args.sampling_seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }


def run_generate(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**engine_args)
    params = llm.get_default_sampling_params(**sampling_overrides(args))
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            print(
                f"--- prompt: {prompt!r} [sample {completion.index}, "
                f"{len(completion.token_ids)} tokens, {completion.finish_reason}]"
            )
            print(completion.text)
    return 0
