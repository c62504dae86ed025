"""Language-model text data: a corpus split by file, a byte-level BPE tokenizer, fixed-length token blocks.

    corpus_files(spec)                 -> the text files of `--data` (a file, a folder, or "stdlib")
    split_by_file(files, fraction)     -> (train files, held-out files), by a hash of each file's path
    train_tokenizer(files, vocab_size) -> a byte-level BPE `tokenizers.Tokenizer`
    encode_files(tokenizer, files)     -> one 1-D int64 tensor of token ids (documents joined by EOS)
    TokenBlocks(ids, seq_len)          -> torch.utils.data.Dataset of (input, target) blocks (seq_len,)
    load_corpus(spec, seq_len, ...)    -> LmCorpus: tokenizer + train and held-out TokenBlocks

"stdlib" is a corpus every machine with Python has offline: the standard library's own source and
text files (`sysconfig.get_paths()["stdlib"]`, without site-packages, caches and the test suites).
The split is by file, decided by a hash of the path relative to the corpus root, so it is the same
on every run and a file's text is never on both sides.

Errors: a data path that does not exist, holds no text files, or too little text for one block of
each split raises `planner.errors.InputError` (exit 2) naming the path and what is missing.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import Dataset

from planner.errors import InputError

STDLIB = "stdlib"  # the `--data` value that names the Python standard library's files
TEXT_SUFFIXES = (".py", ".txt", ".rst", ".md")  # files of a data folder that are read
EOS = "<|endoftext|>"  # joins documents; the one special token
HELD_OUT_FRACTION = 0.1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class CorpusFile:
    """One text file of a corpus: its path and its name relative to the corpus root (the split key)."""

    path: Path
    key: str


def corpus_files(spec: str | os.PathLike[str]) -> list[CorpusFile]:
    """The text files named by `spec`: "stdlib", a folder (its files ending in `TEXT_SUFFIXES`, recursively,
    without caches, site-packages and test suites) or one text file. Sorted by key.

    Raises InputError when the path does not exist or holds no text file.
    """
    if os.fspath(spec) == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
    else:
        root = Path(os.fspath(spec)).expanduser()
    if not root.exists():
        raise InputError(
            f"--data {spec}: no such file or folder (give a text file, a folder of them, or '{STDLIB}')"
        )
    if root.is_file():
        return [CorpusFile(root, root.name)]
    files = [
        CorpusFile(p, p.relative_to(root).as_posix())
        for p in root.rglob("*")
        if p.suffix in TEXT_SUFFIXES
        and p.is_file()
        and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    if not files:
        raise InputError(f"--data {spec}: the folder holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return sorted(files, key=lambda f: f.key)


def split_by_file(
    files: Sequence[CorpusFile], held_out_fraction: float = HELD_OUT_FRACTION
) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, held-out): a file is held out when the hash of its key falls in the first
    `held_out_fraction` of the hash range. Deterministic; independent of the other files.
    A one-file corpus is split inside the file instead (see `load_corpus`): returns ([f], [f]).
    """
    if len(files) == 1:
        return list(files), list(files)
    train, held = [], []
    for f in files:
        h = int.from_bytes(hashlib.sha256(f.key.encode()).digest()[:8], "big") / 2.0**64
        (held if h < held_out_fraction else train).append(f)
    if not held:  # few files: hold out the one with the smallest hash, so both sides exist
        first = min(files, key=lambda f: hashlib.sha256(f.key.encode()).digest())
        train, held = [f for f in files if f is not first], [first]
    return train, held


