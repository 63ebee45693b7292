"""Prompt rows from user data files (JSONL or Parquet).

Each row needs the prompt column (``data.prompt_key``); every other column goes
to the reward function. A malformed row (bad JSON, missing or empty prompt) is
skipped, counted and logged once per kind: nothing stops the run for one bad row.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

from disagg.errors import ConfigError
from disagg.tasks.base import PromptRow, rows_from_cursor

log = logging.getLogger("disagg.data")


def _read_rows(path: Path) -> Iterator[dict[str, Any] | str]:
    """Yield dict rows, or a string describing why a line could not be read."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for rec in pq.read_table(path).to_pylist():
            yield rec
        return
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}: invalid JSON ({e.msg})"
                continue
            yield rec if isinstance(rec, dict) else f"{path}:{lineno}: row is not an object"


class FilePromptSource:
    """Rows from ``data.train_files``, cycled for as many epochs as the run needs."""

    def __init__(self, files: list[str], prompt_key: str, seed: int, shuffle: bool = True, start: int = 0):
        self.paths = [Path(f) for f in files]
        for p in self.paths:
            if not p.exists():
                raise ConfigError(f"data.train_files: {str(p)!r} does not exist")
            if p.suffix not in (".jsonl", ".json", ".parquet"):
                raise ConfigError(f"data.train_files: {str(p)!r} is not .jsonl or .parquet")
        self.prompt_key = prompt_key
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = start
        self.skipped: dict[str, int] = {}
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, row order) of the latest row_at
        self._rows = self._load()
        if not self._rows:
            raise ConfigError(f"data.train_files={files!r}: no usable rows (prompt column {prompt_key!r})")

    def _skip(self, kind: str, detail: str) -> None:
        if kind not in self.skipped:
            log.warning("skipping malformed data row (%s): %s; further rows of this kind are counted only", kind, detail)
        self.skipped[kind] = self.skipped.get(kind, 0) + 1

    def _load(self) -> list[dict[str, Any]]:
        rows = []
        for p in self.paths:
            for rec in _read_rows(p):
                if isinstance(rec, str):
                    self._skip("bad_json", rec)
                    continue
                prompt = rec.get(self.prompt_key)
                if not isinstance(prompt, str) or not prompt:
                    self._skip("missing_prompt", f"{p}: row without a non-empty {self.prompt_key!r}")
                    continue
                rows.append(rec)
        log.info("loaded %d prompt rows from %d file(s); skipped %s", len(rows), len(self.paths), self.skipped or 0)
        return rows

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def row_at(self, index: int) -> PromptRow:
        """Row ``index`` of the stream: epoch ``index // len(rows)``, each epoch in its own seeded order."""
        import random

        epoch, pos = divmod(index, len(self._rows))
        if self._order[0] != epoch:
            order = list(range(len(self._rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order = (epoch, order)
        rec = self._rows[self._order[1][pos]]
        return PromptRow(index, rec[self.prompt_key], rec)

    def __iter__(self) -> Iterator[PromptRow]:
        return rows_from_cursor(self)
