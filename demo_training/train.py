"""Train a demo model on this CPU: `python -m demo_training.train --model target|draft`.

Reproducible from `demo_training.config` alone: the tokenizer, the corpus and the init come
from fixed seeds. One thread per process, so the target and the draft can train side by side
on a 2-core machine (see docs/demo_models.md for the exact commands and wall time). The
finished checkpoint is written to `--out` (default: the weights shipped in the package); loss
logs, the loss-curve PNG and a checkpoint refreshed at every evaluation go to `--work-dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers

from demo_training.config import (
    DEMO_MODELS,
    GENERATION_DEFAULTS,
    NUM_VAL_DOCS,
    SEED,
    TOKENIZER_DOCS,
    VAL_SEED,
    VOCAB_SIZE,
    DemoModelSpec,
    TrainSpec,
)
from demo_training.data import IGNORE_INDEX, EncodedDoc, PackedRows, encode, pack
from demo_training.tokenizer import train_tokenizer
from tokenmill.demo import WEIGHTS_DIR
from tokenmill.demo.corpus import (
    CURRICULUM_FRACTION,
    CURRICULUM_WEIGHTS,
    POLISH_WEIGHTS,
    TASK_WEIGHTS,
    build_corpus,
    iter_corpus,
    render,
    training_exclusions,
)
from tokenmill.demo.tasks import Example
from tokenmill_testing.random_checkpoint import IM_END_TOKEN

logger = logging.getLogger("demo_training.train")

TASK_NAMES = list(TASK_WEIGHTS)
_ENCODE_CHUNK = 20_000  # documents tokenized per batch while building the corpus


def build_tokenizer(save_dir: Path) -> transformers.PreTrainedTokenizerFast:
    docs = build_corpus(SEED, TOKENIZER_DOCS, training_exclusions())
    texts = ["".join(render(d)) for d in docs]
    return train_tokenizer(texts, save_dir, VOCAB_SIZE, model_max_length=1024)


def build_training_rows(
    tokenizer: transformers.PreTrainedTokenizerFast, train: TrainSpec
) -> PackedRows:
    """Rows for `train.num_steps` steps, each document seen once: the copy curriculum first
    (`CURRICULUM_FRACTION` of the rows), then the full task mix."""
    num_rows = train.num_steps * train.batch_size
    num_curriculum = round(num_rows * CURRICULUM_FRACTION)
    exclusions = training_exclusions()
    phases = [
        (iter_corpus(SEED + 1, exclusions, CURRICULUM_WEIGHTS), num_curriculum),
        (iter_corpus(SEED, exclusions), num_rows - num_curriculum),
    ]
    parts = [pack_rows(tokenizer, stream, n, train.seq_len) for stream, n in phases]
    return PackedRows.concat(parts)


def pack_rows(
    tokenizer: transformers.PreTrainedTokenizerFast,
    stream: Iterator[Example],
    num_rows: int,
    seq_len: int,
    extend: Callable[[list[EncodedDoc]], list[EncodedDoc]] | None = None,
    chunk_docs: int = _ENCODE_CHUNK,
) -> PackedRows:
    """`num_rows` rows of the stream's documents, tokenized `chunk_docs` at a time; `extend`
    may change each chunk's documents before they are packed."""
    docs, total = [], 0
    while total < num_rows * seq_len * 1.05:  # packing pads a few %
        chunk = encode(tokenizer, list(itertools.islice(stream, chunk_docs)), TASK_NAMES)
        chunk = extend(chunk) if extend is not None else chunk
        docs.extend(chunk)
        total += sum(len(d.token_ids) for d in chunk)
    rows = pack(docs, seq_len, tokenizer.pad_token_id)
    if len(rows) < num_rows:
        raise RuntimeError(f"packed {len(rows)} rows, need {num_rows}")
    return rows.head(num_rows)


def build_model(
    spec: DemoModelSpec, tokenizer: transformers.PreTrainedTokenizerFast
) -> transformers.LlamaForCausalLM:
    m = spec.model
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config)


def _optimizer(model: torch.nn.Module, train: TrainSpec) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D), as usual."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas)


