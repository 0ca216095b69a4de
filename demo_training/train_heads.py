"""Train the demo target's speculative heads: `python -m demo_training.train_heads`.

Both heads learn from the frozen target (`weights/target`) on the demo corpus. The target
runs once over `HeadsSpec.num_rows` packed rows and its post-norm hidden states h_p are
cached (`--work-dir`, reused by later runs with the same target and rows); every training
step then costs the heads alone: the target's next-token distributions are its LM head over
the cached h_p, where the next token is learned. Then

- EAGLE: one decoder layer (no input norm, as EAGLE) over fc(embed(t[p+1]), h_p) predicts
  h[p+1]; its logits use the target's LM head. Trained with EAGLE-3's training-time test: step
  j of the chain takes the features the layer predicted at step j - 1 and attends to the true
  features' keys up to the chain's start plus its own earlier steps, as it will when drafting.
  The layer runs only within reach of a trained position (`eagle_layer.py`): about a third
  of a row, most of which is prompt.
- Medusa: head i (a residual SiLU block and its own LM head, a frozen copy of the target's)
  predicts from h_p the token at p + 2 + i.

Losses are distillation (KL to the target's distribution, where the target's reply tokens are
learned) plus, for EAGLE, a smooth-L1 on the features. Stage 2 (`HeadsSpec.eagle_more_steps`;
`--more-steps 0` stops after stage 1) trains the EAGLE layer alone, fc widened to read the
embedding of token p at p too; the shipped layer is its output. Stage 2's rows hold the same
documents, a share of them continued past their end with the target's greedy tokens
(`after_end.py`): what a request with `ignore_eos` decodes there, which packed documents never
show.
Reproducible: seeded corpus, init and order of rows, one thread. Writes `weights/eagle` and
`weights/medusa` in the formats vLLM loads; the log (and `heads_history.json`) and the
cached features go to `--work-dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from demo_training.after_end import DOCS_PER_CHUNK, after_end_mask, continue_past_end
from demo_training.config import HEADS, HeadsSpec
from demo_training.data import IGNORE_INDEX, PackedRows
from demo_training.eagle_layer import EagleLayer
from demo_training.train import lr_factor, pack_rows
from tokenmill.demo import WEIGHTS_DIR
from tokenmill.demo.corpus import iter_corpus, training_exclusions
from tokenmill.spec_decode.head_checkpoint import save_eagle, save_medusa

logger = logging.getLogger("demo_training.train_heads")


class MedusaHeads(nn.Module):
    """Medusa-1 heads with vLLM's parameter names: blocks.i.layers.0 and lm_heads.i."""

    def __init__(self, hidden_size: int, lm_head: torch.Tensor, num_heads: int) -> None:
        super().__init__()
        block = nn.Module
        self.blocks = nn.ModuleList()
        for _ in range(num_heads):
            b = block()
            b.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size)])
            nn.init.zeros_(b.layers[0].weight)  # start as the identity: the target's next token
            nn.init.zeros_(b.layers[0].bias)
            self.blocks.append(b)
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden_size, lm_head.shape[0], bias=False) for _ in range(num_heads)
        )
        for head in self.lm_heads:  # the target's, kept frozen (trains 4x faster on a CPU)
            head.weight.data.copy_(lm_head)
            head.weight.requires_grad_(False)


def _distill(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the target's distribution (KL up to the target's entropy, a
    constant), summed over rows."""
    return -(target_probs * F.log_softmax(logits, dim=-1)).sum()


def _learned(labels: torch.Tensor, pos: torch.Tensor, offset: int) -> torch.Tensor:
    """`[L]` bool for one row: position p is trained where token p + offset is a learned reply
    token of the same document as p (offset tokens ahead)."""
    length = labels.shape[0]
    mask = torch.zeros(length, dtype=torch.bool)
    if offset < length:
        ahead_ok = labels[offset:] != IGNORE_INDEX
        same_doc = pos[offset:] >= offset  # no document start within the next `offset`
        mask[: length - offset] = ahead_ok & same_doc
    return mask


@dataclasses.dataclass
class Features:
    """The frozen target's post-norm hidden states over packed corpus rows, computed once."""

    rows: PackedRows
    hidden: torch.Tensor  # [rows, seq_len, hidden_size], float16 (half the memory and disk)


