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
import json
from itertools import pairwise

import numpy as np

from strata.data.dataset import TokenizerInfo

TOKENIZER_FILE = "tokenizer.json"
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class ByteTokenizer:
    kind = engine = "bytes"
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

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0], dtype=np.int64)

    def hf_definition(self) -> str:
        """This tokenizer as a Hugging Face tokenizer.json (transformers' AutoTokenizer loads it): each UTF-8
        byte its own id (GPT-2's byte-to-character map, a BPE with no merges), end-of-text 256."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from tokenizers.pre_tokenizers import ByteLevel

        alphabet = ByteLevel.alphabet()  # the 256 characters GPT-2's byte-level map gives bytes 0-255
        by_byte = {b: c for c, b in _byte_decoder().items()}
        assert set(by_byte.values()) == set(alphabet)
        tok = Tokenizer(models.BPE(vocab={by_byte[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<|endoftext|>"])
        assert tok.token_to_id("<|endoftext|>") == self.eot_id
        return tok.to_str()

    def info(self) -> TokenizerInfo:
        definition = f"{self.kind}:utf-8:eot={self.eot_id}:vocab={self.vocab_size}"
        return TokenizerInfo(kind=self.kind, vocab_size=self.vocab_size, eot_id=self.eot_id,
                             hash=hashlib.sha256(definition.encode()).hexdigest()[:16])


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer from its tokenizer.json text.

    `engine="auto"` encodes a byte-level BPE (GPT-2's layout, or a Split regex then ByteLevel) with
    tiktoken's BPE core, about 4x faster on one CPU, when the definition allows it and every vocabulary
    entry encodes to itself under both (see `byte_level_bpe`). Every CHECK_EVERY-th document of a batch is
    encoded by both, and a difference is an error: equal tokenizer hashes mean equal ids, whichever engine
    wrote them. A text containing an added token's content goes to Hugging Face's. `engine="hf"` always
    uses Hugging Face's.
    """

    kind = "hf"
    CHECK_EVERY = 64

    def __init__(self, definition: str, eot_token: str = "", engine: str = "auto"):
        import os

        from tokenizers import Tokenizer

        if engine not in ENGINES:
            raise ValueError(f"tokenizer engine {engine!r}: use one of {', '.join(ENGINES)}")
        # One thread: Ray gives a worker one CPU, and a thread pool beside the other workers' spins and
        # contends (+25% CPU measured on 2 cores).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.definition = definition
        self.tok = Tokenizer.from_str(definition)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = [eot_token] if eot_token else list(EOT_CANDIDATES)
        ids = [self.tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids, strict=True) if i is not None]
        if not found:
            raise ValueError(f"tokenizer has no end-of-text token among {names}; name one with --eot-token")
        self.eot_token, self.eot_id = found[0]
        self.added = [t["content"] for t in json.loads(definition).get("added_tokens") or []]
        self.fast, self.engine = None, "hf"
        if engine == "auto":
            self.fast, self.why_not_fast = byte_level_bpe(definition, self.tok)
            self.engine = "tiktoken" if self.fast else "hf"
        self.checked = 0  # documents encoded by both engines

    @classmethod
    def from_file(cls, path: str, eot_token: str = "", engine: str = "auto") -> HFTokenizer:
        from strata.data.storage import filesystem

        fs, p = filesystem(path)
        try:
            with fs.open_input_stream(p) as f:
                return cls(f.read().decode(), eot_token, engine)
        except FileNotFoundError as e:
            raise ValueError(f"tokenizer file {path!r} does not exist") from e

    def _hf(self, texts: list[str]) -> list[list[int]]:
        # The fast variant skips character offsets, which nothing here reads: the same ids for ~60% of the CPU.
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self.fast is None:
            return [np.asarray(ids, dtype=np.uint32) for ids in self._hf(texts)]
        slow = [i for i, t in enumerate(texts) if any(a in t for a in self.added)]
        out = [self.fast.encode_ordinary(t) for t in texts]
        for i, ids in zip(slow, self._hf([texts[i] for i in slow]), strict=True):
            out[i] = ids
        sample = range(0, len(texts), self.CHECK_EVERY)
        for i, ids in zip(sample, self._hf([texts[i] for i in sample]), strict=True):
            if out[i] != ids:
                raise TokenizerMismatch(f"tiktoken's BPE and Hugging Face's encode a document differently "
                                        f"({len(out[i])} vs {len(ids)} ids, from {texts[i][:60]!r}); "
                                        f"rerun with --tokenizer-engine hf")
        self.checked += len(sample)
        return [np.asarray(ids, dtype=np.uint32) for ids in out]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes of text each id stands for; 0 for added (special) tokens such as end-of-text.
        A ByteLevel entry's characters each stand for one byte; other entries are decoded alone."""
        special = set(self.tok.get_added_tokens_decoder())
        stand_in = _byte_decoder()
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i)
            if i in special or piece is None:
                continue
            out[i] = len(piece) if all(c in stand_in for c in piece) else len(self.decode([i]).encode())
        return out

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(kind=self.kind, vocab_size=self.vocab_size, eot_id=self.eot_id,
                             hash=hashlib.sha256(self.definition.encode()).hexdigest()[:16], file=TOKENIZER_FILE)


