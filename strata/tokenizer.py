"""Tokenizers shared by both tiers: tier 1 encodes, tier 2 checks and decodes.

Only the byte-level tokenizer exists so far: ids 0-255 are UTF-8 bytes and 256
ends a document. It needs no files, so its identity is its definition.
"""

from __future__ import annotations

import hashlib

import numpy as np

from strata.dataset import TokenizerInfo


class ByteTokenizer:
    kind = "bytes"
    eot_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes as ids, shape (n,), dtype uint16 (no end-of-text id)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def info(self) -> TokenizerInfo:
        definition = f"{self.kind}:utf-8:eot={self.eot_id}:vocab={self.vocab_size}"
        return TokenizerInfo(kind=self.kind, vocab_size=self.vocab_size, eot_id=self.eot_id,
                             hash=hashlib.sha256(definition.encode()).hexdigest()[:16])


def load_tokenizer(spec: str) -> ByteTokenizer:
    """A tokenizer from its command-line spec (`bytes`)."""
    if spec == "bytes":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {spec!r}: supported: bytes")


def from_info(info: TokenizerInfo) -> ByteTokenizer:
    """The tokenizer a dataset was written with, from its manifest entry."""
    tok = load_tokenizer(info.kind)
    if tok.info() != info:
        raise ValueError(f"tokenizer {info.kind} in the manifest ({info.hash}) differs from this code's ({tok.info().hash})")
    return tok
