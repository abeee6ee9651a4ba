"""Tokenizers shared by both tiers: tier 1 encodes, tier 2 checks and decodes.

- `bytes`: ids 0-255 are UTF-8 bytes and 256 ends a document; no files.
- a Hugging Face `tokenizers` `tokenizer.json` (path), copied into the dataset.
- `train:VOCAB`: a byte-level BPE trained on a sample of the corpus by the
  pipeline, saved with the dataset (see `train_bpe`).

A tokenizer's identity is (kind, vocab size, hash of its definition); equal
hashes mean equal token ids.
"""

from __future__ import annotations

import hashlib

import numpy as np

from strata.dataset import TokenizerInfo

TOKENIZER_FILE = "tokenizer.json"
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class ByteTokenizer:
    kind = "bytes"
    eot_id = 256
    vocab_size = 257

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """UTF-8 bytes as ids, each (n,) uint32, without the end-of-text id."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def info(self) -> TokenizerInfo:
        definition = f"{self.kind}:utf-8:eot={self.eot_id}:vocab={self.vocab_size}"
        return TokenizerInfo(kind=self.kind, vocab_size=self.vocab_size, eot_id=self.eot_id,
                             hash=hashlib.sha256(definition.encode()).hexdigest()[:16])


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer from its tokenizer.json text."""

    kind = "hf"

    def __init__(self, definition: str, eot_token: str = ""):
        from tokenizers import Tokenizer

        self.definition = definition
        self.tok = Tokenizer.from_str(definition)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = [eot_token] if eot_token else list(EOT_CANDIDATES)
        ids = [self.tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids, strict=True) if i is not None]
        if not found:
            raise ValueError(f"tokenizer has no end-of-text token among {names}; name one with --eot-token")
        self.eot_token, self.eot_id = found[0]

    @classmethod
    def from_file(cls, path: str, eot_token: str = "") -> HFTokenizer:
        from strata.storage import filesystem

        fs, p = filesystem(path)
        try:
            with fs.open_input_stream(p) as f:
                return cls(f.read().decode(), eot_token)
        except FileNotFoundError as e:
            raise ValueError(f"tokenizer file {path!r} does not exist") from e

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # The fast variant skips character offsets, which nothing here reads: the same ids for ~60% of the CPU.
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(kind=self.kind, vocab_size=self.vocab_size, eot_id=self.eot_id,
                             hash=hashlib.sha256(self.definition.encode()).hexdigest()[:16], file=TOKENIZER_FILE)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str, eot_token: str = "") -> Tokenizer:
    """A tokenizer from its command-line spec: `bytes`, or a path to a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("train:"):
        raise ValueError("train:VOCAB tokenizers exist only after the pipeline trains them")
    if spec.endswith(".json"):
        return HFTokenizer.from_file(spec, eot_token)
    raise ValueError(f"unknown tokenizer {spec!r}: use bytes, a tokenizer.json path, or train:VOCAB")


def check_spec(spec: str) -> None:
    """Validate a tokenizer spec early, with a clear error."""
    if spec.startswith("train:"):
        vocab = spec.partition(":")[2]
        if not vocab.isdigit() or not 260 <= int(vocab) <= 1 << 20:
            raise ValueError(f"bad tokenizer spec {spec!r}: use train:VOCAB with 260 <= VOCAB <= 1048576")
    elif spec != "bytes" and not spec.endswith(".json"):
        raise ValueError(f"unknown tokenizer {spec!r}: use bytes, a tokenizer.json path, or train:VOCAB")


def train_bpe(texts, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE trained on `texts` (an iterator of strings), with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str(), "<|endoftext|>")


def from_info(info: TokenizerInfo, definition: str | None = None) -> Tokenizer:
    """The tokenizer a dataset was written with, from its manifest entry (and file, for `hf`)."""
    if info.kind == "bytes":
        tok = ByteTokenizer()
    elif info.kind == "hf" and definition is not None:
        tok = HFTokenizer(definition)
        tok.eot_id = info.eot_id
    else:
        raise ValueError(f"tokenizer kind {info.kind!r} needs its {TOKENIZER_FILE}")
    if tok.info().hash != info.hash:
        raise ValueError(f"tokenizer {info.kind} in the manifest ({info.hash}) differs from this one ({tok.info().hash})")
    return tok