def lr_factor(step: int, train: TrainSpec) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` at the last step."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.num_steps - train.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return train.min_lr_ratio + (1.0 - train.min_lr_ratio) * cosine


def _forward_loss(model: torch.nn.Module, rows: PackedRows, batch: slice) -> torch.Tensor:
    """Per-token losses of rows[batch] (flattened, IGNORE_INDEX positions give 0)."""
    # bf16 autocast roughly doubles CPU throughput (AVX-512 BF16); weights stay float32.
    # Restarting position_ids (with no attention_mask and no cache) is what makes
    # transformers mask attention per packed document.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(
            input_ids=rows.input_ids[batch], position_ids=rows.position_ids[batch], use_cache=False
        ).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),
        rows.labels[batch][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )


@torch.no_grad()
def validation_losses(model: torch.nn.Module, rows: PackedRows) -> dict[str, float]:
    """Mean loss per task over the learned tokens of the validation rows, plus "all"."""
    model.eval()
    sums = torch.zeros(len(TASK_NAMES))
    counts = torch.zeros(len(TASK_NAMES))
    for start in range(0, len(rows), 4):
        batch = slice(start, start + 4)
        losses = _forward_loss(model, rows, batch)
        tasks = rows.task_ids[batch][:, 1:].flatten()
        learned = tasks >= 0
        sums.index_add_(0, tasks[learned], losses[learned])
        counts.index_add_(0, tasks[learned], torch.ones(int(learned.sum())))
    model.train()
    result = {n: float(sums[i] / counts[i]) for i, n in enumerate(TASK_NAMES) if counts[i] > 0}
    result["all"] = float(sums.sum() / counts.sum())
    return result


def write_generation_config(
    tokenizer: transformers.PreTrainedTokenizerFast, model_dir: Path
) -> None:
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        # Chat replies end with <|im_end|>, plain text with </s>: stop at either.
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END_TOKEN), tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        **GENERATION_DEFAULTS,
    ).save_pretrained(str(model_dir))


def save_checkpoint(
    model: transformers.LlamaForCausalLM,
    tokenizer: transformers.PreTrainedTokenizerFast,
    spec: DemoModelSpec,
    out_dir: Path,
    summary: dict,
) -> None:
    """A standard HF directory, written next to `out_dir` and renamed into place."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp), save_jinja_files=False)  # template in tokenizer_config
    write_generation_config(tokenizer, tmp)
    info = {"name": spec.name, "description": spec.description, **summary}
    (tmp / "tokenmill_demo.json").write_text(json.dumps(info, indent=2) + "\n")
    for path in tmp.iterdir():
        path.chmod(0o644)  # safetensors are written private; the package is shared
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def build_polish_rows(
    tokenizer: transformers.PreTrainedTokenizerFast, polish: TrainSpec
) -> PackedRows:
    """Rows for the second schedule: `POLISH_WEIGHTS` from a stream of its own seed."""
    stream = iter_corpus(SEED + 2, training_exclusions(), POLISH_WEIGHTS)
    return pack_rows(tokenizer, stream, polish.num_steps * polish.batch_size, polish.seq_len)


def _with_steps(spec: TrainSpec, num_steps: int | None) -> TrainSpec:
    """`spec` cut to `num_steps` (a smoke run: same recipe, fewer steps)."""
    if num_steps is None:
        return spec
    num_tokens = num_steps * spec.batch_size * spec.seq_len
    return dataclasses.replace(spec, num_tokens=num_tokens)


def train(
    name: str,
    out_dir: Path,
    work_dir: Path,
    num_steps: int | None = None,
    base_checkpoint: Path | None = None,
) -> None:
    """Train `name` from scratch, or only its polish schedule from `base_checkpoint` (the
    model as the main schedule left it: `<work-dir>/<name>/main`, saved by a full run)."""
    spec = DEMO_MODELS[name]
    train_spec = _with_steps(spec.train, num_steps)
    run_dir = work_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    history: dict[str, list] = {"train": [], "val": []}
    tokenizer = build_tokenizer(run_dir / "tokenizer")
    if base_checkpoint is None:
        model = build_model(spec, tokenizer)
    else:
        built = (run_dir / "tokenizer" / "tokenizer.json").read_bytes()
        if built != (base_checkpoint / "tokenizer.json").read_bytes():
            raise ValueError(f"{base_checkpoint} was trained with another tokenizer")
        model = transformers.LlamaForCausalLM.from_pretrained(base_checkpoint, dtype=torch.float32)
        if (run_dir / "history.json").is_file():
            history = json.loads((run_dir / "history.json").read_text())
    val_docs = build_corpus(VAL_SEED, NUM_VAL_DOCS, training_exclusions())
    val_rows = pack(encode(tokenizer, val_docs, TASK_NAMES), train_spec.seq_len, 0)
    num_params = sum(p.numel() for p in model.parameters())
    schedules: list[tuple[str, TrainSpec]] = []
    if base_checkpoint is None:
        schedules.append(("train", train_spec))
    if spec.polish is not None:
        schedules.append(("polish", _with_steps(spec.polish, num_steps)))
    step_offset, num_tokens, base_seconds = 0, 0, 0
    if base_checkpoint is not None:  # the summary covers the whole recipe, base run included
        base_info = json.loads((base_checkpoint / "tokenmill_demo.json").read_text())
        step_offset, num_tokens = base_info["num_steps"], base_info["num_train_tokens"]
        base_seconds = base_info["train_seconds"]
    for phase, phase_spec in schedules:
        if phase == "train":
            rows = build_training_rows(tokenizer, phase_spec)
        else:
            rows = build_polish_rows(tokenizer, phase_spec)
        logger.info(
            "%s %s: %.2fM parameters, %d steps x %d rows x %d tokens (%d with loss)",
            name,
            phase,
            num_params / 1e6,
            phase_spec.num_steps,
            phase_spec.batch_size,
            phase_spec.seq_len,
            rows.num_loss_tokens,
        )
        _train_loop(
            model, rows, val_rows, phase_spec, run_dir, tokenizer, spec, history, step_offset
        )
        step_offset += phase_spec.num_steps
        num_tokens += rows.input_ids.numel()
        summary = {
            "num_parameters": num_params,
            "num_train_tokens": num_tokens,
            "num_steps": step_offset,
            "train_seconds": base_seconds + round(time.time() - start),
            "final_val_loss": history["val"][-1]["losses"],
        }
        if phase == "train" and spec.polish is not None:
            # What --base-checkpoint takes to rerun only the polish.
            save_checkpoint(model, tokenizer, spec, run_dir / "main", summary)
    save_checkpoint(model, tokenizer, spec, out_dir, summary)
    logger.info("%s: saved to %s after %.0f s", name, out_dir, time.time() - start)


def _train_loop(
    model: transformers.LlamaForCausalLM,
    rows: PackedRows,
    val_rows: PackedRows,
    train: TrainSpec,
    run_dir: Path,
    tokenizer: transformers.PreTrainedTokenizerFast,
    spec: DemoModelSpec,
    history: dict[str, list],
    step_offset: int = 0,
) -> None:
    """One schedule over `rows`; steps are logged from `step_offset` on, so the curves of
    consecutive schedules join up."""
    optimizer = _optimizer(model, train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, train))
    model.train()
    window, start = [], time.time()
    for step in range(train.num_steps):
        batch = slice(step * train.batch_size, (step + 1) * train.batch_size)
        losses = _forward_loss(model, rows, batch)
        loss = losses.sum() / (rows.labels[batch][:, 1:] != IGNORE_INDEX).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        window.append(loss.item())
        if (step + 1) % train.log_every == 0:
            lr = scheduler.get_last_lr()[0]
            _log_progress(step, train, window, start, history, lr, step_offset)
            window = []
        if (step + 1) % train.eval_every == 0 or step + 1 == train.num_steps:
            val = validation_losses(model, val_rows)
            history["val"].append({"step": step_offset + step + 1, "losses": val})
            logger.info("step %d val %s", step_offset + step + 1, _format_losses(val))
            (run_dir / "history.json").write_text(json.dumps(history) + "\n")
            checkpoint_summary = {"step": step_offset + step + 1}
            save_checkpoint(model, tokenizer, spec, run_dir / "checkpoint", checkpoint_summary)
            _plot(run_dir.parent)


def _log_progress(
    step: int,
    train: TrainSpec,
    window: list[float],
    start: float,
    history: dict,
    lr: float,
    step_offset: int,
) -> None:
    elapsed = time.time() - start
    tokens_per_s = (step + 1) * train.batch_size * train.seq_len / elapsed
    eta = elapsed / (step + 1) * (train.num_steps - step - 1)
    loss = sum(window) / len(window)
    history["train"].append(
        {"step": step_offset + step + 1, "loss": loss, "seconds": round(elapsed, 1)}
    )
    logger.info(
        "step %d/%d loss %.4f lr %.2e %.0f tok/s elapsed %.0fs eta %.0fs",
        step + 1,
        train.num_steps,
        loss,
        lr,
        tokens_per_s,
        elapsed,
        eta,
    )


def _format_losses(losses: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in losses.items())


def _plot(work_dir: Path) -> None:
    from demo_training.plot import plot_loss_curves  # matplotlib loads slowly: only here

    plot_loss_curves(work_dir, work_dir / "loss_curves.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo_training.train", description=__doc__)
    parser.add_argument("--model", choices=sorted(DEMO_MODELS), required=True)
    parser.add_argument("--out", type=Path, default=None, help="default: the shipped weights")
    parser.add_argument("--work-dir", type=Path, default=Path("demo_runs"))
    parser.add_argument("--num-steps", type=int, default=None, help="smoke-test override")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--base-checkpoint",
        type=Path,
        default=None,
        help="skip the main schedule: polish this checkpoint (<work-dir>/<model>/main)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer trainer's thread pool
    out = args.out or WEIGHTS_DIR / args.model
    train(args.model, out, args.work_dir, args.num_steps, args.base_checkpoint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
