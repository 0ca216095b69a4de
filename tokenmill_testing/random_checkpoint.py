"""Small random-weight checkpoints in the real Hugging Face format.

Tests and benchmarks need real `config.json` + safetensors + `tokenizer.json`
directories without downloading anything, so everything here is generated locally and
deterministically: a byte-level BPE trained on a built-in corpus, and random weights scaled so
that next-token logits are well spread (greedy decoding has no near-ties).
"""

from __future__ import annotations

import functools
import random
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from tokenmill.bench.random_model import no_progress_bars, spread_weights
from tokenmill.demo.special_tokens import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
)

# Qwen2's pre-tokenizer split (digits one by one). AutoTokenizer rebuilds model_type qwen2
# tokenizers as Qwen2Tokenizer (NFC + this split) from vocab and merges, ignoring tokenizer.json's
# pipeline; using the same pipeline for every architecture keeps all loaders in agreement.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, with a BOS first (Llama 3 style: the template owns the BOS, so chat prompts are
# encoded with add_special_tokens=False). String or list-of-text-parts content is accepted.
# With `tools`, Hermes / Qwen2.5 style: the tools in the system turn, calls as
# `<tool_call>{...}</tool_call>`, tool results as `<tool_response>` in a user turn. Chats
# without tools render exactly as plain ChatML (what the demo models were trained on).
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ text(messages[0]['content']) + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ text(message['content']) }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{{ '<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] }}"
    '{{ \'\\", \\"arguments\\": \' }}'
    "{% if arguments is string %}{{ arguments }}{% else %}{{ arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}

# Files that make up a saved tokenizer (copied when a tokenizer_dir is reused).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def _phrases(text: str) -> tuple[str, ...]:
    """A word list written compactly as one '|'-separated string."""
    return tuple(text.split("|"))


_SUBJECTS = _phrases(
    "the cat|a dog|my neighbour|the old farmer|every student|our teacher|the small robot"
    "|a tired engineer|the river|her brother|the committee|this machine|a young scientist"
    "|the orchestra|your friend|the government|a curious child|the captain|the library"
    "|some travellers|the server|the compiler|a quiet village|the moon|the new manager"
    "|two musicians"
)
_VERBS = _phrases(
    "reads|builds|watches|carries|remembers|paints|explains|forgets|discovers|repairs"
    "|describes|follows|imagines|measures|collects|questions|answers|visits|protects"
    "|ignores|calculates|delivers|borrows|understands|considers|celebrates|destroys"
    "|organizes"
)
_OBJECTS = _phrases(
    "a long letter|the broken window|an ancient map|the yellow bicycle|three green apples"
    "|the evening news|a difficult problem|the wooden bridge|a strange noise"
    "|the quarterly report|several bright stars|the kitchen table|a forgotten song"
    "|the mountain road|a heavy suitcase|the network protocol|an interesting theory"
    "|the garden fence|a silver spoon|the weather forecast|a large database"
    "|the summer festival|a handwritten recipe|the history lesson"
)
_ADVERBIALS = _phrases(
    "in the morning|after dinner|without hesitation|very carefully|every week"
    "|during the storm|before sunrise|with great patience|near the station"
    "|at the university|under the bridge|once again|for no reason|quickly|slowly|on Tuesday"
    "|in December|across the valley|behind the house"
)
_CONNECTIVES = _phrases("and then|but|because|although|while|so|until|whereas")
_QUESTIONS = (
    "Why does {s} {v} {o}?",
    "When will {s} finally {v2} {o}?",
    "Who knows whether {s} {v} {o} {a}?",
    "How often does {s} {v2} {o}?",
)
_CODE_LINES = (
    "def {name}(x, y):\n    return x * {n} + y\n",
    "for i in range({n}):\n    total += values[i]\n",
    "if ({name} != NULL && count > {n}) {{ return -1; }}\n",
    "const {name} = await fetch('/api/v1/items?id={n}');\n",
    "SELECT id, name FROM users WHERE age > {n} ORDER BY name;\n",
    "{name} = {{'key': [{n}, {n2}], 'flag': True}}\n",
    'print(f"{name}: {{value:.2f}}")  # {n} items\n',
    "x_{n} <= y_{n2} || z[{n}] >= 0x{n2:x}\n",
)
_IDENTIFIERS = _phrases(
    "get_value|parse_header|num_tokens|block_table|max_len|load_config|userCount|HttpClient"
    "|kv_cache|seq_id|token_ids|compute_hash"
)
_NON_ASCII = (
    "Café crème, s'il vous plaît. Où est la gare?",
    "Größe, Übung und Märchen sind schöne Wörter.",
    "El niño comió piña en el año pasado. ¿Qué tal? ¡Olé!",
    "Ação, coração e informação são palavras portuguesas.",
    "Zażółć gęślą jaźń. Český jazyk je krásný.",
    "Привет, как дела? Всё хорошо, спасибо.",
    "Γειά σου κόσμε. Καλημέρα!",
    "你好，世界。今天天气很好。我们去公园吧。",
    "日本語のテキストです。東京は大きい都市です。",
    "한국어 문장도 있습니다. 감사합니다.",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧",
    "Math: ∑ x² ≤ ∞, α + β = γ, √2 ≈ 1.414, 3 × 4 ÷ 2 → 6",
    "Quotes: «bonjour» “hello” ‘hi’ — dash … ellipsis",
)


_SYLLABLES = _phrases(
    "ka|ro|mi|len|dor|tha|vel|qui|ster|an|bel|cor|dra|fen|gal|hin|jo|kel|lum|mor|nes|pra"
    "|rin|sol|tor|ul|vin|wex|yar|zen|bra|chi|eth|ford|grim|ham|ley|ton"
)


def _name(rng: random.Random) -> str:
    """A made-up proper name (gives the BPE many plausible syllable merges)."""
    word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randrange(2, 4)))
    return word.capitalize()


