"""The one decoding loop, on chains and on EAGLE-2 trees (proposals of an EAGLE-3 drafter), is
lossless (T=0 token for token, T>0 in law), and its logs add up."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import models.decoding as spec
import models.verify as verify
from models.chain import ChainDrafter, shift_left, ttt_unroll
from models.decoding import SpecConfig, speculative_generate, target_generate
from models.drafter import ChainShape, TreeShape
from models.drafters import KINDS
from models.eagle3.drafter import Eagle3Drafter
from models.eagle3.model import Eagle3Config
from models.target import Target, load_target
from models.vocab import DraftVocab
from tests.models.conftest import tiny_target

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny_target" / "model"
MAX_NEW = 20


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models run faster on one thread than fighting the shared cores for two.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_drafter(
    target: Target, draft_vocab_size: int, *, counts=None, seed: int = 0
) -> Eagle3Drafter:
    if counts is None:  # a fixed, scattered draft vocab, so d2t offsets are not all zero
        counts = torch.randperm(
            target.vocab_size, generator=torch.Generator().manual_seed(0)
        ).float()
    vocab = DraftVocab.from_counts(counts, draft_vocab_size)
    config = Eagle3Config.from_target(target.config, draft_vocab_size, target.aux_layer_ids)
    torch.manual_seed(seed)
    return Eagle3Drafter(config, target.embed_weight, vocab).eval()


def random_prompts(n: int, vocab: int, seed: int, lengths=(3, 12)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (s,), generator=gen).tolist() for s in sizes]


def hf_greedy(target: Target, prompts, max_new: int, eos: int | None = None) -> list[list[int]]:
    """The reference: transformers' own greedy `generate`, one prompt at a time (no padding)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        # an explicit mask, else HF masks out prompt tokens that equal pad_token_id
        ids = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def fit_drafter(target: Target, sequences: list[list[int]], draft_vocab_size: int) -> Eagle3Drafter:
    """A drafter overfit (TTT, 2 steps) on the target's own greedy sequences, so drafts get accepted."""
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    valid = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], valid[i, : len(s)] = torch.tensor(s), True
    drafter = make_drafter(
        target,
        draft_vocab_size,
        counts=torch.bincount(ids[valid], minlength=target.vocab_size).float(),
    )
    aux = target.forward(ids).aux_hidden  # right padding is harmless under a causal mask
    vocab = drafter.vocab
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2)
    drafter.train()
    for _ in range(80):
        loss = 0.0
        for k, step in enumerate(ttt_unroll(drafter, aux, ids, steps=2, loss_mask=valid)):
            label = vocab.to_draft(shift_left(ids, k + 2))
            keep = step.valid & (label >= 0)
            loss = loss + 0.8**k * torch.nn.functional.cross_entropy(step.logits[keep], label[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def greedy_case(tiny_llama: Target):
    torch.set_num_threads(1)
    prompts = random_prompts(20, tiny_llama.vocab_size, seed=0)
    reference = hf_greedy(tiny_llama, prompts, MAX_NEW)
    fitted = fit_drafter(tiny_llama, [p + r for p, r in zip(prompts, reference, strict=True)], 64)
    return prompts, reference, fitted


# ---------------------------------------------------------------------------- (a) T = 0


@pytest.mark.parametrize(
    ("which", "batch"),
    [("random", 1), ("random", 20), ("fitted", 1), ("fitted", 7), ("fitted", 20)],
)
def test_greedy_equals_hf_generate(tiny_llama: Target, greedy_case, which: str, batch: int):
    prompts, reference, fitted = greedy_case
    drafter = fitted if which == "fitted" else make_drafter(tiny_llama, 64, seed=1)
    cfg = SpecConfig(ChainShape(4), temperature=0.0, max_new_tokens=MAX_NEW, eos_token_ids=())
    got, accepted = [], []
    for i in range(0, len(prompts), batch):
        result = speculative_generate(tiny_llama, drafter, prompts[i : i + batch], cfg)
        got += result.sequences
        accepted += result.steps["accepted"]
        assert result.finish_reasons == ["length"] * len(result.sequences)
    assert got == reference
    if which == "fitted":  # the equality above must also have been tested on accepted drafts
        assert sum(accepted) > 150 and accepted.count(4) >= 5


def test_greedy_qwen3_batch(tiny_qwen3: Target):
    prompts = random_prompts(20, tiny_qwen3.vocab_size, seed=1)
    reference = hf_greedy(tiny_qwen3, prompts, 16)
    fitted = fit_drafter(tiny_qwen3, [p + r for p, r in zip(prompts, reference, strict=True)], 80)
    cfg = SpecConfig(ChainShape(3), max_new_tokens=16, eos_token_ids=())
    result = speculative_generate(tiny_qwen3, fitted, prompts, cfg)
    assert result.sequences == reference
    assert result.stats["tau"] > 1.5


def test_greedy_stops_at_eos_like_hf(tiny_llama: Target, greedy_case):
    prompts, reference, fitted = greedy_case
    # the most frequent generated token as EOS: most rows stop early, at different steps
    eos = int(torch.tensor(sum(reference, [])).bincount().argmax())
    expected = hf_greedy(tiny_llama, prompts, MAX_NEW, eos=eos)
    assert sum(eos in r for r in expected) >= 8
    cfg = SpecConfig(ChainShape(4), max_new_tokens=MAX_NEW, eos_token_ids=(eos,))
    result = speculative_generate(tiny_llama, fitted, prompts, cfg)
    assert result.sequences == expected
    assert result.finish_reasons == ["eos" if eos in r else "length" for r in expected]
    plain = target_generate(tiny_llama, prompts, MAX_NEW, eos_token_ids=(eos,))
    assert plain.sequences == expected


# ---------------------------------------------------------------------------- (b) T > 0

LAW_VOCAB = 8
LAW_PROMPT = [1, 5, 2]


@pytest.fixture(scope="module")
def law_case():
    """A target over 8 tokens and a random drafter over 6 of them (q = 0 on ids 0 and 3)."""
    target = tiny_target(
        "llama",
        vocab_size=LAW_VOCAB,
        hidden_size=16,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        head_scale=1.0,
        aux_layer_ids=(1, 2, 3),
    )
    counts = torch.tensor([0.0, 5, 5, 0, 5, 5, 5, 5])
    drafter = make_drafter(target, 6, counts=counts, seed=3)
    assert drafter.d2t.tolist() == [1, 1, 2, 2, 2, 2]
    return target, drafter


def exact_joint(target: Target, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(x1, x2, x3) of the target at `temperature`, by enumerating all V^2 continuations."""
    V = target.vocab_size
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), pairs], dim=1)
    logp = torch.log_softmax(target.forward(ids).logits.double() / temperature, dim=-1)
    n = len(prompt)
    x1, x2 = pairs[:, 0], pairs[:, 1]
    rows = torch.arange(V * V)
    joint = logp[rows, n - 1, x1] + logp[rows, n, x2]  # [V*V]
    joint = joint[:, None] + logp[:, n + 1]  # [V*V, V]
    return joint.exp().reshape(V, V, V)


def chi_square(samples: list[list[int]], joint: torch.Tensor) -> tuple[float, float, float]:
    """Pearson's statistic of the first three tokens against `joint`, with its 1e-6 critical value.

    Cells expected below 5 are pooled into one. The critical value uses Wilson-Hilferty's
    approximation of the chi-square quantile (z = 4.753 for an upper tail of 1e-6).
    """
    V = joint.shape[0]
    x = torch.tensor([s[:3] for s in samples])
    counts = torch.bincount(x[:, 0] * V * V + x[:, 1] * V + x[:, 2], minlength=V**3).double()
    expected = joint.reshape(-1) * counts.sum()
    big = expected >= 5
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    stat += (counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum().clamp(min=1e-9)
    df = int(big.sum())  # big cells + the pooled cell - 1
    critical = df * (1 - 2 / (9 * df) + 4.753 * math.sqrt(2 / (9 * df))) ** 3
    tv = 0.5 * float((counts / counts.sum() - joint.reshape(-1)).abs().sum())
    return float(stat), critical, tv


def sample_first_three(target, drafter, k: int, temperature: float, n: int, seed: int = 0):
    cfg = SpecConfig(
        ChainShape(k), temperature=temperature, max_new_tokens=k + 2, seed=seed, eos_token_ids=()
    )
    return speculative_generate(target, drafter, [LAW_PROMPT] * n, cfg)


# K=1 puts the bonus token at x3; K=2 puts residual sampling at offsets 1 and 2 (x2, x3).
@pytest.mark.parametrize(("k", "temperature"), [(1, 1.0), (2, 1.0), (2, 0.7)])
def test_sampling_law_equals_target(law_case, k: int, temperature: float):
    target, drafter = law_case
    result = sample_first_three(target, drafter, k, temperature, n=20_000)
    stat, critical, tv = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, temperature))
    assert stat < critical, (stat, critical, tv)
    # acceptances and rejections both happened, so both branches were under test
    outcomes = result.records["outcome"]
    assert outcomes.count("accepted") > 2000 and outcomes.count("rejected") > 2000


def _accept_always(p_tok, q_tok, gen):
    return torch.ones_like(p_tok, dtype=torch.bool), torch.ones_like(p_tok)


def _resample_from_p(p, proposal, accepted, block_len, gen):
    rows = torch.arange(len(p))
    return torch.multinomial(p[rows, accepted], 1, generator=gen)[:, 0]


@pytest.mark.parametrize(
    ("name", "broken"), [("accept_drafts", _accept_always), ("correction", _resample_from_p)]
)
def test_sampling_law_catches_a_broken_verifier(law_case, monkeypatch, name: str, broken):
    target, drafter = law_case
    monkeypatch.setattr(verify, name, broken)
    result = sample_first_three(target, drafter, 2, 1.0, n=8_000)
    stat, critical, _ = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat > critical


def test_plain_sampling_law_equals_target(law_case):
    target, _ = law_case
    result = target_generate(
        target, [LAW_PROMPT] * 20_000, 3, temperature=1.0, seed=1, eos_token_ids=()
    )
    stat, critical, _ = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat < critical and result.target_forwards == 3


# ---------------------------------------------------------------------------- (c) records


def _count_forwards(monkeypatch, target: Target) -> list[int]:
    # every target forward runs its layers through forward_features (the prefill without the
    # full head as well)
    calls = [0]
    real = target.forward_features

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "forward_features", counting)
    return calls


def test_the_prefill_computes_the_head_at_each_prompts_last_position_only(
    tiny_llama: Target, monkeypatch
):
    prompts = random_prompts(4, tiny_llama.vocab_size, seed=3, lengths=(5, 12))
    heads = []
    real = tiny_llama.logits_from_hidden

    def recording(hidden):
        heads.append(tuple(hidden.shape[:-1]))
        return real(hidden)

    monkeypatch.setattr(tiny_llama, "logits_from_hidden", recording)
    out = target_generate(tiny_llama, prompts, max_new_tokens=1, eos_token_ids=())
    assert heads == [(4,)]  # one row per prompt, not [B, P, V] over every prompt position
    monkeypatch.undo()
    assert out.sequences == hf_greedy(tiny_llama, prompts, 1)


def _head_everywhere(drafter):
    """`drafter.chain_step` computing its head at every position and reading `head_at` after."""
    step = drafter.chain_step

    def everywhere(*args, head_at=None, **kwargs):
        logits, hidden = step(*args, **kwargs)
        if head_at is None:
            return logits, hidden
        return logits[torch.arange(len(head_at)), head_at], hidden

    return everywhere


def test_a_chain_drafter_computes_its_head_at_each_rows_last_position_only(tiny_llama: Target):
    # The drafter's first step reads every prompt position (its cache needs them all) but
    # drafts from each row's last: a head over all of them was [B, P, V] fp32 for a kind with
    # the target's full-vocabulary head, what the target's prefill no longer computes.
    prompts = random_prompts(4, tiny_llama.vocab_size, seed=3, lengths=(5, 12))
    counts = torch.arange(tiny_llama.vocab_size, dtype=torch.float)
    chains = [kind for kind in KINDS.values() if issubclass(kind.drafter, ChainDrafter)]
    assert len(chains) > 1  # the one proposer serves several kinds
    cfg = SpecConfig(ChainShape(3), max_new_tokens=8, eos_token_ids=())
    for kind in chains:
        torch.manual_seed(0)
        drafter = kind.drafter.new(tiny_llama, DraftVocab.from_counts(counts, 64), {}).eval()
        positions: list[int] = []  # what the head computes per call, over the batch
        hook = drafter.lm_head.register_forward_pre_hook(
            lambda _, args, seen=positions: seen.append(args[0].shape[:-1].numel())
        )
        got = speculative_generate(tiny_llama, drafter, prompts, cfg)
        hook.remove()
        assert positions and max(positions) <= len(prompts), (kind.name, positions)
        # the same drafts as a head over every position, read at the last one
        drafter.chain_step = _head_everywhere(drafter)
        want = speculative_generate(tiny_llama, drafter, prompts, cfg)
        assert got.records["token"] == want.records["token"], kind.name
        assert got.sequences == want.sequences == hf_greedy(tiny_llama, prompts, 8), kind.name


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_records_steps_and_stats_add_up(tiny_llama: Target, greedy_case, monkeypatch, temperature):
    prompts, _, fitted = greedy_case
    K = 4
    calls = _count_forwards(monkeypatch, tiny_llama)
    cfg = SpecConfig(
        ChainShape(K), temperature=temperature, max_new_tokens=MAX_NEW, seed=5, eos_token_ids=()
    )
    result = speculative_generate(tiny_llama, fitted, prompts, cfg)
    rec, steps, stats = result.records, result.steps, result.stats

    # target forwards: one prefill + one batched verify per step; per sequence, exactly 1/tau
    per_seq_steps = [steps["sequence"].count(i) for i in range(len(prompts))]
    assert calls[0] == stats["target_forwards"] == 1 + max(per_seq_steps)
    assert stats["verify_forwards"] == max(per_seq_steps) and stats["prefill_forwards"] == 1
    accepted = torch.tensor(steps["accepted"])
    assert stats["tau"] == pytest.approx(float((accepted + 1).float().mean()), abs=1e-6)
    assert stats["target_forwards_per_token"] == pytest.approx(1 / stats["tau"], rel=1e-6)
    assert sum(steps["accepted"]) > 50

    by_step: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(rec["sequence"], rec["step"], strict=True)):
        by_step.setdefault(key, []).append(i)
    anchors: dict[int, int] = {}
    for s, t, anchor, drafted, acc, emitted in zip(
        *(steps[c] for c in spec.STEP_COLUMNS), strict=True
    ):
        seq = prompts[s] + result.sequences[s]
        assert emitted == acc + 1 and 0 <= acc <= drafted <= K
        # anchors advance by what each step emitted, starting after prompt + prefill token
        assert anchor == anchors.get(s, len(prompts[s]) + 1)
        anchors[s] = anchor + emitted
        rows = by_step.get((s, t), [])
        assert [rec["offset"][i] for i in rows] == list(range(1, drafted + 1))
        expected = ["accepted"] * acc + ["rejected"] * (acc < drafted)
        expected += ["not_reached"] * (drafted - len(expected))
        assert [rec["outcome"][i] for i in rows] == expected
        for i in rows:
            assert rec["anchor"][i] == anchor
            position = anchor + rec["offset"][i] - 1
            outcome = rec["outcome"][i]
            if outcome == "accepted":
                assert rec["token"][i] == seq[position] == rec["target_token"][i]
            elif outcome == "rejected":
                assert rec["target_token"][i] == seq[position] != rec["token"][i]
            else:
                assert rec["target_token"][i] == -1
            if temperature == 0:
                assert rec["q"][i] == 1.0 and rec["p"][i] == rec["accept_prob"][i]
                if outcome != "not_reached":
                    assert rec["accept_prob"][i] == float(outcome == "accepted")
            else:
                ratio = min(1.0, rec["p"][i] / rec["q"][i])
                assert rec["accept_prob"][i] == pytest.approx(ratio, rel=1e-5)
    for s, seq in enumerate(result.sequences):
        assert len(seq) == MAX_NEW and anchors[s] == len(prompts[s]) + MAX_NEW
    for offset in range(1, K + 1):
        reached = [
            o
            for o, f in zip(rec["outcome"], rec["offset"], strict=True)
            if f == offset and o != "not_reached"
        ]
        if reached:
            alpha = reached.count("accepted") / len(reached)
            assert stats["alpha"][offset - 1] == pytest.approx(alpha)


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_drafts_follow_the_training_row_convention(tiny_llama: Target, greedy_case, temperature):
    """Drafts and their q / p agree with the training path (`ttt_unroll`) and a plain forward.

    A block anchored at position e is drafted from row e-2 (feature f_{e-2}, token x_{e-1}); chain
    step k continues that row with the block's k-th draft. Decoding and training must agree on
    positions, hidden feedback and attention, or SFT would train a drafter decoding never runs.
    At T>0, q must be softmax(drafter logits / T) and p softmax(target logits / T).
    """
    prompts, _, fitted = greedy_case
    K = 3
    cfg = SpecConfig(
        ChainShape(K), temperature=temperature, max_new_tokens=MAX_NEW, seed=2, eos_token_ids=()
    )
    result = speculative_generate(tiny_llama, fitted, prompts[:6], cfg)
    rec = result.records
    checked = 0
    for s, prompt in enumerate(prompts[:6]):
        seq = torch.tensor([prompt + result.sequences[s]])
        full = tiny_llama.forward(seq)
        step_tokens = [None] + [seq.clone() for _ in range(K - 1)]
        blocks: dict[int, list[int]] = {}
        for i in range(len(rec["sequence"])):
            if rec["sequence"][i] == s:
                blocks.setdefault(rec["anchor"][i], []).append(i)
        for anchor, rows in blocks.items():
            for k, i in enumerate(rows[:-1], start=1):
                step_tokens[k][0, anchor - 2] = rec["token"][i]
        with torch.no_grad():
            steps = ttt_unroll(fitted, full.aux_hidden, seq, steps=K, step_tokens=step_tokens)
        for anchor, rows in blocks.items():
            for k, i in enumerate(rows):
                logits = steps[k].logits[0, anchor - 2]  # [Vd]
                token = rec["token"][i]
                if temperature == 0:
                    assert int(fitted.vocab.to_target(logits.argmax())) == token, (s, anchor, k)
                else:
                    q = torch.softmax(logits / temperature, -1)[
                        fitted.vocab.to_draft(torch.tensor(token))
                    ]
                    assert rec["q"][i] == pytest.approx(float(q), rel=1e-3, abs=1e-6)
                    if rec["outcome"][i] != "not_reached":  # its prefix is the committed sequence
                        target_logits = full.logits[0, anchor + k - 1]
                        p = torch.softmax(target_logits / temperature, -1)[token]
                        assert rec["p"][i] == pytest.approx(float(p), rel=1e-3, abs=1e-6)
                checked += 1
    assert checked > 100


def test_eos_inside_a_block_ends_it(tiny_llama: Target, greedy_case):
    prompts, reference, fitted = greedy_case
    eos = int(torch.tensor(sum(reference, [])).bincount().argmax())
    cfg = SpecConfig(ChainShape(4), max_new_tokens=MAX_NEW, eos_token_ids=(eos,))
    result = speculative_generate(tiny_llama, fitted, prompts, cfg)
    steps = result.steps
    ended = 0
    for s, acc, emitted, drafted in zip(
        steps["sequence"], steps["accepted"], steps["emitted"], steps["drafted"], strict=True
    ):
        if emitted == acc:  # an accepted EOS closed the block: nothing emitted after it
            ended += 1
            assert acc == drafted and result.sequences[s][-1] == eos
        else:
            assert emitted == acc + 1
    total = sum(len(s) for s in result.sequences)
    assert total == len(prompts) + sum(steps["emitted"])
    assert ended >= 1  # the fitted drafter proposes EOS where the target emits it


def test_budget_shrinks_the_last_block(tiny_llama: Target, greedy_case):
    prompts, reference, fitted = greedy_case
    cfg = SpecConfig(ChainShape(4), max_new_tokens=6, eos_token_ids=())
    result = speculative_generate(tiny_llama, fitted, prompts[:4], cfg)
    assert result.sequences == [r[:6] for r in reference[:4]]
    for s, anchor, drafted in zip(
        result.steps["sequence"], result.steps["anchor"], result.steps["drafted"], strict=True
    ):
        remaining = len(prompts[s]) + 6 - anchor
        assert drafted == min(4, remaining - 1)


# ---------------------------------------------------------------------------- (e) bad input


def test_bad_inputs_are_refused_before_any_work(tiny_llama: Target, monkeypatch):
    drafter = make_drafter(tiny_llama, 64)
    calls = _count_forwards(monkeypatch, tiny_llama)
    prompts = [[1, 2, 3]]
    with pytest.raises(ValueError, match="k .* must be a positive int, got 0"):
        speculative_generate(tiny_llama, drafter, prompts, SpecConfig(ChainShape(0)))
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        speculative_generate(
            tiny_llama, drafter, prompts, SpecConfig(ChainShape(2), temperature=-0.5)
        )
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        speculative_generate(
            tiny_llama, drafter, prompts, SpecConfig(ChainShape(2), max_new_tokens=0)
        )
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        speculative_generate(tiny_llama, drafter, [[1], []], SpecConfig(ChainShape(2)))
    with pytest.raises(ValueError, match=r"outside the target vocab \[0, 96\)"):
        speculative_generate(tiny_llama, drafter, [[1, 96]], SpecConfig(ChainShape(2)))
    with pytest.raises(ValueError, match="no prompts"):
        speculative_generate(tiny_llama, drafter, [], SpecConfig(ChainShape(2)))
    with pytest.raises(ValueError, match="temperature must be"):
        target_generate(tiny_llama, prompts, 4, temperature=float("nan"))

    other_vocab = tiny_target("llama", vocab_size=80)
    with pytest.raises(ValueError, match="drafter vocab size is 80, target's is 96"):
        speculative_generate(
            tiny_llama, make_drafter(other_vocab, 40), prompts, SpecConfig(ChainShape(2))
        )
    other_width = tiny_target("llama", hidden_size=48, num_heads=4)
    with pytest.raises(ValueError, match="drafter hidden size is 48, target's is 32"):
        speculative_generate(
            tiny_llama, make_drafter(other_width, 64), prompts, SpecConfig(ChainShape(2))
        )
    five = tiny_target("llama", num_layers=5)
    other_layers = Target.from_model(five.model, aux_layer_ids=(1, 2, 4))
    with pytest.raises(ValueError, match=r"aux layer ids is \(1, 2, 4\), target's is \(1, 2, 3\)"):
        speculative_generate(
            five, make_drafter(other_layers, 64), prompts, SpecConfig(ChainShape(2))
        )
    # same shapes, another model's embedding: loads, runs, accepts nothing; refuse it
    other_seed = tiny_target("llama", seed=1)
    with pytest.raises(ValueError, match="embed_tokens is not the target's embedding"):
        speculative_generate(
            tiny_llama, make_drafter(other_seed, 64), prompts, SpecConfig(ChainShape(2))
        )
    assert calls[0] == 0


# ---------------------------------------------------------------------------- embedded target


@pytest.mark.skipif(
    not (EMBEDDED / "model.safetensors").is_file(), reason="embedded target not trained yet"
)
def test_greedy_equals_hf_generate_on_embedded_target():
    target = load_target(EMBEDDED, aux_layer_ids=(1, 3, 5))
    prompts = random_prompts(20, target.vocab_size, seed=7, lengths=(14, 19))
    reference = hf_greedy(target, prompts, 16)
    drafter = make_drafter(target, min(1024, target.vocab_size))
    cfg = SpecConfig(ChainShape(4), max_new_tokens=16, eos_token_ids=())
    assert speculative_generate(target, drafter, prompts, cfg).sequences == reference


# ============================================================================ EAGLE-2 trees

TREES = [(4, 3, 10), (3, 4, 16), (5, 2, 5)]  # (depth, top_k, budget); the last has budget = depth


def tree_cfg(shape, min_confidence: float = 0.0, **kwargs) -> SpecConfig:
    depth, top_k, budget = shape
    return SpecConfig(TreeShape(depth, top_k, budget, min_confidence), eos_token_ids=(), **kwargs)


# -- (a) T = 0


@pytest.mark.parametrize(
    ("which", "batch", "shape"),
    [
        ("random", 20, TREES[0]),
        ("fitted", 1, TREES[0]),
        ("fitted", 7, TREES[1]),
        ("fitted", 20, TREES[0]),
        ("fitted", 20, TREES[2]),
    ],
)
def test_tree_greedy_equals_hf_generate(tiny_llama: Target, greedy_case, which, batch, shape):
    prompts, reference, fitted = greedy_case
    drafter = fitted if which == "fitted" else make_drafter(tiny_llama, 64, seed=1)
    cfg = tree_cfg(shape, max_new_tokens=MAX_NEW)
    got, accepted, sibling_hits = [], [], 0
    for i in range(0, len(prompts), batch):
        result = speculative_generate(tiny_llama, drafter, prompts[i : i + batch], cfg)
        got += result.sequences
        accepted += result.steps["accepted"]
        rec = result.records
        # an accepted node with a rejected sibling: the tree found what a chain would have missed
        rejected = {
            (s, t, o)
            for s, t, o, out in zip(
                rec["sequence"], rec["step"], rec["offset"], rec["outcome"], strict=True
            )
            if out == "rejected"
        }
        sibling_hits += sum(
            (s, t, o) in rejected
            for s, t, o, out in zip(
                rec["sequence"], rec["step"], rec["offset"], rec["outcome"], strict=True
            )
            if out == "accepted"
        )
        assert result.finish_reasons == ["length"] * len(result.sequences)
    assert got == reference
    if which == "fitted":  # equality must also have been tested on accepted drafts and siblings
        assert sum(accepted) > 150 and accepted.count(shape[0]) >= 5
        if shape[1] > 1:
            assert sibling_hits >= 3


def test_confidence_floor_stops_expanding_and_stays_lossless(tiny_llama: Target, greedy_case):
    prompts, reference, fitted = greedy_case
    # one prompt at a time: a batch expands while any of its rows is above the floor
    floor = tree_cfg((5, 3, 12), max_new_tokens=MAX_NEW, min_confidence=0.5)
    full = tree_cfg((5, 3, 12), max_new_tokens=MAX_NEW)
    got, forwards, accepted = [], [0, 0], 0
    for prompt in prompts:
        result = speculative_generate(tiny_llama, fitted, [prompt], floor)
        got += result.sequences
        accepted += sum(result.steps["accepted"])
        forwards[0] += result.stats["drafter_forwards"] / result.stats["verify_steps"]
        deep = speculative_generate(tiny_llama, fitted, [prompt], full)
        forwards[1] += deep.stats["drafter_forwards"] / deep.stats["verify_steps"]
    assert got == reference
    # fewer drafter forwards per step, yet drafts still accepted
    assert forwards[0] < forwards[1] and accepted > 100


def test_top1_tree_is_the_chain(tiny_llama: Target, greedy_case):
    """A tree of top-k 1 and budget = depth is a chain: same tokens, same acceptances per step."""
    prompts, _, fitted = greedy_case
    chain = speculative_generate(
        tiny_llama,
        fitted,
        prompts,
        SpecConfig(ChainShape(4), max_new_tokens=MAX_NEW, eos_token_ids=()),
    )
    tree = speculative_generate(
        tiny_llama, fitted, prompts, tree_cfg((4, 1, 4), max_new_tokens=MAX_NEW)
    )
    assert tree.sequences == chain.sequences
    for name in ("sequence", "step", "anchor", "drafted", "accepted", "emitted"):
        assert tree.steps[name] == chain.steps[name], name
    assert tree.records["token"] == chain.records["token"]
    assert tree.records["outcome"] == chain.records["outcome"]


def test_tree_stops_at_eos_like_hf(tiny_llama: Target, greedy_case):
    prompts, reference, fitted = greedy_case
    eos = int(torch.tensor(sum(reference, [])).bincount().argmax())
    expected = hf_greedy(tiny_llama, prompts, MAX_NEW, eos=eos)
    cfg = SpecConfig(TreeShape(4, 3, 10), max_new_tokens=MAX_NEW, eos_token_ids=(eos,))
    result = speculative_generate(tiny_llama, fitted, prompts, cfg)
    assert result.sequences == expected
    assert result.finish_reasons == ["eos" if eos in r else "length" for r in expected]
    steps = result.steps
    ended = sum(e == a for a, e in zip(steps["accepted"], steps["emitted"], strict=True))
    assert ended >= 1  # some block ended on an accepted EOS


# -- (b) T > 0


def sample_tree(target, drafter, shape, temperature: float, n: int, seed: int = 0):
    cfg = tree_cfg(shape, temperature=temperature, max_new_tokens=shape[0] + 2, seed=seed)
    return speculative_generate(target, drafter, [LAW_PROMPT] * n, cfg)


# depth 1: siblings and the bonus at x2, x3; depth 2: residuals after rejected siblings at x2
# and x3 (x1 is the prefill's sample)
@pytest.mark.parametrize(
    ("shape", "temperature"), [((1, 3, 3), 1.0), ((2, 2, 4), 1.0), ((2, 3, 6), 0.7)]
)
def test_tree_sampling_law_equals_target(law_case, shape, temperature: float):
    target, drafter = law_case
    result = sample_tree(target, drafter, shape, temperature, n=20_000)
    stat, critical, tv = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, temperature))
    assert stat < critical, (stat, critical, tv)
    outcomes = result.records["outcome"]
    assert outcomes.count("accepted") > 2000 and outcomes.count("rejected") > 2000
    # second-ranked siblings were accepted too, so the residual after a rejection was under test
    second = [
        o == "accepted"
        for o, node, parent in zip(
            outcomes, result.records["node"], result.records["parent"], strict=True
        )
        if parent == 0 and node == 2
    ]
    assert sum(second) > 500


def _accept_child_always(test, gen):
    return torch.ones_like(test, dtype=torch.bool)


def _keep_p(p, tokens, rejected):  # the law after rejected siblings: p itself (no residual)
    return p


def _accept_by_q(test, gen):  # Leviathan's test with q = 1/top_k: wrong for point masses
    return torch.rand(test.shape, generator=gen) < (test * 3).clamp(max=1)


@pytest.mark.parametrize(
    ("name", "broken"),
    [
        ("accept_children", _accept_child_always),
        ("residual_without", _keep_p),
        ("accept_children", _accept_by_q),
    ],
)
def test_tree_sampling_law_catches_a_broken_verifier(law_case, monkeypatch, name, broken):
    target, drafter = law_case
    monkeypatch.setattr(verify, name, broken)
    result = sample_tree(target, drafter, (2, 3, 6), 1.0, n=8_000)
    stat, critical, _ = chi_square(result.sequences, exact_joint(target, LAW_PROMPT, 1.0))
    assert stat > critical


# -- (c) records


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_records_steps_and_stats_add_up(
    tiny_llama: Target, greedy_case, monkeypatch, temperature
):
    prompts, _, fitted = greedy_case
    calls = _count_forwards(monkeypatch, tiny_llama)
    cfg = tree_cfg((4, 3, 10), temperature=temperature, max_new_tokens=MAX_NEW, seed=5)
    result = speculative_generate(tiny_llama, fitted, prompts, cfg)
    rec, steps, stats = result.records, result.steps, result.stats

    per_seq_steps = [steps["sequence"].count(i) for i in range(len(prompts))]
    assert calls[0] == stats["target_forwards"] == 1 + max(per_seq_steps)
    accepted = torch.tensor(steps["accepted"])
    assert stats["tau"] == pytest.approx(float((accepted + 1).float().mean()), abs=1e-6)
    assert stats["target_forwards_per_token"] == pytest.approx(1 / stats["tau"], rel=1e-6)
    assert sum(steps["accepted"]) > 30

    by_step: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(rec["sequence"], rec["step"], strict=True)):
        by_step.setdefault(key, []).append(i)
    anchors: dict[int, int] = {}
    for s, t, anchor, drafted, acc, emitted, depth in zip(
        *(steps[c] for c in spec.TREE_STEP_COLUMNS), strict=True
    ):
        seq = prompts[s] + result.sequences[s]
        assert emitted == acc + 1 and 0 <= acc <= depth <= 4
        assert anchor == anchors.get(s, len(prompts[s]) + 1)
        anchors[s] = anchor + emitted
        rows = by_step.get((s, t), [])
        assert len(rows) == drafted <= 10
        node = {rec["node"][i]: i for i in rows}
        path = [i for i in rows if rec["outcome"][i] == "accepted"]
        # the accepted nodes form one path from the root, one per depth, and spell the sequence
        assert [rec["offset"][i] for i in path] == list(range(1, acc + 1))
        for i in path:
            parent = rec["parent"][i]
            assert parent == 0 or rec["outcome"][node[parent]] == "accepted"
        reached = {0} | {rec["node"][i] for i in path}
        for i in rows:
            position = anchor + rec["offset"][i] - 1
            outcome = rec["outcome"][i]
            assert rec["offset"][i] <= depth
            if outcome == "accepted":
                assert rec["token"][i] == seq[position] == rec["target_token"][i]
            elif outcome == "rejected":  # a tried child of the root or of an accepted node
                assert rec["parent"][i] in reached
                assert rec["target_token"][i] == seq[position] != rec["token"][i]
            else:
                assert rec["target_token"][i] == -1
            if temperature == 0:
                assert rec["q"][i] == 1.0 and rec["accept_prob"][i] in (0.0, 1.0)
            else:
                assert 0 < rec["q"][i] <= rec["confidence"][i] + 1e-6
    for s, seq in enumerate(result.sequences):
        assert len(seq) == MAX_NEW and anchors[s] == len(prompts[s]) + MAX_NEW
    assert len(stats["alpha"]) == 4


# -- (e) bad input


def test_bad_tree_inputs_are_refused_before_any_work(tiny_llama: Target, monkeypatch):
    drafter = make_drafter(tiny_llama, 64)
    calls = _count_forwards(monkeypatch, tiny_llama)
    prompts = [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"budget \(3\) is smaller than its depth \(5\)"):
        speculative_generate(tiny_llama, drafter, prompts, SpecConfig(TreeShape(5, 2, 3)))
    with pytest.raises(ValueError, match="tree top_k must be an int >= 1, got 0"):
        speculative_generate(tiny_llama, drafter, prompts, SpecConfig(TreeShape(2, 0, 3)))
    with pytest.raises(ValueError, match="exceeds the 6 candidates"):
        speculative_generate(tiny_llama, drafter, prompts, SpecConfig(TreeShape(2, 2, 7)))
    with pytest.raises(ValueError, match="exceed the target's context of 512"):
        speculative_generate(
            tiny_llama,
            drafter,
            prompts,
            SpecConfig(TreeShape(2, 30, 600), max_new_tokens=8),
        )
    with pytest.raises(ValueError, match=r"min_confidence must lie in \[0, 1\), got 1.5"):
        speculative_generate(tiny_llama, drafter, prompts, SpecConfig(TreeShape(2, 2, 4, 1.5)))
    with pytest.raises(ValueError, match=r"top_k \(80\) exceeds the draft vocab \(64\)"):
        speculative_generate(tiny_llama, drafter, prompts, SpecConfig(TreeShape(1, 80, 80)))
    assert calls[0] == 0


@pytest.mark.skipif(
    not (EMBEDDED / "model.safetensors").is_file(), reason="embedded target not trained yet"
)
def test_tree_greedy_equals_hf_generate_on_embedded_target():
    target = load_target(EMBEDDED, aux_layer_ids=(1, 3, 5))
    prompts = random_prompts(8, target.vocab_size, seed=7, lengths=(14, 19))
    reference = hf_greedy(target, prompts, 16)
    drafter = make_drafter(target, min(1024, target.vocab_size))
    cfg = SpecConfig(TreeShape(5, 10, 60), max_new_tokens=16, eos_token_ids=())
    assert speculative_generate(target, drafter, prompts, cfg).sequences == reference
