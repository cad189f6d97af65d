import json
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from models.tiny_target.tokenizer import EOS, train_bpe
from pipeline.prompts import PromptsConfig, build_rows, source_rows, user_rows

MODULE = textwrap.dedent(
    '''\
    """A module docstring."""
    import os
    from collections import OrderedDict


    def join_all(base, parts):
        """Join every part onto base."""
        out = []
        for part in parts:
            out.append(os.path.join(base, part))
        return out


    class Cache(OrderedDict):
        """A bounded cache."""

        limit = 8

        def trim(self):
            """Drop the oldest entries."""
            while len(self) > self.limit:
                self.popitem(last=False)
    '''
)
OTHER = textwrap.dedent(
    '''\
    import re


    def words(text):
        """Split text into words."""
        found = re.findall(r"\\w+", text)
        return [w.lower() for w in found]
    '''
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe([MODULE, OTHER, "hello world, the user asked\n"] * 10, vocab_size=400)


@pytest.fixture(scope="module")
def plain_tokenizer(tokenizer, tmp_path_factory):
    """The same tokenizer without a chat template (the built-in fallback template is used)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.chat_template is None
    return tok


CFG = PromptsConfig(continuation_lines=(3,), min_body_lines=2)


def by_kind(rows, kind):
    return [r for r in rows if r["kind"] == kind]


def test_source_prompts_cover_defs_methods_classes_and_continuations(tokenizer):
    rows, skipped = source_rows([("m", "train", MODULE)], tokenizer, CFG)
    assert skipped == {}
    assert sorted(r["kind"] for r in rows) == [
        "class_body",
        "def_body",
        "def_body",
        "file_continuation",
    ]
    join = next(r for r in by_kind(rows, "def_body") if "def join_all" in r["prompt_text"])
    # Imports give the body its context; the prompt stops after the docstring.
    assert join["prompt_text"].startswith("import os\nfrom collections import OrderedDict\n\n")
    assert join["prompt_text"].rstrip().endswith('"""Join every part onto base."""')
    body = tokenizer.decode(join["reference_ids"])
    assert body.lstrip("\n").startswith("    out = []") and "return out" in body
    # The method prompt carries its class header.
    trim = next(r for r in by_kind(rows, "def_body") if "def trim" in r["prompt_text"])
    assert "class Cache(OrderedDict):\n    def trim(self):" in trim["prompt_text"]
    assert "popitem" not in trim["prompt_text"]
    for r in rows:
        assert r["split"] == "train" and r["source"] == "stdlib:m"
        assert r["loss_mask"] == [0] * len(r["prompt_ids"]) + [1] * len(r["reference_ids"])
        assert r["prompt_ids"][0] == tokenizer.bos_token_id


def test_prompt_and_reference_come_from_one_tokenization(tokenizer):
    rows, _ = source_rows([("m", "train", MODULE)], tokenizer, CFG)
    for r in rows:
        joint = tokenizer(r["prompt_text"] + tokenizer.decode(r["reference_ids"]))["input_ids"]
        assert joint[: len(r["prompt_ids"])] == r["prompt_ids"]
        assert joint[len(r["prompt_ids"]) :][: len(r["reference_ids"])] == r["reference_ids"]


def test_heldout_rows_come_only_from_heldout_modules_and_never_repeat_in_train(tokenizer):
    modules = [("a", "train", MODULE), ("b", "heldout", OTHER), ("c", "train", OTHER)]
    rows, skipped = source_rows(modules, tokenizer, CFG)
    held = [r for r in rows if r["split"] == "heldout"]
    assert held and {r["source"] for r in held} == {"stdlib:b"}
    assert not {r["prompt_text"] for r in held} & {
        r["prompt_text"] for r in rows if r["split"] == "train"
    }
    assert skipped["duplicate"] == 2  # module c repeats b's def_body and continuation
    assert len({r["prompt_id"] for r in rows}) == len(rows)


def test_caps_lengths_and_deterministic_order(tokenizer):
    modules = [(f"m{i}", "train", MODULE.replace("join_all", f"join_{i}")) for i in range(6)]
    cfg = CFG.model_copy(update={"max_train_rows": 5, "max_reference_tokens": 4})
    rows, _ = source_rows(modules, tokenizer, cfg)
    assert len(rows) == 5 and all(len(r["reference_ids"]) <= 4 for r in rows)
    assert rows == source_rows(modules, tokenizer, cfg)[0]
    other_seed = source_rows(modules, tokenizer, cfg.model_copy(update={"seed": 1}))[0]
    assert [r["prompt_id"] for r in other_seed] != [r["prompt_id"] for r in rows]

    short = CFG.model_copy(update={"max_prompt_tokens": 12})
    rows, skipped = source_rows([("m", "train", MODULE)], tokenizer, short)
    assert skipped["too_long"] > 0 and all(len(r["prompt_ids"]) <= 12 for r in rows)


def write_jsonl(path, lines):
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "Again."},
    {"role": "assistant", "content": "hello again"},
]


@pytest.mark.parametrize("fixture", ["tokenizer", "plain_tokenizer"])
def test_user_chat_masks_assistant_tokens_only(fixture, request, tmp_path):
    tok = request.getfixturevalue(fixture)
    path = write_jsonl(tmp_path / "chat.jsonl", [json.dumps({"messages": CHAT, "split": "train"})])
    rows, skipped = user_rows(path, tok, PromptsConfig())
    assert skipped == {} and len(rows) == 1
    r = rows[0]
    assert r["kind"] == "user_chat" and r["source"] == "chat.jsonl:1"
    assert r["prompt_text"].endswith("<|assistant|>\n")
    assert tok.decode(r["reference_ids"]) == f"hello again{EOS}"
    ids = r["prompt_ids"] + r["reference_ids"]
    assert len(r["loss_mask"]) == len(ids)
    masked = tok.decode([t for t, m in zip(ids, r["loss_mask"], strict=True) if m])
    assert masked == f"hello world{EOS}hello again{EOS}"


def test_user_chat_without_answer_is_a_generation_prompt(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [json.dumps({"messages": CHAT[:2]})])
    (r,), _ = user_rows(path, tokenizer, PromptsConfig())
    assert r["reference_ids"] == [] and not any(r["loss_mask"])
    assert r["prompt_text"].endswith("Say hello.\n<|assistant|>\n")


def test_bad_user_rows_are_skipped_and_counted(tokenizer, tmp_path):
    good = json.dumps({"text": "def f():\n"})
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            good,
            json.dumps({"text": "   "}),
            b'{"text": "caf\xe9"}',
            "{not json",
            json.dumps({"other": 1}),
            json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
            json.dumps({"messages": [{"role": "user", "content": 3}]}),
            json.dumps({"text": "x = 1\n" * 500}),
            json.dumps({"text": "y = 2\n", "split": "dev"}),
            "",
            good,
        ],
    )
    rows, skipped = user_rows(path, tokenizer, PromptsConfig(max_prompt_tokens=64))
    assert [r["source"] for r in rows] == ["mixed.jsonl:1"]
    assert rows[0]["kind"] == "user_text" and rows[0]["prompt_text"] == "def f():\n"
    assert rows[0]["prompt_ids"] == tokenizer("def f():\n")["input_ids"]
    assert skipped == {
        "empty": 2,
        "not_utf8": 1,
        "bad_json": 1,
        "missing_field": 1,
        "bad_messages": 2,
        "too_long": 1,
        "bad_split": 1,
        "duplicate": 1,
    }


def test_a_lone_surrogate_is_a_skipped_row_not_a_traceback(tokenizer, tmp_path):
    # valid JSON whose string is not encodable text: "\ud800" parses to a lone surrogate
    lone = b'{"text": "def f(\\ud800):\\n"}'
    chat = b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}'
    path = write_jsonl(tmp_path / "s.jsonl", [json.dumps({"text": "def g():\n"}), lone, chat])
    rows, skipped = user_rows(path, tokenizer, PromptsConfig())
    assert [r["source"] for r in rows] == ["s.jsonl:1"]
    assert skipped == {"not_utf8": 2}
    with pytest.raises(ValueError, match=r"no usable prompt rows \(not_utf8: 1\)"):
        user_rows(write_jsonl(tmp_path / "only.jsonl", [lone]), tokenizer, PromptsConfig())


def test_unusable_files_are_clear_errors(tokenizer, tmp_path):
    cfg = PromptsConfig()
    with pytest.raises(ValueError, match="no usable prompt rows"):
        user_rows(
            write_jsonl(tmp_path / "bad.jsonl", ["{oops", json.dumps({"text": ""})]), tokenizer, cfg
        )
    with pytest.raises(ValueError, match="no row of .* has a `text` or `messages` field"):
        user_rows(
            write_jsonl(tmp_path / "cols.jsonl", [json.dumps({"prompt": "x"})]), tokenizer, cfg
        )
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "cols.parquet")
    with pytest.raises(ValueError, match="needs a `text` column"):
        user_rows(tmp_path / "cols.parquet", tokenizer, cfg)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        user_rows(tmp_path / "broken.parquet", tokenizer, cfg)
    (tmp_path / "x.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        user_rows(tmp_path / "x.csv", tokenizer, cfg)
    with pytest.raises(FileNotFoundError):
        user_rows(tmp_path / "missing.jsonl", tokenizer, cfg)


def test_parquet_source_through_build_rows(tokenizer, tmp_path):
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "src.parquet")
    cfg = PromptsConfig(source=str(tmp_path / "src.parquet"), heldout_per_mille=250)
    rows, skipped = build_rows(cfg, tokenizer)
    assert skipped == {} and len(rows) == 40
    assert {r["prompt_text"] for r in rows} == set(texts)
    n_held = sum(r["split"] == "heldout" for r in rows)
    assert 0 < n_held < 40
    assert rows == build_rows(cfg, tokenizer)[0]


def test_unknown_config_key_is_an_error():
    with pytest.raises(ValueError, match="extra"):
        PromptsConfig(max_rows=3)


EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny_target" / "model"


@pytest.mark.skipif(not (EMBEDDED / "tokenizer.json").exists(), reason="no embedded target yet")
def test_embedded_corpus_prompts_split_by_module():
    from transformers import AutoTokenizer

    from models.tiny_target import corpus

    tok = AutoTokenizer.from_pretrained(EMBEDDED, local_files_only=True)
    cfg = PromptsConfig(max_train_rows=60, max_heldout_rows=20)
    rows, _ = build_rows(cfg, tok)
    splits = {f.module: f.split for f in corpus.list_sources()}
    assert sum(r["split"] == "train" for r in rows) == 60
    assert sum(r["split"] == "heldout" for r in rows) == 20
    for r in rows:
        assert splits[r["source"].removeprefix("stdlib:")] == r["split"]
        assert len(r["prompt_ids"]) <= cfg.max_prompt_tokens and r["reference_ids"]
    assert {"def_body", "file_continuation"} <= {r["kind"] for r in rows}