def cached_features(
    target: transformers.LlamaForCausalLM,
    tokenizer: transformers.PreTrainedTokenizerFast,
    spec: HeadsSpec,
    work_dir: Path,
) -> Features:
    """The target's features over `spec.num_rows` rows of the corpus stream `spec.seed` (a
    share `spec.after_end_fraction` of its documents continued past their end), from
    `work_dir` when a run with the same target and rows left them there."""
    digest = hashlib.sha256((WEIGHTS_DIR / "target" / "model.safetensors").read_bytes())
    key = f"{digest.hexdigest()[:16]}-seed{spec.seed}-{spec.num_rows}x{spec.seq_len}"
    if spec.after_end_fraction:
        key += f"-after{spec.after_end_fraction:g}x{spec.after_end_tokens}"
    path = work_dir / f"features-{key}.pt"
    if path.exists():
        logger.info("target features from %s", path)
        saved = torch.load(path)
        return Features(PackedRows(*saved["rows"]), saved["hidden"])
    start = time.time()
    stream = iter_corpus(spec.seed, training_exclusions())
    if spec.after_end_fraction:
        extend = functools.partial(
            continue_past_end,
            target,
            rng=random.Random(f"{spec.seed}-after-end"),
            fraction=spec.after_end_fraction,
            num_tokens=spec.after_end_tokens,
            max_len=spec.seq_len,
        )
        rows = pack_rows(tokenizer, stream, spec.num_rows, spec.seq_len, extend, DOCS_PER_CHUNK)
        logger.info("rows continued past the end in %.0f s", time.time() - start)
    else:
        rows = pack_rows(tokenizer, stream, spec.num_rows, spec.seq_len)
    hidden = torch.empty(spec.num_rows, spec.seq_len, target.config.hidden_size, dtype=torch.half)
    with torch.no_grad():  # float32: bf16 autocast is 4x slower without AVX-512 BF16
        for first in range(0, spec.num_rows, 4):
            batch = slice(first, first + 4)
            out = target.model(
                input_ids=rows.input_ids[batch], position_ids=rows.position_ids[batch]
            )
            hidden[batch] = out.last_hidden_state.half()
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"rows": list(rows.tensors()), "hidden": hidden}, path)
    logger.info(
        "target features: %d rows in %.0f s, saved to %s", spec.num_rows, time.time() - start, path
    )
    return Features(rows, hidden)


def train_heads(
    out_dir: Path, work_dir: Path, spec: HeadsSpec, num_steps: int | None, stage1: Path | None
) -> None:
    """Stage 1 (both heads, `spec.num_steps`; or its output read from `stage1`), then stage 2
    (the EAGLE layer alone, `spec.eagle_more_steps`)."""
    start = time.time()
    target_dir = WEIGHTS_DIR / "target"
    target = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    config = target.config
    spec = dataclasses.replace(spec, num_steps=num_steps or spec.num_steps)
    torch.manual_seed(spec.seed)
    eagle = EagleLayer(config)
    lm_head = target.lm_head.weight.detach()
    medusa = MedusaHeads(config.hidden_size, lm_head, spec.medusa_heads)
    sizes = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (eagle, medusa)]
    logger.info("heads: eagle %.2fM, medusa %.2fM parameters", *sizes)
    if stage1 is None:
        features = cached_features(target, tokenizer, spec, work_dir)
        history = _train(target, features, eagle, medusa, spec, start)
        summary = {"train_steps": spec.num_steps, "train_seconds": round(time.time() - start)}
        summary["final"] = history[-1]
        stage1 = work_dir / "stage1"
        _save(eagle, medusa, config, stage1, summary)
    else:
        history = []
        logger.info("stage 1: the heads in %s", stage1)
    eagle.load_state_dict(load_file(str(stage1 / "eagle" / "model.safetensors")))
    medusa.load_state_dict(load_file(str(stage1 / "medusa" / "model.safetensors")))
    info = json.loads((stage1 / "eagle" / "tokenmill_demo.json").read_text())
    summary = {k: info[k] for k in ("train_steps", "train_seconds", "final")}
    if spec.eagle_more_steps:
        # The same documents (corpus seed), continued past their end as stage 2 asks.
        rows = dataclasses.replace(
            spec,
            after_end_fraction=spec.eagle_more_after_end_fraction,
            num_rows=spec.eagle_more_rows,
        )
        more = dataclasses.replace(
            rows, num_steps=spec.eagle_more_steps, lr=spec.eagle_more_lr, seed=spec.seed + 1
        )
        if spec.eagle_current_token:
            eagle = _with_current_token(eagle, config)
        stage2_start = time.time()
        features = cached_features(target, tokenizer, rows, work_dir)
        more_history = _train(target, features, eagle, None, more, stage2_start)
        history += [{**h, "stage": 2} for h in more_history]
        summary = {
            "train_steps": summary["train_steps"],
            "eagle_more_steps": more.num_steps,
            "eagle_more_rows": more.num_rows,
            "eagle_more_after_end": [more.after_end_fraction, more.after_end_tokens],
            "train_seconds": summary["train_seconds"] + round(time.time() - stage2_start),
            "stage1_final": summary["final"],
            "final": more_history[-1],
        }
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "heads_history.json").write_text(json.dumps(history) + "\n")
    _save(eagle, medusa, config, out_dir, summary)


