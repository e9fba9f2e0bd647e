"""A model directory as a deployment mounts it, for precise routing's tests without
the real-engine environment: a small BPE tokenizer trained here (seconds) with the
tiny engine model's special tokens and chat template (engines/make_model.py), written
as tokenizer.json, tokenizer_config.json and chat_template.jinja."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def make_model() -> ModuleType:
    """engines/make_model.py, for its special tokens, template and corpus (a script)."""
    spec = importlib.util.spec_from_file_location("make_model", ROOT / "engines" / "make_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_model_files(out: Path, vocab: int = 2000, corpus_bytes: int = 1_000_000) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    mm = make_model()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=mm.SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        total = 0
        for text in mm.corpus():
            yield text
            total += len(text)
            if total >= corpus_bytes:
                return

    tok.train_from_iterator(texts(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<|begin|>", "eos_token": "<|end|>", "pad_token": "<|pad|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(mm.CHAT_TEMPLATE)
    return out