Tokenizer = ByteTokenizer | HFTokenizer
ENGINES = ("auto", "hf")


class TokenizerMismatch(RuntimeError):
    """The fast engine and Hugging Face's gave different ids for one text."""


def _byte_decoder() -> dict[str, int]:
    """ByteLevel's printable stand-in for each byte (GPT-2's `bytes_to_unicode`), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_level_bpe(definition: str, tok=None):
    """(a tiktoken Encoding equal to this tokenizer.json on plain text, None) or (None, why not).

    Only a layout whose every step tiktoken does the same way: no normalizer; ByteLevel splitting with
    GPT-2's regex, or a Split(regex, isolated) before a ByteLevel that does not split; a BPE without
    dropout, prefixes, suffixes or byte fallback. tiktoken merges by the rank of the merged token (here
    its id), and takes a word that is a vocabulary entry whole; Hugging Face's BPE applies merges in
    order. So both are checked here: ids rise in the order of the merges, and every vocabulary entry
    encodes to itself.
    """
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    d = json.loads(definition)
    model, pre = d.get("model") or {}, d.get("pre_tokenizer") or {}
    if d.get("normalizer"):
        return None, "it has a normalizer"
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "its model is not a plain BPE"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if [s.get("type") for s in steps] == ["ByteLevel"] and steps[0].get("use_regex", True):
        pattern = GPT2_SPLIT
    elif [s.get("type") for s in steps] == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert") \
            and "Regex" in (steps[0].get("pattern") or {}):
        pattern = steps[0]["pattern"]["Regex"]
    else:
        return None, "its pre-tokenizer is not ByteLevel splitting"
    if any(s.get("add_prefix_space") for s in steps):
        return None, "it adds a prefix space"
    decoder, added = _byte_decoder(), {t["id"] for t in d.get("added_tokens") or []}
    if tok is None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(definition)
    ranks = {}
    for piece, i in model.get("vocab", {}).items():
        if i in added:
            continue
        if any(c not in decoder for c in piece):
            return None, f"vocabulary entry {piece!r} is not byte-level"
        if [t.id for t in tok.model.tokenize(piece)] != [i]:
            return None, f"vocabulary entry {piece!r} does not encode to itself"
        ranks[bytes(decoder[c] for c in piece)] = i
    if len({b for b in ranks if len(b) == 1}) < 256:
        return None, "its vocabulary lacks some of the 256 bytes"
    vocab, merged = model["vocab"], []
    for m in model.get("merges") or []:
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        merged.append(vocab.get(left + right, -1))
    if any(b <= a for a, b in pairwise(merged)) or (merged and merged[0] < 0):
        return None, "its token ids are not in the order of its merges"
    try:
        return tiktoken.Encoding("strata", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}), ""
    except ValueError as e:  # a regex fancy-regex cannot compile
        return None, f"tiktoken refused it: {e}"


def load_tokenizer(spec: str, eot_token: str = "", engine: str = "auto") -> Tokenizer:
    """A tokenizer from its command-line spec: `bytes`, or a path to a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("train:"):
        raise ValueError("train:VOCAB tokenizers exist only after the pipeline trains them")
    if spec.endswith(".json"):
        return HFTokenizer.from_file(spec, eot_token, engine)
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
        tok = HFTokenizer(definition, engine="hf")
        tok.eot_id = info.eot_id
    else:
        raise ValueError(f"tokenizer kind {info.kind!r} needs its {TOKENIZER_FILE}")
    if tok.info().hash != info.hash:
        raise ValueError(f"tokenizer {info.kind} in the manifest ({info.hash}) differs from this one ({tok.info().hash})")
    return tok