def _with_current_token(eagle: EagleLayer, config: transformers.LlamaConfig) -> EagleLayer:
    """The same layer with fc also reading the current token's embedding, its weights for it
    zero (the function is unchanged until they are trained)."""
    wide = EagleLayer(config, current_token=True)
    state = eagle.state_dict()
    fc = state["fc.weight"]
    state["fc.weight"] = torch.cat([fc, fc.new_zeros(fc.shape[0], config.hidden_size)], dim=1)
    wide.load_state_dict(state)
    return wide


def _train(
    target: transformers.LlamaForCausalLM,
    features: Features,
    eagle: EagleLayer,
    medusa: MedusaHeads | None,
    spec: HeadsSpec,
    start: float,
) -> list[dict]:
    """`spec.num_steps` steps on the EAGLE layer and, if given, the Medusa heads; the logged
    agreement every `spec.log_every` steps."""
    modules = [m for m in (eagle, medusa) if m is not None]
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, spec))
    rotary = LlamaRotaryEmbedding(target.config)
    lm_head = target.lm_head.weight.detach()
    logger.info(
        "training %s: %d steps x %d rows (of %d cached) x %d tokens, lr %g",
        "eagle + medusa" if medusa is not None else "eagle", spec.num_steps, spec.batch_size,
        spec.num_rows, spec.seq_len, spec.lr,
    )  # fmt: skip
    order = _row_order(spec)
    history: list[dict] = []
    window: list[dict[str, float]] = []
    kinds = ("e", "m") if medusa is not None else ("e",)
    for step in range(spec.num_steps):
        batch = order[step * spec.batch_size : (step + 1) * spec.batch_size]
        totals: dict[str, torch.Tensor] = {}
        for r in batch.tolist():
            with torch.no_grad():
                row = _row(target, rotary, features, r)
            for name, value in _losses(eagle, medusa, spec, row, lm_head).items():
                totals[name] = totals.get(name, 0) + value
        loss = sum(totals.pop(f"loss{k}") / totals[f"count{k}"].clamp(min=1) for k in kinds)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        window.append(_agreement(totals))
        if (step + 1) % spec.log_every == 0 or step + 1 == spec.num_steps:
            mean = _mean(window)
            history.append({"step": step + 1, "seconds": round(time.time() - start), **mean})
            logger.info(
                "step %d/%d %.0fs %s",
                step + 1,
                spec.num_steps,
                time.time() - start,
                " ".join(f"{k}={v:.3f}" for k, v in mean.items()),
            )
            window = []
    return history


def _save(
    eagle: EagleLayer, medusa: MedusaHeads, config: transformers.LlamaConfig, out_dir: Path,
    summary: dict,
) -> None:  # fmt: skip
    eagle_state = {k: v.detach().clone() for k, v in eagle.state_dict().items()}
    save_eagle(eagle_state, config, out_dir / "eagle", _info("eagle", eagle, summary))
    medusa_state = {k: v.detach().clone() for k, v in medusa.state_dict().items()}
    save_medusa(medusa_state, config, out_dir / "medusa", _info("medusa", medusa, summary))
    logger.info("heads saved to %s after %d s", out_dir, summary["train_seconds"])


