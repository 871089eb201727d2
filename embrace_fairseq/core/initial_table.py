"""The initial values of an embedding table as fairseq draws them, whole or one rank's rows.

fairseq's ``Embedding()`` builds ``nn.Embedding`` (whose own reset draws N(0, 1) over the
table), re-draws N(0, dim**-0.5) and zeroes the padding row. A sharded table must hold the
same values and leave the random generator where stock fairseq leaves it, so that every
module built after it is identical too. Drawing the whole table on every rank costs a full
table of memory at start-up (1 GB at 250k x 1024 in fp32); :func:`fairseq_initial_rows`
draws it in chunks and keeps only the rank's rows.

Why chunks give the same values: torch's CPU ``normal_`` on a contiguous tensor of at least 16
elements first draws one uniform per element in order, then turns blocks of 16 into normals,
and for a ragged end redraws the last 16 uniforms. Chunks of a multiple of 16 elements, the
last with at least 16, therefore draw the same uniforms at the same places as one draw over
the table (``tests/core/test_initial_table.py`` checks values and generator state against
the whole draw, in every dtype it supports).

>>> import torch
>>> _ = torch.manual_seed(0)
>>> full = fairseq_initial_table(10, 3, padding_idx=1)
>>> _ = torch.manual_seed(0)
>>> rows = fairseq_initial_rows(10, 3, 1, torch.tensor([1, 4, 7]), chunk_elems=16)
>>> torch.equal(rows, full[[1, 4, 7]])
True
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

#: elements drawn at a time by :func:`fairseq_initial_rows` (16 MB of fp32)
CHUNK_ELEMS = 1 << 22
#: torch's CPU normal_ turns uniforms into normals in blocks of this many elements
_BLOCK = 16


def fairseq_initial_table(
    num_embeddings: int, embedding_dim: int, padding_idx: Optional[int], dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """The full table fairseq's ``Embedding()`` builds, drawing the RNG the same way."""
    table = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
    table.normal_()  # nn.Embedding.reset_parameters
    nn.init.normal_(table, mean=0.0, std=embedding_dim**-0.5)
    if padding_idx is not None:
        table[padding_idx].zero_()
    return table


def draw_chunks(num_embeddings: int, embedding_dim: int, chunk_elems: int = CHUNK_ELEMS) -> List[Tuple[int, int]]:
    """Row ranges ``[start, end)`` to draw one after another: each a multiple of 16 elements
    except the last, which has at least 16 (one range when the table is smaller)."""
    step = _BLOCK // math.gcd(embedding_dim, _BLOCK)  # rows per whole number of blocks
    rows = max(step, chunk_elems // max(1, embedding_dim) // step * step)
    bounds = [(s, min(s + rows, num_embeddings)) for s in range(0, num_embeddings, rows)]
    if len(bounds) > 1 and (bounds[-1][1] - bounds[-1][0]) * embedding_dim < _BLOCK:
        bounds[-2:] = [(bounds[-2][0], num_embeddings)]
    return bounds


def fairseq_initial_rows(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: Optional[int],
    vocab_ids: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """Rows ``vocab_ids`` (ascending) of :func:`fairseq_initial_table`, in that order, with
    the generator left where the whole draw leaves it; at most one chunk of the table is
    held besides the rows."""
    ids = vocab_ids.long().cpu()
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("vocab_ids must be ascending")
    out = torch.empty(ids.numel(), embedding_dim, dtype=dtype)
    chunks = draw_chunks(num_embeddings, embedding_dim, chunk_elems)
    # one buffer for every chunk (its leading rows are contiguous): no fresh pages per chunk
    buf = torch.empty(max((e - s for s, e in chunks), default=0), embedding_dim, dtype=dtype)
    with torch.no_grad():
        for start, end in chunks:  # nn.Embedding's reset: drawn, then overwritten
            buf[: end - start].normal_()
        for start, end in chunks:  # fairseq's re-draw: keep this rank's rows
            block = buf[: end - start].normal_(0.0, embedding_dim**-0.5)
            lo, hi = (int(i) for i in torch.searchsorted(ids, torch.tensor([start, end])))
            out[lo:hi] = block[ids[lo:hi] - start]
    if padding_idx is not None:
        out[ids == padding_idx] = 0
    return out