def _sentence(rng: random.Random) -> str:
    """One English-like sentence from a tiny grammar (varied enough for ~2k BPE merges)."""
    s, o, a = rng.choice(_SUBJECTS), rng.choice(_OBJECTS), rng.choice(_ADVERBIALS)
    v = rng.choice(_VERBS)
    kind = rng.randrange(6)
    if kind == 0:
        text = f"{s} {v} {o} {a}."
    elif kind == 1:
        other = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        text = f"{s} {v} {o}, {rng.choice(_CONNECTIVES)} {other}."
    elif kind == 2:
        v2 = v[:-2] if v.endswith("es") and v[-3] in "sxh" else v[:-1]
        text = rng.choice(_QUESTIONS).format(s=s, v=v, v2=v2, o=o, a=a)
    elif kind == 3:
        n = rng.randrange(1, 100000)
        text = f"In {rng.randrange(1900, 2030)}, {s} {v} {n} items ({rng.random():.3f}%)."
    elif kind == 4:
        text = f'"{o.capitalize()}!" said {s}; {a}, it {v} everything.'
    else:
        text = f"{_name(rng)} of {_name(rng)} {v} {o} with {_name(rng)} {a}."
    return text[0].upper() + text[1:]


def _code_line(rng: random.Random) -> str:
    """A code-like line: identifiers, operators, brackets and numbers."""
    template = rng.choice(_CODE_LINES)
    return template.format(
        name=rng.choice(_IDENTIFIERS), n=rng.randrange(0, 5000), n2=rng.randrange(0, 5000)
    )