def _row_order(spec: HeadsSpec) -> torch.Tensor:
    """The cached rows each step trains on: seeded shuffles, one per pass over them."""
    generator = torch.Generator().manual_seed(spec.seed)
    needed = spec.num_steps * spec.batch_size
    passes = -(-needed // spec.num_rows)
    return torch.cat([torch.randperm(spec.num_rows, generator=generator) for _ in range(passes)])


@dataclasses.dataclass
class Row:
    """One cached row, ready for the losses."""

    ids: torch.Tensor
    labels: torch.Tensor
    pos: torch.Tensor
    hidden: torch.Tensor  # [L, H] float32
    embeds: torch.Tensor  # [L, H]: the embedding of token p + 1 at p
    current: torch.Tensor  # [L, H]: the embedding of token p at p
    rope: tuple[torch.Tensor, torch.Tensor]  # [L, D] each
    probs: torch.Tensor  # [L, V]: the target's next-token distribution where token p + 1 is learned
    after_end: torch.Tensor  # [L] bool: token p continues its document past the end


def _row(
    target: transformers.LlamaForCausalLM, rotary: LlamaRotaryEmbedding, features: Features, r: int
) -> Row:
    rows = features.rows
    ids, labels, pos = rows.input_ids[r], rows.labels[r], rows.position_ids[r]
    hidden = features.hidden[r].float()
    cos, sin = rotary(hidden[None], pos[None])
    # The target's distributions are used only where the next token is learned: the LM head
    # runs there alone (it is most of a step's cost on a CPU).
    probs = torch.zeros(hidden.shape[0], target.config.vocab_size)
    used = torch.zeros(hidden.shape[0], dtype=torch.bool)
    used[:-1] = labels[1:] != IGNORE_INDEX
    probs[used] = F.softmax(target.lm_head(hidden[used]), dim=-1)
    embeds = target.model.embed_tokens(torch.roll(ids, -1))
    current = target.model.embed_tokens(ids)
    after_end = after_end_mask(labels, pos, _end_ids())
    return Row(ids, labels, pos, hidden, embeds, current, (cos[0], sin[0]), probs, after_end)


@functools.cache
def _end_ids() -> list[int]:
    """The tokens that end a reply or a document (`<|im_end|>`, `</s>`): the target's
    generation_config eos ids (its config.json lists only `</s>`)."""
    ids = transformers.GenerationConfig.from_pretrained(WEIGHTS_DIR / "target").eos_token_id
    return sorted(ids if isinstance(ids, list) else [ids])


def _losses(
    eagle: EagleLayer,
    medusa: MedusaHeads | None,
    spec: HeadsSpec,
    row: Row,
    lm_head: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One row's summed losses and counts (`losse`, `counte` for EAGLE, `lossm`, `countm` for
    Medusa) and, per EAGLE step and Medusa head, the number of trained positions where its top-1
    token is the target's (`hits*`, over `n*`: its acceptance rate under teacher forcing). With
    rows continued past their end (`spec.after_end_fraction`), those counts cover the documents
    up to their end, and `*_after` ones the tokens past it."""
    out: dict[str, torch.Tensor] = {}
    num_steps = len(spec.eagle_steps)
    length = row.hidden.shape[0]
    # EAGLE step j at p predicts h[p + 1] (the target's token p + 2); its chain began at p - j.
    trained = _learned(row.labels, row.pos, 2)
    trained[-1] = False
    ahead = F.pad(trained.float(), (0, num_steps - 1))
    needed = ahead.unfold(0, num_steps, 1).amax(-1).bool()  # a trained position within reach
    needed = torch.nonzero(needed).squeeze(1)
    if needed.numel():
        index = torch.arange(length)
        doc_start = torch.where(row.pos == 0, index, 0).cummax(0).values
        current = row.current if eagle.fc.in_features == 3 * row.hidden.shape[1] else None
        predicted = eagle.chain(
            row.embeds, row.hidden, row.rope, doc_start, needed, num_steps, current
        )
        for j, (features, weight) in enumerate(zip(predicted, spec.eagle_steps)):
            keep = trained[needed] & (row.pos[needed] >= j)
            at = needed[keep]
            chosen, want = features[keep], row.probs[at + 1]
            logits = F.linear(chosen, lm_head)
            feat = F.smooth_l1_loss(chosen, row.hidden[at + 1], reduction="sum") / chosen.shape[1]
            loss = weight * (_distill(logits, want) + spec.feature_weight * feat)
            out["losse"] = out.get("losse", 0) + loss
            hits = logits.argmax(-1) == want.argmax(-1)
            _count_hits(out, f"eagle{j}", hits, row.after_end[at + 2], spec)
        out["counte"] = torch.tensor(float(trained.sum()))
    for i, (block, head) in enumerate(zip(medusa.blocks, medusa.lm_heads) if medusa else ()):
        # Head i at p predicts the target's token p + 2 + i, i.e. its distribution at p + 1 + i.
        at = torch.nonzero(_learned(row.labels, row.pos, 2 + i)).squeeze(1)
        x, want = row.hidden[at], row.probs[at + 1 + i]
        logits = head(x + F.silu(block.layers[0](x)))
        out["lossm"] = out.get("lossm", 0) + _distill(logits, want)
        hits = logits.argmax(-1) == want.argmax(-1)
        _count_hits(out, f"medusa{i}", hits, row.after_end[at + 2 + i], spec)
    out["countm"] = torch.tensor(float(_learned(row.labels, row.pos, 2).sum()))
    out.setdefault("losse", torch.zeros(()))
    out.setdefault("counte", torch.zeros(()))
    return out


def _count_hits(
    out: dict[str, torch.Tensor], name: str, hits: torch.Tensor, after: torch.Tensor,
    spec: HeadsSpec,
) -> None:  # fmt: skip
    """Adds `hits{name}` and `n{name}` to `out`; split at the documents' end (`after`: the
    predicted token is past it) into `name` and `name_after` when rows go on past it."""
    split = [(name, ~after), (f"{name}_after", after)] if spec.after_end_fraction else []
    for key, keep in split or [(name, torch.ones_like(hits))]:
        out[f"hits{key}"] = (hits & keep).sum()
        out[f"n{key}"] = keep.sum().float()


def _agreement(totals: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """Top-1 agreement with the target per EAGLE step and Medusa head over the step's rows
    (None where none was trained)."""
    names = [k[len("hits") :] for k in totals if k.startswith("hits")]
    return {
        n: float(totals[f"hits{n}"]) / float(totals[f"n{n}"]) if totals[f"n{n}"] else None
        for n in names
    }


def _mean(window: list[dict[str, float | None]]) -> dict[str, float]:
    """Per name, the mean over the steps that trained it."""
    out = {}
    for name in window[0]:
        values = [m[name] for m in window if m.get(name) is not None]
        out[name] = sum(values) / len(values) if values else float("nan")
    return out


def _info(kind: str, module: nn.Module, summary: dict) -> dict:
    return {
        "name": f"tokenmill-demo-{kind}",
        "description": f"{kind} heads for the demo target (speculative decoding)",
        "num_parameters": sum(p.numel() for p in module.parameters()),
        **summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m demo_training.train_heads", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="OUT/eagle, OUT/medusa")
    parser.add_argument("--work-dir", type=Path, default=Path("demo_runs/heads"))
    parser.add_argument(
        "--num-steps",
        type=int,
        default=None,
        help="stage 1's steps (smoke tests: with --more-steps 0)",
    )
    parser.add_argument("--more-steps", type=int, default=None, help="override stage 2's steps")
    parser.add_argument("--more-rows", type=int, default=None, help="override stage 2's rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--stage1",
        type=Path,
        default=None,
        help="a directory with stage 1's eagle/ and medusa/ (a previous run's WORK_DIR/stage1):"
        " skip stage 1",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    spec = HEADS
    if args.more_steps is not None:
        spec = dataclasses.replace(spec, eagle_more_steps=args.more_steps)
    if args.more_rows is not None:
        spec = dataclasses.replace(spec, eagle_more_rows=args.more_rows)
    train_heads(args.out, args.work_dir, spec, args.num_steps, args.stage1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
