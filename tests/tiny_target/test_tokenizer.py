import pytest
from transformers import AutoTokenizer

from models.tiny_target.tokenizer import BOS, EOS, PAD, train_bpe

TEXTS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n",
    "import os\nfor name in os.listdir('.'):\n    print(name)\n",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(TEXTS, vocab_size=300)


def test_round_trips_any_text_and_prepends_bos(tokenizer):
    text = "def f(x):\n\tréturn 'ünïcode ✓ 🐍'  # never seen\r\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.unk_token_id is None


def test_merges_learned_from_training_text(tokenizer):
    text = "    return a + b\n"
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) < len(text) * 2 // 3
    assert len(tokenizer) == 300


def test_loads_through_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (BOS, EOS, PAD)
    assert [loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id] == [0, 1, 2]
    text = "import os\nprint(os.sep)\n"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_chat_template_marks_roles_and_ends_answers_with_eos(tokenizer):
    messages = [
        {"role": "user", "content": "Write add."},
        {"role": "assistant", "content": "def add(a, b): ..."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == f"{BOS}<|user|>\nWrite add.\n<|assistant|>\ndef add(a, b): ...{EOS}\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == f"{BOS}<|user|>\nWrite add.\n<|assistant|>\n"


def test_training_is_deterministic(tokenizer):
    assert train_bpe(TEXTS, vocab_size=300).get_vocab() == tokenizer.get_vocab()


def test_too_small_vocab_is_refused():
    with pytest.raises(ValueError, match="at least 259"):
        train_bpe(TEXTS, vocab_size=100)
