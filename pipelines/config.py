"""The typed configuration of a tier-1 run: one frozen dataclass per stage (read, clean, dedup, pack),
and the presets that fill them. Flags map onto fields one to one (strata/commands/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.clean import WEB, CleanConfig
from pipelines.dedup import DedupConfig
from pipelines.quality import QualityConfig
from strata.commands.cli import AT_LEAST_ONE, NON_NEGATIVE, check_fields
from strata.data.sources import ReadConfig
from strata.data.storage import check_name
from strata.data.tokenizer import ENGINES, check_spec


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    tokenizer: str = "bytes"
    """`bytes`, a path to a Hugging Face tokenizer.json, or train:VOCAB (byte-level BPE trained on the corpus)."""
    eot_token: str = ""
    """End-of-text token of a tokenizer.json (default: the first of <|endoftext|>, </s>, ...)."""
    tokenizer_engine: str = "auto"
    """How a tokenizer.json encodes: auto (tiktoken's BPE core where the file allows it, checked against
    Hugging Face's on a sample of documents; the same ids) or hf (Hugging Face tokenizers always)."""
    tokenizer_sample_bytes: int = 32 << 20
    """Text sampled from the corpus to train a train:VOCAB tokenizer."""
    seq_len: int = 128
    """Tokens a model sees per row; rows hold seq_len + 1 ids (inputs and shifted targets)."""
    validation_fraction: float = 0.05
    """Fraction of documents held out for validation, chosen by a stable hash of the document id."""
    shard_bytes: int = 128 << 20
    """Target size of a shard's token data; shards are this size on average."""
    seed: int = 0
    """Seed of the row shuffle: the same seed, the same order."""
    split_seed: int = 0
    """Seed of the train/validation split of documents."""
    final: bool = False
    """Pad what is left of each split into a last row (the padding is left out of training's loss) instead
    of carrying it into the next version: every kept document is in this version. For a one-off dataset,
    or the last version of one."""

    def __post_init__(self):
        check_spec(self.tokenizer)
        if self.tokenizer_engine not in ENGINES:
            raise ValueError(f"tokenizer_engine {self.tokenizer_engine!r}: use one of {', '.join(ENGINES)}")
        check_fields(self, {**dict.fromkeys(("seq_len", "shard_bytes", "tokenizer_sample_bytes"), AT_LEAST_ONE),
                            **dict.fromkeys(("seed", "split_seed"), NON_NEGATIVE)})
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError("validation_fraction must be in [0, 1)")
        if self.seq_len + 1 >= 2**31:  # a row is one Arrow list of seq_len + 1 ids: its length is an int32
            raise ValueError(f"--seq-len {self.seq_len}: a row holds seq_len + 1 token ids in one list, whose length "
                             f"is a 32-bit integer: at most {2**31 - 2:,}")
        if (self.seq_len + 1) * 4 > self.shard_bytes:  # 4: the widest token type, uint32
            raise ValueError(f"--seq-len {self.seq_len}: one row ({self.seq_len + 1:,} ids, up to 4 bytes each) is "
                             f"larger than --shard-bytes {self.shard_bytes:,}: raise --shard-bytes or lower --seq-len")


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    dataset: str
    read: ReadConfig
    clean: CleanConfig = field(default_factory=CleanConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)

    def __post_init__(self):
        check_name(self.dataset, "dataset name")
        if not self.read.inputs:
            raise ValueError("give at least one --input")


STAGES = {"read": ReadConfig, "clean": CleanConfig, "dedup": DedupConfig, "pack": PackConfig, "quality": QualityConfig}


def debug(dataset: str, **stages: dict) -> PreprocessConfig:
    """Short rows and length-only filters: a laptop CPU in seconds, fine for source code."""
    return _build(dataset, stages, pack={"seq_len": 128, "shard_bytes": 16 << 20})


def web(dataset: str, **stages: dict) -> PreprocessConfig:
    """Web text: Gopher/C4 quality rules, FineWeb's MinHash normalization, GPT-2 length rows."""
    return _build(dataset, stages, clean=WEB, dedup={"shingle_normalize": True}, pack={"seq_len": 1024})


PRESETS = {"debug": debug, "web": web}


def _build(dataset: str, stages: dict, **preset: dict) -> PreprocessConfig:
    made = {name: cls(**{**preset.get(name, {}), **stages.get(name, {})}) for name, cls in STAGES.items()}
    return PreprocessConfig(dataset=dataset, **made)