def read_text(f: CorpusFile) -> str:
    """The file's text (UTF-8, undecodable bytes replaced)."""
    return f.path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style byte alphabet, so any text encodes) trained on `texts`,
    with at most `vocab_size` tokens, `EOS` included as id 0. Deterministic for the same texts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A tokenizer saved with `Tokenizer.save` (JSON). Raises InputError when it cannot be read."""
    try:
        return Tokenizer.from_file(os.fspath(path))
    except Exception as exc:  # tokenizers raises its own exception type for a missing / bad file
        raise InputError(f"tokenizer {path}: cannot read it ({exc})") from exc


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """Token ids of `texts`, each followed by EOS, concatenated: 1-D int64 tensor."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(texts)):
        ids.extend(enc.ids)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class TokenBlocks(Dataset):
    """Non-overlapping blocks of `seq_len + 1` tokens of one id stream: item i is (input, target),
    each (seq_len,) int64, target = input shifted by one token. The tail shorter than a block is dropped."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        assert ids.dim() == 1 and seq_len >= 1
        self.ids = ids
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.ids) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        block = self.ids[start : start + self.seq_len + 1]
        return block[:-1], block[1:]

    @property
    def num_tokens(self) -> int:
        """Target tokens in all blocks."""
        return len(self) * self.seq_len


@dataclass
class LmCorpus:
    """A tokenized corpus: the tokenizer, train and held-out blocks, and which files went where."""

    tokenizer: Tokenizer
    train: TokenBlocks
    held_out: TokenBlocks
    train_files: int
    held_out_files: int
    source: str

    def describe(self) -> str:
        """'stdlib: 659 train file(s) (3,410,176 tokens in blocks), 87 held-out file(s) (...), blocks of 128'."""
        t, h = self.train, self.held_out
        return (
            f"{self.source}: {self.train_files} train file(s) ({t.num_tokens:,} tokens in blocks), "
            f"{self.held_out_files} held-out file(s) ({h.num_tokens:,} tokens in blocks), blocks of {t.seq_len}"
        )


def load_corpus(
    spec: str | os.PathLike[str],
    seq_len: int,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    held_out_fraction: float = HELD_OUT_FRACTION,
    min_blocks: int = 1,
    max_files: int | None = None,
) -> LmCorpus:
    """Read, split, tokenize and block the corpus `spec` (`corpus_files`).

    tokenizer: a Tokenizer, a tokenizer JSON path, or None to train a byte-level BPE of `vocab_size`
    tokens on the training files. A one-file corpus is split inside the file: its last
    `held_out_fraction` of tokens is held out. max_files: keep at most this many files of each split
    (the first by key), for quick runs.

    Raises InputError when the data path is bad, or either split has fewer than `min_blocks` blocks
    of `seq_len + 1` tokens (an empty or too-small corpus).
    """
    files = corpus_files(spec)
    train_files, held_files = split_by_file(files, held_out_fraction)
    if max_files is not None:
        train_files, held_files = train_files[:max_files], held_files[:max_files]
    train_texts = [read_text(f) for f in train_files]
    held_texts = [read_text(f) for f in held_files]
    if not any(t.strip() for t in train_texts + held_texts):
        raise InputError(f"--data {spec}: the text files are empty")
    if tokenizer is None:
        if vocab_size is None:
            raise ValueError("load_corpus: give a tokenizer or the vocab_size to train one")
        tok = train_tokenizer(train_texts, vocab_size)
    elif isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        tok = load_tokenizer(tokenizer)
    if len(files) == 1:
        ids = encode_texts(tok, train_texts)
        cut = int(len(ids) * (1 - held_out_fraction))
        train_ids, held_ids = ids[:cut], ids[cut:]
    else:
        train_ids = encode_texts(tok, train_texts)
        held_ids = encode_texts(tok, held_texts)
    train, held = TokenBlocks(train_ids, seq_len), TokenBlocks(held_ids, seq_len)
    for name, blocks, ids in (("training", train, train_ids), ("held-out", held, held_ids)):
        if len(blocks) < min_blocks:
            raise InputError(
                f"--data {spec}: too little text: the {name} split has {len(ids)} tokens, "
                f"{len(blocks)} block(s) of {seq_len} + 1 tokens; at least {min_blocks} needed "
                "(add files, or lower the sequence length / batch size)"
            )
    return LmCorpus(tok, train, held, len(train_files), len(held_files), os.fspath(spec))