def build_corpus(num_sentences: int = 8000, seed: int = 0) -> list[str]:
    """The deterministic training corpus: prose, numbers, code and non-ASCII text."""
    rng = random.Random(seed)
    lines = [_sentence(rng) for _ in range(num_sentences)]
    lines += [_code_line(rng) for _ in range(num_sentences // 4)]
    lines += [" ".join(str(rng.randrange(0, 10**k)) for k in range(1, 8)) for _ in range(100)]
    lines += ["0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \t\n"]
    # Non-ASCII text appears a few times only, so most of its characters stay multi-token.
    lines += list(_NON_ASCII)
    return lines


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on `texts`: Qwen2-style pre-tokenizer (one digit per token),
    BOS added to plain prompts by the post-processor."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """The transformers tokenizer with our special tokens and the ChatML chat template."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per process and vocab size; returns tokenizer.json text."""
    return train_bpe(build_corpus(), vocab_size).to_str()


def train_tokenizer(save_dir: str | Path, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train (deterministically) a byte-level BPE with ChatML template and save it to save_dir."""
    tokenizer = wrap_tokenizer(Tokenizer.from_str(_trained_tokenizer_json(vocab_size)), 2048)
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def _copy_tokenizer(tokenizer_dir: Path, save_dir: Path) -> PreTrainedTokenizerFast:
    """Reuse an already trained tokenizer: copy its files byte for byte."""
    save_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, save_dir / name)
    return PreTrainedTokenizerFast.from_pretrained(str(save_dir))


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def _build_config(
    architecture: str,
    tokenizer: PreTrainedTokenizerFast,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    **kwargs: Any,
) -> transformers.PretrainedConfig:
    """The transformers config; old-style rope_scaling becomes transformers 5 rope_parameters."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; one of {sorted(ARCHITECTURES)}")
    config_cls = getattr(transformers, ARCHITECTURES[architecture][0])
    rope_parameters: dict[str, Any] = {"rope_type": "default"}
    if rope_scaling is not None:
        rope_parameters = dict(rope_scaling)
        if "type" in rope_parameters:  # very old spelling
            rope_parameters.setdefault("rope_type", rope_parameters.pop("type"))
    rope_parameters["rope_theta"] = float(rope_theta)
    if architecture == "mistral":
        kwargs.setdefault("sliding_window", None)
    if architecture == "gemma3":  # RoPE per layer type: the local layers' base is their own
        local = {"rope_type": "default", "rope_theta": kwargs.pop("rope_local_base_freq", 1e4)}
        rope_parameters = {"full_attention": rope_parameters, "sliding_attention": local}
    kwargs.setdefault("rope_parameters", rope_parameters)  # an explicit override wins
    kwargs.setdefault("vocab_size", len(tokenizer))  # a smaller one: a small-vocabulary model
    config = config_cls(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    config.architectures = [ARCHITECTURES[architecture][1]]
    return config


def _write_generation_config(save_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """generation_config.json naming BOS/EOS/PAD, like real checkpoints ship."""
    generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generation_config.save_pretrained(str(save_dir))


def save_random_checkpoint(
    save_dir: str | Path,
    architecture: str,
    *,
    tokenizer_dir: str | Path | None = None,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Write a random `architecture` checkpoint (config, safetensors, tokenizer) to save_dir.

    The same arguments always give byte-identical files, so tests can compare against
    transformers' own implementation of the same checkpoint.
    """
    save_dir = Path(save_dir)
    if tokenizer_dir is None:
        tokenizer = train_tokenizer(save_dir)
    else:
        tokenizer = _copy_tokenizer(Path(tokenizer_dir), save_dir)
    config = _build_config(
        architecture,
        tokenizer,
        rope_theta,
        rope_scaling,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        head_dim=head_dim or hidden_size // num_attention_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        **config_overrides,
    )
    model_cls = getattr(transformers, ARCHITECTURES[architecture][1])
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = model_cls(config)
    spread_weights(model, seed, tie_word_embeddings)
    model = model.to(dtype).eval()
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    with no_progress_bars():
        model.save_pretrained(str(save_dir), **save_kwargs)
    _write_generation_config(save_dir, tokenizer)
    return save_dir
