"""The fast tokenizer engine gives Hugging Face's ids exactly, or is not used (no Ray)."""

import json
import os
import random
import sys

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.data.tokenizer import HFTokenizer, TokenizerMismatch, byte_level_bpe, train_bpe

# Llama 3's split: a regex before a ByteLevel that does not split.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _installed_text(limit_bytes: int, skip: int = 0) -> list[str]:
    """Source and docs of the installed packages: text nobody here wrote."""
    root = os.path.dirname(os.path.dirname(pytest.__file__))
    out, total = [], 0
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(files):
            if not name.endswith((".py", ".md", ".rst", ".txt")):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if skip:
                skip -= 1
                continue
            out.append(text)
            total += len(text)
            if total >= limit_bytes:
                return out
    return out


def _random_unicode(n: int, seed: int) -> list[str]:
    """Strings of code points from every plane that text uses, with runs of spaces, tabs and newlines."""
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x2000, 0x206F)]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 60)):
            lo, hi = rng.choice(ranges)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
            parts.append(rng.choice([" ", "  ", "\n", "\t", " \n ", "'s ", "123", " 4567", "", "\r\n"]))
        out.append("".join(parts))
    return out


def _split_bytelevel_bpe(texts: list[str], vocab: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def corpus():
    train = _installed_text(2 << 20)
    test = _installed_text(3 << 20, skip=len(train)) + _random_unicode(300, seed=1)
    return train, test


@pytest.mark.parametrize("layout", ["gpt2", "split"])
def test_the_fast_engine_gives_hugging_faces_ids_on_text_it_was_not_trained_on(corpus, layout):
    train, test = corpus
    definition = train_bpe(iter(train), 4000).definition if layout == "gpt2" else _split_bytelevel_bpe(train, 4000)
    fast, slow = HFTokenizer(definition), HFTokenizer(definition, engine="hf")
    assert fast.engine == "tiktoken", fast.why_not_fast
    assert slow.engine == "hf" and slow.fast is None
    # A literal special token in a text is encoded as Hugging Face's does it.
    test = [*test, "before <|endoftext|> after", "<|endoftext|>"]
    got, want = fast.encode_batch(test), slow.encode_batch(test)
    assert sum(len(w) for w in want) > 500_000
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert fast.checked == len(range(0, len(test), HFTokenizer.CHECK_EVERY))
    assert fast.decode(got[0]) == test[0]


def _edit(definition: str, change) -> str:
    d = json.loads(definition)
    change(d)
    return json.dumps(d)


def test_a_tokenizer_the_fast_engine_could_get_wrong_stays_on_hugging_faces(corpus):
    base = train_bpe(iter(corpus[0][:50]), 600).definition
    assert byte_level_bpe(base)[0] is not None

    def swap_two_merged_ids(d):  # ids no longer in merge order: tiktoken would merge in another order
        vocab, (a, b) = d["model"]["vocab"], [x + y for x, y in d["model"]["merges"][-2:]]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    def drop_a_merge(d):  # an entry the merges cannot build: tiktoken would take the word whole
        d["model"]["merges"] = d["model"]["merges"][:10] + d["model"]["merges"][11:]

    cases = {
        "not in the order of its merges": swap_two_merged_ids,
        "does not encode to itself": drop_a_merge,
        "has a normalizer": lambda d: d.update(normalizer={"type": "NFC"}),
        "not a plain BPE": lambda d: d["model"].update(dropout=0.1),
        "not ByteLevel splitting": lambda d: d.update(pre_tokenizer={"type": "Whitespace"}),
        "adds a prefix space": lambda d: d["pre_tokenizer"].update(add_prefix_space=True),
    }
    for why, change in cases.items():
        edited = _edit(base, change)
        fast, reason = byte_level_bpe(edited)
        assert fast is None and why in reason, (why, reason)
        tok = HFTokenizer(edited)
        assert tok.engine == "hf" and tok.why_not_fast == reason


def test_a_difference_between_the_engines_stops_the_encoding(corpus):
    import tiktoken

    tok = HFTokenizer(train_bpe(iter(corpus[0][:50]), 600).definition)
    assert tok.engine == "tiktoken"
    # An engine that merges in the wrong order: the sampled check catches it.
    ranks = tok.fast._mergeable_ranks
    merged = sorted((b for b in ranks if len(b) > 1), key=ranks.get)
    wrong = {**ranks, **{b: ranks[c] for b, c in zip(merged, reversed(merged), strict=True)}}
    tok.fast = tiktoken.Encoding("wrong", pat_str=tok.fast._pat_str, mergeable_ranks=wrong, special_tokens={})
    with pytest.raises(TokenizerMismatch, match="--tokenizer-engine hf"):
        tok.encode_batch(corpus[1][:2 * HFTokenizer.CHECK_EVERY])


def test_without_tiktoken_the_tokenizer_says_why_and_uses_hugging_faces(corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if it were not installed
    tok = HFTokenizer(train_bpe(iter(corpus[0][:50]), 600).definition)
    assert tok.engine == "hf" and tok.why_not_fast == "tiktoken is not installed"
