"""The special tokens of the tokenizers tokenmill trains (tests' and the demo models'), apart
from the training code so that reading them imports neither torch nor transformers."""

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# <unk> is never produced by a byte-level BPE, but naming one stops transformers' Qwen2Tokenizer
# (forced by AutoTokenizer for model_type qwen2) from adding its own and growing the vocab.
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN]
