"""Train the demo target's speculative heads: `python -m tokenmill.demo.train_heads`.

Both heads learn from the frozen target (`weights/target`) on the demo corpus, on the same
batches: one target forward gives the post-norm hidden states h_p and the
next-token distributions, then

- EAGLE: one decoder layer (no input norm, as EAGLE) over fc(embed(t[p+1]), h_p) predicts
  h[p+1]; its logits use the target's LM head. Trained with EAGLE-3's training-time test: step
  j of the chain takes the features the layer predicted at step j - 1 and attends to the true
  features' keys up to the chain's start plus its own earlier steps, as it will when drafting.
- Medusa: head i (a residual SiLU block and its own LM head, a frozen copy of the target's)
  predicts from h_p the token at p + 2 + i.

Losses are distillation (KL to the target's distribution, where the target's reply tokens are
learned) plus, for EAGLE, a smooth-L1 on the features. Reproducible: seeded corpus and init,
one thread. Writes `weights/eagle` and `weights/medusa` in the formats vLLM loads; the log
(and `history.json`) go to `--work-dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tokenmill.demo import WEIGHTS_DIR
from tokenmill.demo.config import HEADS, HeadsSpec
from tokenmill.demo.corpus import iter_corpus, training_exclusions
from tokenmill.demo.data import IGNORE_INDEX, PackedRows
from tokenmill.demo.train import lr_factor, pack_rows
from tokenmill.spec_decode.head_checkpoint import save_eagle, save_medusa

logger = logging.getLogger("tokenmill.demo.train_heads")


class EagleLayer(nn.Module):
    """The trainable part of the EAGLE draft, with the checkpoint's parameter names."""

    def __init__(self, config: transformers.LlamaConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = h // self.num_heads
        self.fc = nn.Linear(2 * h, h, bias=False)
        attn = nn.Module()
        attn.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        attn.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        attn.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        attn.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, i, bias=False)
        mlp.up_proj = nn.Linear(h, i, bias=False)
        mlp.down_proj = nn.Linear(i, h, bias=False)
        layer = nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        layer.post_attention_layernorm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([layer])

    def chain(
        self,
        next_embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        doc: torch.Tensor,
        num_steps: int,
    ) -> list[torch.Tensor]:
        """The predicted features of each chain step, `[B, L, H]` each: step j at position p
        continues a chain begun at p - j on true features."""
        layer = self.layers[0]
        attn = layer.self_attn
        b, length, _ = hidden.shape
        pos = torch.arange(length)
        same_doc = doc[:, :, None] == doc[:, None, :]  # [B, L(query), L(key)]
        keys, values, outputs = [], [], []
        features = hidden
        for j in range(num_steps):
            x = self.fc(torch.cat([next_embeds, features], dim=-1))
            q = attn.q_proj(x).view(b, length, self.num_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *rope)
            keys.append(k)
            values.append(v)
            blocks = [pos[None, :] <= pos[:, None] - j]  # true features up to the chain's start
            blocks += [pos[None, :] == pos[:, None] - j + i for i in range(1, j + 1)]
            mask = torch.cat([same_doc & block for block in blocks], dim=-1).unsqueeze(1)
            out = F.scaled_dot_product_attention(
                q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
            )
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, length, -1))
            mlp = layer.mlp
            normed = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
            outputs.append(x)
            features = torch.cat([hidden[:, :1], x[:, :-1]], dim=1)  # h[p] predicted at p - 1
        return outputs


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


def _learned(rows: PackedRows, batch: slice, offset: int) -> torch.Tensor:
    """[B, L] float: position p is trained where token p + offset is a learned reply token of
    the same document as p (offset tokens ahead)."""
    labels, pos = rows.labels[batch], rows.position_ids[batch]
    length = labels.shape[1]
    mask = torch.zeros(labels.shape)
    if offset < length:
        ahead_ok = labels[:, offset:] != IGNORE_INDEX
        same_doc = pos[:, offset:] >= offset  # no document start within the next `offset`
        mask[:, : length - offset] = (ahead_ok & same_doc).float()
    return mask


