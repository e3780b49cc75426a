"""The char tokenizer must read back identically through AutoTokenizer in a qwen2 folder.

transformers 5 rebuilds a qwen2 model's tokenizer as Qwen2Tokenizer from the vocabulary,
whatever class was saved; a vocabulary with raw " " and "\\n" lost both characters there.
"""

from transformers import AutoTokenizer, Qwen2Config

from reprorl.models.tokenizer import VOCAB_SIZE, make_char_tokenizer

TEXT = 'a\nb c<tool_call>{"name": "calculator"}</tool_call>~'


def test_ids_of_characters_are_fixed():
    tok = make_char_tokenizer()
    # Literal ids: "\n" 8, " " 9, "!" 10, "a" 74, "~" 103; eos <|im_end|> 2, pad 0.
    assert tok("a\nb c!~")["input_ids"] == [74, 8, 75, 9, 76, 10, 103]
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (2, 0, VOCAB_SIZE)


def test_round_trip_keeps_whitespace_and_tool_markers():
    tok = make_char_tokenizer()
    ids = tok(TEXT)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[5]) == "<tool_call>"
    assert tok.decode(ids) == TEXT


def test_auto_tokenizer_in_a_qwen2_folder_matches(tmp_path):
    tok = make_char_tokenizer()
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=VOCAB_SIZE).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert loaded.decode(loaded(TEXT)["input_ids"]) == TEXT
    messages = [{"role": "user", "content": "7 + 15 =\n?"}]
    ours = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    theirs = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert theirs == ours
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
