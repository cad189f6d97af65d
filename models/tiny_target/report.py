"""Quality report of the embedded target: `python -m models.tiny_target.report [DIR]`.

Writes `DIR/quality.json` and `DIR/README.md`: loss per token on the validation and held-out
splits for the model and for a unigram baseline on the same tokenizer, their ratio, and greedy and
T=1 samples from held-out functions. The splits are re-derived from the corpus and checked against
the hashes in `opd_target.json`, so the numbers are about exactly the modules the model never saw.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import click
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from models.tiny_target import corpus
from models.tiny_target.train import DEFAULT_OUT, METADATA_FILE, tokenize_documents

EVAL_SPLITS = ("validation", "heldout")
SAMPLE_NEW_TOKENS = 64


def load_corpus_checked(metadata: dict) -> list[corpus.SourceFile]:
    """The corpus file list, refusing to report on a corpus other than the one trained on."""
    root = metadata["corpus"]["root"]
    files = corpus.list_sources(None if root == "stdlib (sysconfig)" else Path(root))
    now = corpus.manifest(files)
    for split, recorded in metadata["corpus"]["splits"].items():
        if now[split]["content_sha256"] != recorded["content_sha256"]:
            raise ValueError(
                f"the {split} split on this machine differs from the one the model was trained on "
                f"(content sha256 {now[split]['content_sha256'][:12]} vs "
                f"{recorded['content_sha256'][:12]}); run the report with the Python version in "
                f"{METADATA_FILE} ({metadata['python_version']})"
            )
    return files


def document_windows(ids: np.ndarray, bos_id: int, window: int) -> list[np.ndarray]:
    """Split a flat BOS...EOS id array into per-document windows of at most `window + 1` ids.

    Windows overlap by one id so every token after a document's BOS is predicted exactly once.
    """
    starts = np.flatnonzero(ids == bos_id).tolist() + [len(ids)]
    out = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        for s in range(a, b - 1, window):
            out.append(ids[s : min(s + window + 1, b)])
    return out


@torch.no_grad()
def model_loss(model, windows: list[np.ndarray]) -> tuple[float, int]:
    """(total nats, predicted tokens) over the windows, computed in fp32."""
    total, count = 0.0, 0
    for w in windows:
        x = torch.from_numpy(w.astype(np.int64))[None]  # [1, T+1]
        logits = model(input_ids=x[:, :-1]).logits.float()  # [1, T, V]
        total += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    return total, count


def unigram_log_probs(train_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Add-one smoothed unigram over the train split's token counts."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=vocab_size) + 1.0
    return np.log(counts / counts.sum())


def unigram_loss(log_probs: np.ndarray, windows: list[np.ndarray]) -> tuple[float, int]:
    targets = np.concatenate([w[1:] for w in windows]).astype(np.int64)
    return float(-log_probs[targets].sum()), len(targets)


def function_prompts(texts: list[str], n: int) -> list[str]:
    """Up to `n` prompts 'def header + docstring' from the first documented function per text."""
    prompts = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node):
                doc = node.body[0]
                # No trailing newline: the corpus tokenizes "\n" + indentation as one token, so
                # a prompt ending in a lone "\n" would announce a dedented line.
                prompts.append("".join(lines[node.lineno - 1 : doc.end_lineno]).rstrip("\n"))
                break
        if len(prompts) == n:
            break
    return prompts


@torch.no_grad()
def samples(model, tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[dict]:
    out = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt")
        greedy = model.generate(**ids, do_sample=False, max_new_tokens=SAMPLE_NEW_TOKENS)
        torch.manual_seed(i)
        sampled = model.generate(
            **ids,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=SAMPLE_NEW_TOKENS,
        )
        n = ids["input_ids"].shape[1]
        out.append(
            {
                "prompt": prompt,
                "greedy": tokenizer.decode(greedy[0, n:], skip_special_tokens=True),
                "t1_seed": i,
                "t1": tokenizer.decode(sampled[0, n:], skip_special_tokens=True),
            }
        )
    return out


def build_report(model_dir: Path, n_samples: int = 4) -> dict:
    model_dir = Path(model_dir)
    meta_path = model_dir / METADATA_FILE
    if not meta_path.exists():
        raise FileNotFoundError(
            f"{meta_path} is missing; {model_dir} is not a target written by "
            "`python -m models.tiny_target.train`"
        )
    metadata = json.loads(meta_path.read_text())
    torch.set_num_threads(metadata["train_config"]["threads"])
    files = load_corpus_checked(metadata)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    window = metadata["train_config"]["seq_len"]

    texts = {s: [t for _, t in corpus.load_split(files, s)] for s in ("train", *EVAL_SPLITS)}
    log_probs = unigram_log_probs(tokenize_documents(tokenizer, texts["train"]), len(tokenizer))
    report = {"model_dir": model_dir.name, "window": window, "splits": {}}
    for split in EVAL_SPLITS:
        windows = document_windows(
            tokenize_documents(tokenizer, texts[split]), tokenizer.bos_token_id, window
        )
        m_nats, n = model_loss(model, windows)
        u_nats, n_u = unigram_loss(log_probs, windows)
        assert n == n_u, "model and unigram must score the same tokens"
        report["splits"][split] = {
            "modules": len(texts[split]),
            "tokens": n,
            "model_loss": round(m_nats / n, 4),
            "unigram_loss": round(u_nats / n, 4),
            "ratio": round(m_nats / u_nats, 4),
            "model_perplexity": round(math.exp(m_nats / n), 2),
        }
    report["samples"] = samples(model, tokenizer, function_prompts(texts["heldout"], n_samples))
    report["command"] = "python -m models.tiny_target.report"
    return report


def readme_line(report: dict) -> str:
    h, v = report["splits"]["heldout"], report["splits"]["validation"]
    return (
        f"Held-out loss {h['model_loss']:.3f} nats/token vs unigram {h['unigram_loss']:.3f} "
        f"(ratio {h['ratio']:.3f}); validation {v['model_loss']:.3f} vs {v['unigram_loss']:.3f} "
        f"(ratio {v['ratio']:.3f})."
    )


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path), default=DEFAULT_OUT)
def main(model_dir: Path) -> None:
    """Write MODEL_DIR/quality.json and MODEL_DIR/README.md."""
    report = build_report(model_dir)
    (model_dir / "quality.json").write_text(json.dumps(report, indent=1) + "\n")
    meta = json.loads((model_dir / METADATA_FILE).read_text())
    cfg, training = meta["train_config"], meta["training"]
    (model_dir / "README.md").write_text(
        "# opd-pipeline embedded target\n\n"
        f"A {cfg['num_layers']}-layer, hidden-{cfg['hidden_size']} `LlamaForCausalLM` with a "
        f"{cfg['vocab_size']}-token byte-level BPE, trained from scratch on the Python "
        f"{meta['python_version']} standard library (tests excluded) by "
        f"`{meta['command']}` in {training['train_seconds'] / 60:.1f} min on CPU "
        f"({training['tokens']:,} tokens). It models Python source only; its chat template "
        "exists so chat-format sources run end to end, the model was never trained on chat.\n\n"
        f"Quality (`python -m models.tiny_target.report`, see quality.json): {readme_line(report)}\n"
    )
    click.echo(readme_line(report))


if __name__ == "__main__":
    main()
