"""The target wrapper: features, KV cache, batch masks, tree scoring, loading and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from models.losses import teacher_draft_probs
from models.target import Target, _transformers_bars_hidden, default_aux_layer_ids, load_target
from models.vocab import DraftVocab
from tests.models.conftest import tiny_hf_model, tiny_target

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny_target" / "model"


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models run faster on one thread than fighting the shared cores for two.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_forward_matches_hf_outputs(any_target: Target):
    ids = _ids(3, 17, any_target.vocab_size, 0)
    out = any_target.forward(ids)
    ref = any_target.model(input_ids=ids, output_hidden_states=True)
    H = any_target.hidden_size
    assert out.logits.dtype == torch.float32 and out.logits.shape == (3, 17, any_target.vocab_size)
    assert out.aux_hidden.shape == (3, 17, 3 * H) and out.last_hidden.shape == (3, 17, H)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=0, atol=1e-5)
    for i, k in enumerate(any_target.aux_layer_ids):
        # hidden_states[k] is the state entering layer k
        torch.testing.assert_close(out.aux_hidden[..., i * H : (i + 1) * H], ref.hidden_states[k])
    torch.testing.assert_close(out.last_hidden, ref.hidden_states[-1])
    torch.testing.assert_close(any_target.logits_from_hidden(out.last_hidden), out.logits)
    aux, last = any_target.forward_features(ids)
    torch.testing.assert_close(aux, out.aux_hidden, rtol=0, atol=0)
    torch.testing.assert_close(last, out.last_hidden, rtol=0, atol=0)


def test_attributes_and_default_layer_ids():
    target = Target.from_model(tiny_hf_model("llama", num_layers=8))
    assert target.aux_layer_ids == (2, 4, 5) == default_aux_layer_ids(8)
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (8, 32, 96)
    assert target.embed_weight is target.model.get_input_embeddings().weight
    assert target.lm_head_weight.shape == (96, 32)
    ident = target.identity
    assert ident["architecture"] == "LlamaForCausalLM" and ident["num_layers"] == 8
    assert (
        ident["hidden_size"] == 32
        and ident["vocab_size"] == 96
        and len(ident["weights_sha256"]) == 64
    )
    assert not any(p.requires_grad for p in target.model.parameters())


def test_identity_hash_tracks_weights():
    a = Target.from_model(tiny_hf_model("llama", seed=0), aux_layer_ids=(1, 2, 3))
    b = Target.from_model(tiny_hf_model("llama", seed=0), aux_layer_ids=(1, 2, 3))
    c = Target.from_model(tiny_hf_model("llama", seed=1), aux_layer_ids=(1, 2, 3))
    assert a.identity["weights_sha256"] == b.identity["weights_sha256"]
    assert a.identity["weights_sha256"] != c.identity["weights_sha256"]


def test_cache_extend_crop_and_select(tiny_llama: Target):
    ids = _ids(2, 20, tiny_llama.vocab_size, 1)
    full = tiny_llama.forward(ids)
    cache = tiny_llama.new_cache()
    tiny_llama.forward(ids[:, :12], cache=cache)
    assert tiny_llama.cache_length(cache) == 12
    # a wrong continuation, then crop it away and continue with the real one
    tiny_llama.forward(_ids(2, 5, tiny_llama.vocab_size, 2), cache=cache)
    tiny_llama.crop_cache(cache, 12)
    rest = tiny_llama.forward(ids[:, 12:], cache=cache)
    torch.testing.assert_close(rest.logits, full.logits[:, 12:], rtol=0, atol=1e-4)
    torch.testing.assert_close(rest.aux_hidden, full.aux_hidden[:, 12:], rtol=0, atol=1e-4)
    tiny_llama.select_cache_rows(cache, torch.tensor([1]))
    one = tiny_llama.forward(ids[1:, :3], cache=cache)  # positions continue at 20
    ref = tiny_llama.forward(torch.cat([ids[1:], ids[1:, :3]], dim=1)).logits[:, 20:]
    torch.testing.assert_close(one.logits, ref, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="cannot crop"):
        tiny_llama.crop_cache(cache, 99)


def test_batch_mask_with_per_row_validity(any_target: Target):
    """Right-padded rows and invalid cache slots give each row exactly its own unpadded result."""
    lengths = [9, 4, 7]
    rows = [_ids(1, n, any_target.vocab_size, 10 + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], valid[i, : len(r)] = r, True
    mask = torch.ones(width, width, dtype=torch.bool).tril() & valid[:, None, :]
    mask |= torch.eye(width, dtype=torch.bool)
    cache = any_target.new_cache()
    out = any_target.forward(
        ids, position_ids=torch.arange(width).expand(3, -1), attention_mask=mask, cache=cache
    )
    # one more token per row at each row's own next position, cache slots past its length invalid
    nxt = _ids(3, 1, any_target.vocab_size, 20)
    step_mask = torch.cat([valid, torch.ones(3, 1, dtype=torch.bool)], dim=1)[:, None]
    step = any_target.forward(
        nxt,
        position_ids=torch.tensor(lengths)[:, None],
        attention_mask=step_mask,
        cache=cache,
    )
    for i, r in enumerate(rows):
        ref = any_target.forward(torch.cat([r, nxt[i]])[None])
        n = len(r)
        torch.testing.assert_close(out.logits[i, :n], ref.logits[0, :n], rtol=0, atol=1e-4)
        torch.testing.assert_close(out.aux_hidden[i, :n], ref.aux_hidden[0, :n], rtol=0, atol=1e-4)
        torch.testing.assert_close(step.logits[i, 0], ref.logits[0, n], rtol=0, atol=1e-4)


def _branches(context_len: int, vocab: int, seed: int) -> list[tuple[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    anchors = [1, context_len] + torch.randint(2, context_len, (6,), generator=gen).tolist()
    lengths = [6, 1, 3, 6, 6, 2, 5, 6]
    return [
        (a, torch.randint(0, vocab, (n,), generator=gen))
        for a, n in zip(anchors, lengths, strict=True)
    ]


def _check_tree(target: Target, context: torch.Tensor, branches, temperature: float = 1.0) -> None:
    scores = target.score_tree(context, branches, temperature=temperature)
    plain = target.forward(context[None])
    torch.testing.assert_close(scores.context_aux_hidden, plain.aux_hidden[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(scores.context_last_hidden, plain.last_hidden[0], rtol=0, atol=1e-4)
    assert len(scores.log_probs) == len(branches)
    for (anchor, tokens), lp, hidden, tok_lp in zip(
        branches, scores.log_probs, scores.hidden, scores.token_log_probs, strict=True
    ):
        alone = target.forward(torch.cat([context[:anchor], tokens])[None])
        ref_lp = torch.log_softmax(alone.logits[0, anchor - 1 :] / temperature, dim=-1)  # [L+1, V]
        assert lp.shape == (len(tokens) + 1, target.vocab_size)
        assert (lp - ref_lp).abs().max() <= 1e-4
        assert (hidden - alone.last_hidden[0, anchor - 1 :]).abs().max() <= 1e-4
        torch.testing.assert_close(tok_lp, ref_lp[:-1].gather(-1, tokens[:, None])[:, 0])


def test_score_tree_equals_separate_scoring(any_target: Target):
    context = _ids(1, 40, any_target.vocab_size, 3)[0]
    _check_tree(any_target, context, _branches(40, any_target.vocab_size, 4))


def test_score_tree_with_temperature_and_eager_attention():
    target = tiny_target("qwen3", attn_implementation="eager")
    context = _ids(1, 30, target.vocab_size, 5)[0]
    _check_tree(target, context, _branches(30, target.vocab_size, 6), temperature=0.7)


def test_score_tree_rejects_bad_branches(tiny_llama: Target):
    context = list(range(10))
    with pytest.raises(ValueError, match=r"anchor 0 must be in \[1, 10\]"):
        tiny_llama.score_tree(context, [(0, [1, 2])])
    with pytest.raises(ValueError, match=r"anchor 11 must be in \[1, 10\]"):
        tiny_llama.score_tree(context, [(11, [1, 2])])
    with pytest.raises(ValueError, match="branch 1 has no tokens"):
        tiny_llama.score_tree(context, [(3, [1]), (4, [])])
    with pytest.raises(ValueError, match="token ids must lie in"):
        tiny_llama.score_tree(context, [(3, [1, 96])])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        tiny_llama.score_tree(context, [(3, [1])], temperature=0.0)
    with pytest.raises(ValueError, match="non-empty context"):
        tiny_llama.score_tree([], [(1, [1])])


def test_forward_rejects_bad_masks(tiny_llama: Target):
    ids = _ids(2, 5, tiny_llama.vocab_size, 7)
    with pytest.raises(ValueError, match=r"attention_mask must be bool \[B, T, cache\+T\]"):
        tiny_llama.forward(ids, attention_mask=torch.ones(2, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be torch.bool"):
        tiny_llama.forward(ids, attention_mask=torch.ones(2, 5, 5))
    with pytest.raises(ValueError, match="position_ids shape"):
        tiny_llama.forward(ids, position_ids=torch.arange(4)[None])


# ---------------------------------------------------------------------------- loading


def _save_model(
    directory: Path, *, vocab_size: int = 96, tokenizer_size: int | None = None
) -> Path:
    model = tiny_hf_model("llama", vocab_size=vocab_size)
    model.save_pretrained(directory)
    if tokenizer_size is not None:
        vocab = {f"t{i}": i for i in range(tokenizer_size)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(directory)
    return directory


def test_load_target_roundtrip(tmp_path: Path):
    directory = _save_model(tmp_path / "m", tokenizer_size=90)
    target = load_target(directory, aux_layer_ids=(1, 2, 3))
    in_process = Target.from_model(tiny_hf_model("llama"), aux_layer_ids=(1, 2, 3))
    ids = _ids(2, 11, 96, 8)
    got, ref = target.forward(ids), in_process.forward(ids)
    torch.testing.assert_close(got.logits, ref.logits)
    torch.testing.assert_close(got.aux_hidden, ref.aux_hidden)
    ident = target.identity
    assert ident["path"] == str(directory.resolve()) and ident["aux_layer_ids"] == [1, 2, 3]
    assert len(ident["weights_sha256"]) == 64
    # the identity follows the weights file's content
    again = load_target(directory, aux_layer_ids=(1, 2, 3))
    assert again.identity["weights_sha256"] == ident["weights_sha256"]


def test_transformers_own_bars_are_hidden_at_a_load_unless_verbose(tmp_path, capsys, monkeypatch):
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        pytest.skip("HF_HUB_DISABLE_PROGRESS_BARS hides transformers' bars in this environment")
    directory = _save_model(tmp_path / "m")
    monkeypatch.delenv("OPD_VERBOSE", raising=False)
    load_target(directory, aux_layer_ids=(1, 2, 3))
    assert "Loading weights" not in capsys.readouterr().err  # was: drawn at every load
    assert hf_logging.is_progress_bar_enabled()  # as it was: a host process keeps its bars
    with _transformers_bars_hidden():
        list(tqdm(range(2), desc="a stage's own bar"))
        list(hf_logging.tqdm(range(2), desc="a library bar"))
    err = capsys.readouterr().err
    assert "a stage's own bar" in err and "a library bar" not in err

    monkeypatch.setenv("OPD_VERBOSE", "1")  # opd --verbose
    load_target(directory, aux_layer_ids=(1, 2, 3))
    assert "Loading weights" in capsys.readouterr().err


def test_load_target_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_target(tmp_path / "empty")
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="has no safetensors weights"):
        load_target(no_weights)
    too_big = _save_model(tmp_path / "tok", vocab_size=96, tokenizer_size=100)
    with pytest.raises(
        ValueError, match="tokenizer has 100 tokens but the model's vocab_size is 96"
    ):
        load_target(too_big, aux_layer_ids=(1, 2, 3))
    good = _save_model(tmp_path / "good")
    with pytest.raises(ValueError, match="aux_layer_ids must be 3 integers"):
        load_target(good, aux_layer_ids=(1, 2))
    with pytest.raises(ValueError, match=r"out of range for a 4-layer target.*\[1, 4\)"):
        load_target(good, aux_layer_ids=(1, 2, 4))
    # the default ids (2, N//2, N-3) do not fit a 2-layer model: ask for explicit ids
    with pytest.raises(ValueError, match="pass aux_layer_ids explicitly"):
        Target.from_model(tiny_hf_model("llama", num_layers=2))


AUX = (1, 2, 3)


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pickled_weights_are_refused_even_beside_an_unrelated_safetensors_file(tmp_path: Path):
    directory = tmp_path / "bin"
    directory.mkdir()
    model = tiny_hf_model("llama")
    (directory / "config.json").write_text(model.config.to_json_string())
    # writing a pickle is safe; loading one (what transformers would do here) is not
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    save_file({"scale": torch.ones(3)}, str(directory / "adapter.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"pickles only \(pytorch_model.bin\).*convert the checkpoint to safetensors",
    ):
        load_target(directory, aux_layer_ids=AUX)


def test_identity_hashes_exactly_the_files_loaded(tmp_path: Path):
    directory = _save_model(tmp_path / "m")
    before = load_target(directory, aux_layer_ids=AUX).identity["weights_sha256"]
    save_file({"scale": torch.ones(3)}, str(directory / "adapter.safetensors"))
    assert load_target(directory, aux_layer_ids=AUX).identity["weights_sha256"] == before


def test_sharded_checkpoint_loads_the_index_shards_and_hashes_them(tmp_path: Path):
    single = load_target(_save_model(tmp_path / "one"), aux_layer_ids=AUX)
    directory = tmp_path / "sharded"
    tiny_hf_model("llama").save_pretrained(directory, max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    target = load_target(directory, aux_layer_ids=AUX)
    ids = _ids(1, 6, 96, 3)
    assert torch.equal(target.forward(ids).logits, single.forward(ids).logits)
    ident = target.identity["weights_sha256"]
    save_file({"scale": torch.ones(3)}, str(directory / "stray.safetensors"))  # not in the index
    assert load_target(directory, aux_layer_ids=AUX).identity["weights_sha256"] == ident
    (directory / shards[-1]).unlink()
    with pytest.raises(ValueError, match=rf"shards \['{shards[-1]}'\] listed in .* are missing"):
        load_target(directory, aux_layer_ids=AUX)


def test_a_config_that_contradicts_the_weights_is_one_line(tmp_path: Path):
    directory = _save_model(tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["hidden_size"] = 64
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json does not belong to these weights") as err:
        load_target(directory, aux_layer_ids=AUX)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: b"\xff" * 8 + data[8:],  # header length garbage
        lambda data: data[:8] + b"{not json" + data[17:],  # header text garbage
    ],
)
def test_a_corrupted_weights_file_is_named(tmp_path: Path, damage):
    directory = _save_model(tmp_path / "m")
    weights = directory / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(
        ValueError, match="model.safetensors is not a readable safetensors file"
    ) as err:
        load_target(directory, aux_layer_ids=AUX)
    assert "\n" not in str(err.value) and str(weights) in str(err.value)


def test_target_config_refuses_unordered_or_repeated_aux_ids():
    from pipeline.core.targets import TargetConfig

    for ids in ([5, 1, 3], [3, 3, 5], [0, 2, 4]):
        with pytest.raises(ValueError, match="strictly increasing and >= 1"):
            TargetConfig(aux_layer_ids=ids)
    with pytest.raises(ValueError, match=r"out of range for a 4-layer target"):
        TargetConfig(path="random", aux_layer_ids=[1, 2, 4])
    # EAGLE-3's (2, N//2, N-3) is (2, 2, 1) on 4 layers: too shallow, so spread over [1, 4)
    assert default_aux_layer_ids(4, 3) == (1, 2, 3) and TargetConfig(path="random")
    assert TargetConfig(aux_layer_ids=[1, 3, 5]).aux_layer_ids == [1, 3, 5]


def test_unsupported_architecture_is_refused():
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    )
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        Target.from_model(gpt2)


@pytest.mark.skipif(
    not (EMBEDDED / "model.safetensors").is_file(), reason="embedded target not trained yet"
)
def test_embedded_target_loads():
    # EAGLE-3's default (2, N//2, N-3) repeats a layer on 6 layers: the default profile's ids
    target = load_target(EMBEDDED, aux_layer_ids=(1, 3, 5))
    assert target.num_layers >= 6
    ids = _ids(1, 16, target.vocab_size, 9)
    out = target.forward(ids)
    assert torch.isfinite(out.logits).all()


def test_the_target_captures_as_many_layers_as_the_kind_reads():
    from pipeline.core.targets import TargetConfig

    # five layers spread as the public DFlash recipe places them: outputs of layers 1, 9 .. 33
    assert default_aux_layer_ids(36, 5) == (2, 10, 18, 26, 34)
    assert default_aux_layer_ids(36) == (2, 18, 33)  # three: EAGLE-3's and vLLM's
    target = Target.from_model(tiny_hf_model("llama", num_layers=8), aux_layers=5)
    assert target.aux_layer_ids == (2, 3, 4, 5, 6)
    out = target.forward(torch.tensor([[1, 2, 3]]))
    assert out.aux_hidden.shape[-1] == 5 * target.hidden_size
    with pytest.raises(ValueError, match="must be 5 integers .*as many as the drafter kind reads"):
        Target.from_model(tiny_hf_model("llama", num_layers=8), (1, 2, 3), aux_layers=5)
    with pytest.raises(ValueError, match="must be 5 ids, as many as the drafter kind reads"):
        TargetConfig(aux_layer_ids=[1, 2, 3], aux_layers=5)
    with pytest.raises(ValueError, match="reads 5 target layers, but a 4-layer target has 3"):
        TargetConfig(path="random", aux_layers=5)


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_the_draft_only_teacher_is_the_renormalised_teacher(tiny_llama, temperature):
    torch.manual_seed(0)
    V = tiny_llama.vocab_size
    vocab = DraftVocab.from_counts(torch.randint(0, 50, (V,)).float(), V // 4)
    hidden = torch.randn(2, 6, tiny_llama.hidden_size)
    want = teacher_draft_probs(tiny_llama.teacher(hidden, vocab), vocab, temperature)
    got = tiny_llama.draft_teacher(hidden, vocab, temperature)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
