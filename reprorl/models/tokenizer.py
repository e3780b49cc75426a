"""The tokenizer of the project's tiny models: one token per character, ChatML turns.

Character-level keeps the vocabulary at 128 (small models, vLLM's CPU build loads it)
and makes every string encodable without a trained merge table. It is a byte-level BPE
with NO merges, the form of Qwen2's tokenizer: transformers 5 rebuilds any `qwen2`
model's tokenizer as `Qwen2Tokenizer` from the vocabulary, whatever the saved class,
so the vocabulary spells space and newline the byte-level way (`Ġ`, `Ċ`); with raw
" " and "\n" those characters were silently dropped by `AutoTokenizer`.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 128
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN]
# Tool-call markers are whole tokens (as in Qwen's vocabulary) but not special, so they
# survive decoding and the multi-turn loop can parse them out of the text.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Byte-level spelling (GPT-2's bytes_to_unicode): newline is "Ċ", space is "Ġ", the other
# printable ASCII characters are themselves. Ids: "\n" 8, " " 9, "!".."~" 10..103.
CHARACTERS = ["\u010a", "\u0120"] + [chr(c) for c in range(33, 127)]

# ChatML, as Qwen2 uses it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _vocab() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + TOOL_TOKENS + CHARACTERS
    tokens += [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(tokens))]
    assert len(tokens) == VOCAB_SIZE
    return {tok: i for i, tok in enumerate(tokens)}


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level ChatML tokenizer (vocab 128, eos `<|im_end|>`, pad `<|endoftext|>`)."""
    tok = Tokenizer(models.BPE(vocab=_vocab(), merges=[], unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TOOL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        padding_side="left",
    )
