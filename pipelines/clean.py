"""Cleaning and quality filters: each rule is a small function with its own counter.

The rules follow the Gopher (Rae et al. 2021, appendix A) and C4 (Raffel et al.
2020) heuristics. Every threshold is a config field; `None` turns a rule off.
The `debug` preset only bounds length (its corpus is source code, which prose
rules would throw away); the `web` preset turns the prose rules on.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200b\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_TRAILING = re.compile(r"[ \t\u00a0\u3000]+\n")
_WORD = re.compile(r"\w+", re.UNICODE)
_BULLETS = ("•", "●", "○", "-", "*", "‣", "◦")
_C4_BAD = ("lorem ipsum", "javascript", "cookie policy", "terms of use", "privacy policy")


@dataclass(frozen=True, kw_only=True)
class CleanConfig:
    normalization: str = "NFC"
    """Unicode normalization form: NFC, NFKC, or none."""
    whitespace: str = "trim"
    """`trim` (trailing spaces, line endings, runs of blank lines; keeps indentation) or `collapse` (also runs of spaces)."""
    min_chars: int = 16
    """Documents shorter than this (after cleaning) are filtered: too-short."""
    max_chars: int = 1_000_000
    """Documents longer than this are filtered: too-long."""
    min_words: int | None = None
    """Gopher: fewer words than this is filtered."""
    max_words: int | None = None
    """Gopher: more words than this is filtered."""
    min_mean_word_length: float | None = None
    """Gopher: mean word length below this (3) is filtered."""
    max_mean_word_length: float | None = None
    """Gopher: mean word length above this (10) is filtered."""
    min_alpha_word_fraction: float | None = None
    """Gopher: fraction of words with a letter below this (0.8) is filtered."""
    max_symbol_word_ratio: float | None = None
    """Gopher: ratio of '#' and '...' to words above this (0.1) is filtered."""
    max_bullet_line_fraction: float | None = None
    """Gopher: fraction of lines starting with a bullet above this (0.9) is filtered."""
    max_ellipsis_line_fraction: float | None = None
    """Gopher: fraction of lines ending in an ellipsis above this (0.3) is filtered."""
    max_duplicate_line_fraction: float | None = None
    """Gopher: fraction of lines that repeat an earlier line above this (0.3) is filtered."""
    max_top_2gram_fraction: float | None = None
    """Gopher: share of characters in the most frequent word 2-gram above this (0.2) is filtered."""
    max_duplicate_5gram_fraction: float | None = None
    """Gopher: share of characters in repeated word 5-grams above this (0.15) is filtered."""
    min_terminal_punct_line_fraction: float | None = None
    """C4: fraction of lines ending in . ! ? or a quote below this is filtered."""
    c4_bad_phrases: bool = False
    """C4: filter documents with boilerplate phrases (lorem ipsum, javascript, cookie policy ...)."""

    def __post_init__(self):
        if self.normalization not in ("NFC", "NFKC", "none"):
            raise ValueError("normalization must be NFC, NFKC or none")
        if self.whitespace not in ("trim", "collapse"):
            raise ValueError("whitespace must be trim or collapse")
        if self.min_chars < 0 or self.max_chars < self.min_chars:
            raise ValueError("need 0 <= min_chars <= max_chars")


WEB = dict(whitespace="collapse", min_words=50, max_words=100_000, min_mean_word_length=3.0, max_mean_word_length=10.0,
           min_alpha_word_fraction=0.8, max_symbol_word_ratio=0.1, max_bullet_line_fraction=0.9,
           max_ellipsis_line_fraction=0.3, max_duplicate_line_fraction=0.3, max_top_2gram_fraction=0.2,
           max_duplicate_5gram_fraction=0.15, min_terminal_punct_line_fraction=None, c4_bad_phrases=True)
"""The web preset's rule thresholds (Gopher's published values)."""


def normalize(text: str, cfg: CleanConfig) -> str:
    """Unicode form, newlines, control characters, trailing spaces, blank-line runs (and space runs).

    Each step first checks whether it has anything to do: most text needs none of them.
    """
    if cfg.normalization != "none" and not unicodedata.is_normalized(cfg.normalization, text):
        text = unicodedata.normalize(cfg.normalization, text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if _CONTROL.search(text):
        text = _CONTROL.sub("", text)
    if cfg.whitespace == "collapse":
        text = _SPACES.sub(" ", text)
    text = _TRAILING.sub("\n", text)
    return _BLANKS.sub("\n\n", text).strip()


def _ngram_fractions(words: list[str]) -> tuple[float, float]:
    """(top 2-gram char share, duplicated 5-gram char share), as in Gopher."""
    chars = sum(len(w) for w in words) or 1
    bigrams = Counter(zip(words, words[1:], strict=False))
    top = 0.0
    if bigrams:
        (a, b), count = bigrams.most_common(1)[0]
        top = count * (len(a) + len(b)) / chars if count > 1 else 0.0
    seen, dup = set(), [False] * len(words)
    for i in range(len(words) - 4):
        gram = tuple(words[i: i + 5])
        if gram in seen:
            for j in range(i, i + 5):
                dup[j] = True
        seen.add(gram)
    return top, sum(len(w) for w, d in zip(words, dup, strict=True) if d) / chars


def quality_reason(text: str, cfg: CleanConfig) -> str:
    """The first rule `text` fails, or '' if it passes them all."""
    if len(text) < cfg.min_chars:
        return "too-short"
    if len(text) > cfg.max_chars:
        return "too-long"
    needs_words = any(v is not None for v in (
        cfg.min_words, cfg.max_words, cfg.min_mean_word_length, cfg.max_mean_word_length,
        cfg.min_alpha_word_fraction, cfg.max_symbol_word_ratio, cfg.max_top_2gram_fraction,
        cfg.max_duplicate_5gram_fraction))
    if needs_words:
        words = text.split()
        n = len(words) or 1
        if cfg.min_words is not None and len(words) < cfg.min_words:
            return "gopher-min-words"
        if cfg.max_words is not None and len(words) > cfg.max_words:
            return "gopher-max-words"
        mean = sum(len(w) for w in words) / n
        if cfg.min_mean_word_length is not None and mean < cfg.min_mean_word_length:
            return "gopher-mean-word-length"
        if cfg.max_mean_word_length is not None and mean > cfg.max_mean_word_length:
            return "gopher-mean-word-length"
        if cfg.min_alpha_word_fraction is not None and \
                sum(1 for w in words if any(c.isalpha() for c in w)) / n < cfg.min_alpha_word_fraction:
            return "gopher-alpha-words"
        if cfg.max_symbol_word_ratio is not None and \
                (text.count("#") + text.count("...") + text.count("…")) / n > cfg.max_symbol_word_ratio:
            return "gopher-symbol-ratio"
        if cfg.max_top_2gram_fraction is not None or cfg.max_duplicate_5gram_fraction is not None:
            lowered = _WORD.findall(text.lower())
            top2, dup5 = _ngram_fractions(lowered)
            if cfg.max_top_2gram_fraction is not None and top2 > cfg.max_top_2gram_fraction:
                return "gopher-top-2gram"
            if cfg.max_duplicate_5gram_fraction is not None and dup5 > cfg.max_duplicate_5gram_fraction:
                return "gopher-duplicate-5grams"
    lines = [line for line in text.split("\n") if line.strip()] or [""]
    if cfg.max_bullet_line_fraction is not None and \
            sum(1 for line in lines if line.lstrip().startswith(_BULLETS)) / len(lines) > cfg.max_bullet_line_fraction:
        return "gopher-bullet-lines"
    if cfg.max_ellipsis_line_fraction is not None and \
            sum(1 for line in lines if line.rstrip().endswith(("...", "…"))) / len(lines) > cfg.max_ellipsis_line_fraction:
        return "gopher-ellipsis-lines"
    if cfg.max_duplicate_line_fraction is not None and \
            (len(lines) - len(set(lines))) / len(lines) > cfg.max_duplicate_line_fraction:
        return "gopher-duplicate-lines"
    if cfg.min_terminal_punct_line_fraction is not None and \
            sum(1 for line in lines if line.rstrip().endswith((".", "!", "?", '"', "'"))) / len(lines) \
            < cfg.min_terminal_punct_line_fraction:
        return "c4-terminal-punctuation"
    if cfg.c4_bad_phrases:
        lowered = text.lower()
        if any(p in lowered for p in _C4_BAD) or "{" in text:
            return "c4-bad-phrase"
    return ""
