"""How a trainer worker cuts its share of a mini-batch into micro-batches (pure, no torch).

A micro-batch is padded to its longest sequence. On heavy-tailed response lengths (most
short, a few near the cap) micro-batches cut in arrival order each catch a long sample,
and most of their compute goes on padding. With a token budget the samples are taken in
order of length and a micro-batch closes before its padded size would pass the budget:
short samples share micro-batches with each other and long ones with long ones. The
loss of a mini-batch is a token sum over a fixed normaliser, so how its samples are cut
changes the summation order only, not the gradient.
"""

from __future__ import annotations


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Indices into ``lengths`` (each sample's padded-to length), one list per micro-batch.

    ``max_tokens`` <= 0: consecutive runs of at most ``max_rows`` in the given order.
    ``max_tokens`` > 0: by ascending length, at most ``max_rows`` per micro-batch and
    rows x longest <= ``max_tokens`` (a sample longer than the budget goes alone).
    Every index appears exactly once.
    """
    if max_rows < 1:
        raise ValueError(f"trainer.micro_batch_size must be >= 1, got {max_rows}")
    n = len(lengths)
    if max_tokens <= 0:
        return [list(range(i, min(i + max_rows, n))) for i in range(0, n, max_rows)]
    out: list[list[int]] = []
    rows: list[int] = []
    for i in sorted(range(n), key=lambda i: lengths[i]):
        # ascending: the sample joining is the longest of its micro-batch
        if rows and (len(rows) == max_rows or (len(rows) + 1) * lengths[i] > max_tokens):
            out.append(rows)
            rows = []
        rows.append(i)
    if rows:
        out.append(rows)
    return out
