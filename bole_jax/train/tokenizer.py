"""Train the demo model's byte-level BPE tokenizer with `tokenizers` (offline corpus only).

    python -m bole_jax.train.tokenizer --out DIR [--vocab-size 8192] [--corpus PATH ...]

Writes DIR/tokenizer.json and DIR/tokenizer_config.json (with a ChatML chat template).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bole_jax.train.corpus import corpus_files, iter_documents

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(files: list[Path], vocab_size: int, out: Path, max_bytes: int = 200_000_000):
    return train_tokenizer_from_docs(iter_documents(files, max_bytes=max_bytes), vocab_size, out)


def write_tokenizer_config(out: Path) -> None:
    """tokenizer_config.json with the ChatML chat template (the shipped demo model's)."""
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            dict(
                eos_token="<|endoftext|>",
                bos_token=None,
                pad_token="<|endoftext|>",
                chat_template=CHAT_TEMPLATE,
                model_max_length=4096,
            ),
            indent=1,
        )
    )


def train_tokenizer_from_docs(docs, vocab_size: int, out: Path, show_progress: bool = True):
    """Byte-level BPE over the texts `docs` (any iterable of str); writes out/tokenizer.json and
    out/tokenizer_config.json and returns the `tokenizers.Tokenizer`. Deterministic for the same
    documents in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out)
    return tok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument(
        "--corpus",
        nargs="*",
        type=Path,
        default=None,
        help="files or folders (default: the Python standard library sources)",
    )
    ap.add_argument("--max-bytes", type=int, default=200_000_000)
    a = ap.parse_args(argv)
    files = corpus_files(a.corpus)
    tok = train_tokenizer(files, a.vocab_size, a.out, a.max_bytes)
    print(f"trained tokenizer: vocab {tok.get_vocab_size()} from {len(files)} files -> {a.out}")


if __name__ == "__main__":
    main()
