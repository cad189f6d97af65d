"""Train the embedded default target: `python -m models.tiny_target.train`.

Corpus -> byte-level BPE -> a Llama causal LM, on CPU in bf16 autocast, with a fixed step count
(so the cosine schedule ends where the run ends and a re-run is reproducible), periodic
checkpoints and resume. The result is a plain HF directory that `AutoModelForCausalLM` and
`AutoTokenizer` load offline, plus `opd_target.json` (corpus split, hashes, hyperparameters,
training record).

Data: each split is tokenized once into a flat uint16 array (files as BOS ... EOS documents),
cached under the work dir; a training step reads random windows from it, chosen by a generator
seeded with (seed, step) so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import click
import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from models.tiny_target import corpus
from models.tiny_target.tokenizer import train_bpe

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "models" / "tiny_target" / "model"
DEFAULT_WORK = REPO_ROOT / ".cache" / "tiny_target"
METADATA_FILE = "opd_target.json"


class TrainConfig(BaseModel):
    """Everything that changes the trained target. The committed model used the defaults.

    Strict like `pipeline.core.config.StrictConfig` (models/ may not import pipeline/): a mistyped
    key is an error, never a silent default.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    corpus_root: str | None = None  # None: the running interpreter's stdlib
    vocab_size: int = Field(4096, ge=259)
    hidden_size: int = Field(256, ge=8)
    intermediate_size: int = Field(768, ge=8)
    num_layers: int = Field(6, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    max_position_embeddings: int = Field(2048, ge=16)
    seq_len: int = Field(512, ge=8)
    batch_size: int = Field(8, ge=1)
    steps: int = Field(1400, ge=1)
    lr: float = Field(2e-3, gt=0)
    min_lr_ratio: float = Field(0.05, ge=0, le=1)
    warmup_steps: int = Field(60, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    bf16: bool = True
    # Inductor fuses the many small element-wise ops of a d=256 model and the loss: 1.49x the
    # eager step rate (lab/benchmarks/bench_target_train.py), which is what fits the run into 30 min
    # on 2 cores. Needs a C++ compiler.
    compile: bool = True
    seed: int = 0
    threads: int = Field(2, ge=1)
    checkpoint_every: int = Field(100, ge=1)
    eval_every: int = Field(200, ge=1)
    eval_windows: int = Field(16, ge=1)

    def llama_config(self, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must divide by num_heads={self.num_heads}, "
                f"which must divide by num_kv_heads={self.num_kv_heads}"
            )
        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


def has_cxx_compiler() -> bool:
    """Whether torch inductor (compile=True) finds a C++ compiler: $CXX, g++ or c++."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++"))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine down to `min_lr_ratio * lr` exactly at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def tokenize_documents(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> np.ndarray:
    """Concatenate texts as BOS ... EOS documents into one flat uint16 id array."""
    if len(tokenizer) > np.iinfo(np.uint16).max:
        raise ValueError(f"vocab of {len(tokenizer)} does not fit uint16 token arrays")
    encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    parts = []
    for enc in encoded:
        parts += [[tokenizer.bos_token_id], enc.ids, [tokenizer.eos_token_id]]
    return np.fromiter((i for p in parts for i in p), dtype=np.uint16)


def prepare_data(
    cfg: TrainConfig, work_dir: Path
) -> tuple[PreTrainedTokenizerBase, dict[str, np.ndarray], dict]:
    """Tokenizer (trained on the train split) and the token arrays of every split, cached.

    The cache key is the corpus content hash plus the vocab size, so a changed corpus or tokenizer
    setting never reuses stale arrays.
    """
    files = corpus.list_sources(None if cfg.corpus_root is None else Path(cfg.corpus_root))
    manifest = corpus.manifest(files)
    key = hashlib.sha256(
        json.dumps(
            {s: manifest[s]["content_sha256"] for s in corpus.SPLITS} | {"vocab": cfg.vocab_size}
        ).encode()
    ).hexdigest()[:16]
    cache = work_dir / f"data-{key}"
    tok_dir = cache / "tokenizer"
    if not (cache / "done").exists():
        cache.mkdir(parents=True, exist_ok=True)
        texts = {s: [t for _, t in corpus.load_split(files, s)] for s in corpus.SPLITS}
        if not texts["train"]:
            raise ValueError("the train split is empty; the corpus root has too few modules")
        tokenizer = train_bpe(texts["train"], cfg.vocab_size)
        tokenizer.save_pretrained(tok_dir)
        for split, split_texts in texts.items():
            np.save(cache / f"{split}.npy", tokenize_documents(tokenizer, split_texts))
        (cache / "done").write_text("")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    arrays = {s: np.load(cache / f"{s}.npy") for s in corpus.SPLITS}
    return tokenizer, arrays, manifest


def sample_batch(ids: np.ndarray, batch: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """`batch` random windows of `seq_len + 1` tokens; a pure function of (seed, step)."""
    if len(ids) <= seq_len + 1:
        raise ValueError(f"split has {len(ids)} tokens, fewer than seq_len+1={seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
    windows = np.stack([ids[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows)  # [B, T+1]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32 (bf16 log-softmax over the vocab loses too much precision)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # [B*T, V] vs [B*T]


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def step_loss(model: torch.nn.Module, windows: torch.Tensor, bf16: bool) -> torch.Tensor:
    with _autocast(bf16):
        logits = model(input_ids=windows[:, :-1]).logits  # [B, T, V]
    return next_token_loss(logits, windows[:, 1:])


def train_step(model, loss_fn, optimizer, windows: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """One optimizer step on `windows` [B, T+1] (forward, loss, backward, clip, AdamW)."""
    loss = loss_fn(model, windows, cfg.bf16)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module, ids: np.ndarray, cfg: TrainConfig, loss_fn=step_loss
) -> float:
    """Loss on a fixed set of validation windows (cheap progress signal, not the report)."""
    model.eval()
    windows = sample_batch(ids, cfg.eval_windows, cfg.seq_len, cfg.seed + 1, 0)
    loss = sum(
        loss_fn(model, windows[i : i + cfg.batch_size], cfg.bf16).item()
        * len(windows[i : i + cfg.batch_size])
        for i in range(0, len(windows), cfg.batch_size)
    ) / len(windows)
    model.train()
    return loss


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # Norm gains and embeddings are not decayed: decay on them only fights the loss.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def save_checkpoint(path: Path, model, optimizer, step: int, cfg: TrainConfig, history) -> None:
    """Atomic: written under a temporary name, then renamed."""
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "config": cfg.model_dump_json(),
            "history": json.dumps(history),
        },
        tmp,
    )
    os.replace(tmp, path)


def train(
    cfg: TrainConfig,
    out_dir: Path = DEFAULT_OUT,
    work_dir: Path = DEFAULT_WORK,
    stop_after: int | None = None,
    command: str | None = None,
) -> dict:
    """Train (resuming from `work_dir`'s checkpoint if one matches `cfg`) and export to `out_dir`.

    `stop_after` ends the process-local loop early after that step without exporting (a crash
    stand-in for tests); the checkpoint then holds exactly that step. Returns the training record.
    """
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    if cfg.compile and not has_cxx_compiler():
        raise ValueError(
            "compile=true needs a C++ compiler for torch inductor and none is on PATH; install "
            "one (e.g. `apt install g++`) or pass --config-json '{\"compile\": false}' "
            "(about 1.3x slower)"
        )
    torch.set_num_threads(cfg.threads)
    tokenizer, arrays, manifest = prepare_data(cfg, work_dir)

    ckpt_dir = work_dir / "runs" / hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = ckpt_dir / "last.pt"

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(cfg.llama_config(tokenizer))
    optimizer = make_optimizer(model, cfg)
    start, history = 0, {"eval": [], "train_loss": [], "seconds": 0.0}
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=True)
        if state["config"] != cfg.model_dump_json():
            raise ValueError(
                f"checkpoint {ckpt_path} was made with a different config; delete it to start over"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], json.loads(state["history"])

    # Compiling the loss with the forward lets inductor fuse the fp32 log-softmax over
    # [B, T, V] logits too (1.14x over compiling the forward alone). Same-shape batches
    # throughout (eval included), so each mode's graph is built once.
    loss_fn = torch.compile(step_loss) if cfg.compile else step_loss
    model.train()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="target", ncols=100)
    t0, seconds0 = time.perf_counter(), history["seconds"]
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        windows = sample_batch(arrays["train"], cfg.batch_size, cfg.seq_len, cfg.seed, step)
        loss = train_step(model, loss_fn, optimizer, windows, cfg)

        done = step + 1
        history["train_loss"].append(round(loss.item(), 5))
        history["seconds"] = seconds0 + time.perf_counter() - t0
        tokens_s = (done - start) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_s:.0f}")
        if done % cfg.eval_every == 0 or done == cfg.steps:
            val = eval_loss(model, arrays["validation"], cfg, loss_fn)
            history["eval"].append({"step": done, "val_loss": round(val, 5)})
            bar.write(f"step {done}: val loss {val:.4f}")
        if done % cfg.checkpoint_every == 0 or done == cfg.steps or done == stop_after:
            save_checkpoint(ckpt_path, model, optimizer, done, cfg, history)
        if done == stop_after:
            bar.close()
            return history
    bar.close()

    record = {
        "steps": cfg.steps,
        "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_seconds": round(history["seconds"], 1),
        "final_val_loss_windows": history["eval"][-1]["val_loss"] if history["eval"] else None,
        "eval": history["eval"],
        "train_loss_every_50": history["train_loss"][::50],
    }
    export(model, tokenizer, cfg, manifest, arrays, record, out_dir, command)
    return record


def export(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    cfg: TrainConfig,
    manifest: dict,
    arrays: dict[str, np.ndarray],
    record: dict,
    out_dir: Path,
    command: str | None,
) -> None:
    """Write the HF directory: bf16 safetensors weights, tokenizer, generation config, metadata."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=256,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    metadata = {
        "what": "the opd-pipeline embedded default target: a Llama causal LM of Python source code",
        "python_version": sys.version.split()[0],
        "corpus": {
            "root": "stdlib (sysconfig)" if cfg.corpus_root is None else cfg.corpus_root,
            "excluded_dirs": sorted(corpus.EXCLUDED_DIRS),
            "excluded_generated": "files whose header names gencodec.py",
            "split_rule": "sha256(module name) per mille: <50 validation, <100 heldout, else train",
            "tokens": {s: int(len(a)) for s, a in arrays.items()},
            "splits": manifest,
        },
        "train_config": cfg.model_dump(),
        "training": record,
        "torch_version": torch.__version__,
        "command": command,
        # checked by the target loader: a damaged weights file is an error, not another target
        "weights_sha256": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out_dir.glob("*.safetensors"))
        },
    }
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")


@click.command()
@click.option("--out-dir", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path),
    default=DEFAULT_WORK,
    show_default=True,
    help="token cache and checkpoints (git-ignored)",
)
@click.option("--config-json", default="{}", help="overrides of TrainConfig fields, as JSON")
@click.option("--stop-after", type=int, default=None, help="stop after this step (no export)")
def main(out_dir: Path, work_dir: Path, config_json: str, stop_after: int | None) -> None:
    """Train the embedded target; re-running the same command resumes from its checkpoint."""
    cfg = TrainConfig(**json.loads(config_json))
    command = ("python -m models.tiny_target.train " + shlex.join(sys.argv[1:])).strip()
    train(cfg, out_dir, work_dir, stop_after=stop_after, command=command)


if __name__ == "__main__":
    main()
