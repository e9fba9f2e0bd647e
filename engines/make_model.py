"""Make the tiny model the real-engine tier serves: no hub is reachable, so it is built here.

    .engines/venv/bin/python engines/make_model.py DIR [--layers 2] [--seed 0]

- A byte-level BPE tokenizer (vocabulary 8,000) trained on this Python's own standard
  library sources, files in sorted order, so the same interpreter gives the same tokens.
- A simple Jinja chat template: the request's tools as JSON, if any, then every message
  as ``<|role|>\\ncontent<|end|>\\n`` (an assistant's tool calls as JSON), then
  ``<|assistant|>\\n`` when a generation is asked for.
- A ``LlamaConfig`` (hidden 128, 4 heads, 2 KV heads, 65,536 positions) with random
  weights drawn from ``--seed``, saved in bfloat16, answering 16 tokens by default: a few
  MB that vLLM loads from ``DIR``.
  Its answers are noise; what the tests and benchmarks read is the engine: its prefix
  cache, ``cached_tokens``, metrics and timing. ``--layers`` grows the KV cache a token
  takes (2 layers: 512 bytes), one way to make a cache small enough to evict.
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path

VOCAB = 8000
SPECIAL = ["<|begin|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{{ m['content'] | map(attribute='text') | join('') }}{% endif %}"
    "{% if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TRAINING_BYTES = 8_000_000  # enough for a stable 8,000-token vocabulary, in seconds


def corpus() -> Iterator[str]:
    """The standard library's sources, in sorted order, up to TRAINING_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= TRAINING_BYTES:
            return


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        model_max_length=65536,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_weights(out: Path, layers: int, seed: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # vLLM's default max_tokens is the rest of the context: random weights seldom say
    # <|end|>, so a request without max_tokens would decode for minutes. 16, as the
    # simulated pods' default (docs/engines.md, sim versus real).
    model.generation_config.max_new_tokens = 16
    model.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(args.out)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.out))
    make_weights(args.out, args.layers, args.seed, vocab)
    print(f"model in {args.out}: {args.layers} layers, vocabulary {vocab}")


if __name__ == "__main__":
    main()