def train_heads(out_dir: Path, work_dir: Path, spec: HeadsSpec, num_steps: int | None) -> None:
    start = time.time()
    target_dir = WEIGHTS_DIR / "target"
    target = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    config = target.config
    spec = dataclasses.replace(spec, num_steps=num_steps or spec.num_steps)
    num_steps = spec.num_steps
    stream = iter_corpus(spec.seed, training_exclusions())
    rows = pack_rows(tokenizer, stream, num_steps * spec.batch_size, spec.seq_len)
    torch.manual_seed(spec.seed)
    eagle = EagleLayer(config)
    lm_head = target.lm_head.weight.detach()
    medusa = MedusaHeads(config.hidden_size, lm_head, spec.medusa_heads)
    params = [p for p in (*eagle.parameters(), *medusa.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, spec))
    rotary = LlamaRotaryEmbedding(config)
    sizes = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (eagle, medusa)]
    logger.info(
        "heads: %d steps x %d rows x %d tokens; eagle %.2fM, medusa %.2fM parameters",
        num_steps, spec.batch_size, spec.seq_len, *sizes,
    )  # fmt: skip
    history: list[dict] = []
    window: list[dict[str, float]] = []
    for step in range(num_steps):
        batch = slice(step * spec.batch_size, (step + 1) * spec.batch_size)
        ids, pos = rows.input_ids[batch], rows.position_ids[batch]
        with torch.no_grad():  # float32: bf16 autocast is 4x slower without AVX-512 BF16
            hidden = target.model(input_ids=ids, position_ids=pos).last_hidden_state
        with torch.no_grad():
            target_logp = F.log_softmax(target.lm_head(hidden), dim=-1)
            target_probs = target_logp.exp()
            next_embeds = target.model.embed_tokens(torch.roll(ids, -1, dims=1))
        metrics = _losses(
            eagle, medusa, spec, rows, batch, hidden, target_probs, next_embeds, rotary, lm_head
        )
        loss = metrics.pop("loss")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        window.append(metrics)
        if (step + 1) % spec.log_every == 0 or step + 1 == num_steps:
            mean = {k: sum(m[k] for m in window) / len(window) for k in window[0]}
            history.append({"step": step + 1, "seconds": round(time.time() - start), **mean})
            logger.info(
                "step %d/%d %.0fs %s",
                step + 1,
                num_steps,
                time.time() - start,
                " ".join(f"{k}={v:.3f}" for k, v in mean.items()),
            )
            window = []
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "heads_history.json").write_text(json.dumps(history) + "\n")
    summary = {"train_steps": num_steps, "train_seconds": round(time.time() - start)}
    _save(eagle, medusa, config, out_dir, {**summary, "final": history[-1]})


def _save(
    eagle: EagleLayer, medusa: MedusaHeads, config: transformers.LlamaConfig, out_dir: Path,
    summary: dict,
) -> None:  # fmt: skip
    eagle_state = {k: v.detach().clone() for k, v in eagle.state_dict().items()}
    save_eagle(eagle_state, config, out_dir / "eagle", _info("eagle", eagle, summary))
    medusa_state = {k: v.detach().clone() for k, v in medusa.state_dict().items()}
    save_medusa(medusa_state, config, out_dir / "medusa", _info("medusa", medusa, summary))
    logger.info("heads saved to %s after %d s", out_dir, summary["train_seconds"])


def _losses(
    eagle: EagleLayer,
    medusa: MedusaHeads,
    spec: HeadsSpec,
    rows: PackedRows,
    batch: slice,
    hidden: torch.Tensor,
    target_probs: torch.Tensor,
    next_embeds: torch.Tensor,
    rotary: LlamaRotaryEmbedding,
    lm_head: torch.Tensor,
) -> dict:
    """The batch's loss and, per EAGLE step and Medusa head, the top-1 agreement with the
    target over trained positions (an estimate of the acceptance rate of that draft). LM
    heads run only on trained positions (most of the cost on a CPU)."""
    pos = rows.position_ids[batch]
    doc = torch.cumsum(pos == 0, dim=1)
    rope = rotary(hidden, pos)
    metrics: dict = {}
    total = hidden.new_zeros(())
    predicted = eagle.chain(next_embeds, hidden, rope, doc, len(spec.eagle_steps))
    for j, (features, weight) in enumerate(zip(predicted, spec.eagle_steps)):
        # Step j at p predicts h[p + 1] (the target's token p + 2); its chain began at p - j.
        keep = (_learned(rows, batch, 2) * (pos >= j).float())[:, :-1].bool()
        chosen, want = features[:, :-1][keep], target_probs[:, 1:][keep]
        logits = F.linear(chosen, lm_head)
        n = max(1, chosen.shape[0])
        kl = _distill(logits, want) / n
        feat = F.smooth_l1_loss(chosen, hidden[:, 1:][keep], reduction="sum") / n / chosen.shape[1]
        total = total + weight * (kl + spec.feature_weight * feat)
        metrics[f"eagle{j}"] = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
    for i, (block, head) in enumerate(zip(medusa.blocks, medusa.lm_heads)):
        # Head i at p predicts the target's token p + 2 + i, i.e. its distribution at p + 1 + i.
        shift = 1 + i
        keep = _learned(rows, batch, 1 + shift)[:, :-shift].bool()
        x, want = hidden[:, :-shift][keep], target_probs[:, shift:][keep]
        logits = head(x + F.silu(block.layers[0](x)))
        total = total + _distill(logits, want) / max(1, x.shape[0])
        metrics[f"medusa{i}"] = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
    metrics["loss"] = total
    return metrics


def _info(kind: str, module: nn.Module, summary: dict) -> dict:
    return {
        "name": f"tokenmill-demo-{kind}",
        "description": f"{kind} heads for the demo target (speculative decoding)",
        "num_parameters": sum(p.numel() for p in module.parameters()),
        **summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.demo.train_heads", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="OUT/eagle, OUT/medusa")
    parser.add_argument("--work-dir", type=Path, default=Path("demo_runs/heads"))
    parser.add_argument("--num-steps", type=int, default=None, help="smoke-test override")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    train_heads(args.out, args.work_dir, HEADS, args.num_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
