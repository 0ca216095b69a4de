"""Every number that decides what the demo models are: seeds, sizes, corpus and schedule.

Change something here, retrain (`python -m demo_training.train`), and the shipped weights,
docs/demo_models.md and the accuracy bars in tests/demo follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.demo import DEMO_TARGET_NAME

SEED = 0  # torch init and the corpus stream
TOKENIZER_DOCS = 20_000  # the first documents of the corpus train the BPE
VOCAB_SIZE = 2048
# Sampling defaults written to generation_config.json: the engines (tokenmill, vLLM) use them for
# requests that set no temperature, so a newcomer's plain request is answered near-greedily
# (exact tasks) with a little variety left for stories.
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.2}
VAL_SEED = 999  # validation documents for the loss curves
NUM_VAL_DOCS = 400


@dataclass(frozen=True)
class ModelSpec:
    """The Llama shape (config.json fields)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024  # the training sequence length: RoPE beyond is untrained
    tie_word_embeddings: bool = True  # the embedding is a large share of a tiny model
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TrainSpec:
    """AdamW with linear warmup then cosine decay, over packed rows of `seq_len` tokens."""

    num_tokens: int  # tokens read (prompts and padding included): sets the corpus size and steps
    lr: float
    batch_size: int = 4  # rows per step: small, because steps (not tokens) form induction heads
    seq_len: int = 1024
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 100

    @property
    def num_steps(self) -> int:
        return self.num_tokens // (self.batch_size * self.seq_len)


@dataclass(frozen=True)
class DemoModelSpec:
    name: str
    description: str
    model: ModelSpec
    train: TrainSpec
    # A second schedule after `train` (fresh warmup and cosine) on `corpus.POLISH_WEIGHTS`, a mix
    # heavy in the tasks still improving when the first schedule ended.
    polish: TrainSpec | None = None


# Sized so both train concurrently, one thread each, in under an hour on an otherwise idle
# 2-core CPU (bf16 autocast: ~4.5k tokens/s for the target, ~10k for the draft).
DEMO_MODELS: dict[str, DemoModelSpec] = {
    "target": DemoModelSpec(
        name=DEMO_TARGET_NAME,
        description="the default model: chat tasks with checkable answers, short stories",
        model=ModelSpec(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=768,
        ),
        train=TrainSpec(num_tokens=11_000_000, lr=2e-3, warmup_steps=200),
        # After `train`, addition and subtraction (val loss 0.60 / 0.71, ~20 % exact) and lookup
        # (0.41, ~27 %) were still falling while everything else was near zero.
        polish=TrainSpec(num_tokens=6_000_000, lr=1e-3, warmup_steps=50),
    ),
    "draft": DemoModelSpec(
        name="tokenmill-demo-draft",
        description="the target's draft for speculative decoding: same tokenizer, ~3x smaller",
        # Width 192 with 6 heads: at width 128 (4 heads) two layers took far longer to learn to
        # copy from the prompt, which is most of what a draft is for.
        model=ModelSpec(
            hidden_size=192,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=512,
        ),
        train=TrainSpec(num_tokens=11_000_000, lr=3e-3, batch_size=2, warmup_steps=200),
    ),
}


@dataclass(frozen=True)
class HeadsSpec:
    """The speculative heads on the frozen demo target (`python -m demo_training.train_heads`):
    an EAGLE layer and Medusa heads, trained together on the same batches of target features
    (stage 1), then, if `eagle_more_steps`, the EAGLE layer alone (stage 2, a new warmup and
    cosine from `eagle_more_lr`: without the Medusa heads a step costs about half). The
    shipped EAGLE layer is stage 2's (on stage 1's 800 steps), the Medusa heads stage 1's
    (docs/demo_models.md)."""

    num_rows: int = 256  # packed corpus rows whose target features are computed once, cached
    num_steps: int = 800
    batch_size: int = 1
    seq_len: int = 1024  # the longest documents (lookups) need it
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    seed: int = SEED + 3  # the corpus stream (another than the target's) and the init
    # EAGLE: chain steps unrolled in training (EAGLE-3's training-time test), so the layer
    # learns from its own predicted features as it drafts k tokens; loss weights per step.
    eagle_steps: tuple[float, ...] = (1.0, 0.8, 0.6)
    feature_weight: float = 0.5  # smooth-L1 on the predicted hidden state, next to the KL
    medusa_heads: int = 4
    log_every: int = 20
    eagle_more_steps: int = 2400
    eagle_more_lr: float = 1e-3
    eagle_more_rows: int = 256  # stage 2's cached rows (the first of the same stream)
    # Stage 2 widens fc to read the embedding of token p at p too (`EagleLayer.chain`).
    eagle_current_token: bool = True
    # Rows that go on past a document's end as the target does under `ignore_eos`
    # (`after_end.py`): this share of the documents gets `after_end_tokens` of the target's
    # greedy continuation. Stage 1's rows (`after_end_fraction`) and stage 2's.
    after_end_fraction: float = 0.0
    after_end_tokens: int = 16
    eagle_more_after_end_fraction: float = 0.25


HEADS = HeadsSpec()
