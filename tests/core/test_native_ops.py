"""Native ops (csrc/) against their PyTorch references: bit-exact, and the switch."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from embrace_fairseq import ShardPlan, ShardedEmbedding
from embrace_fairseq.core import native_ops as N
from embrace_fairseq.tools.local_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def require_native() -> None:
    """Skip only when the extension was left out on purpose (EMBRACE_BUILD_NATIVE=0) or
    cannot be built (no C++ compiler); a missing or stale build otherwise fails the test:
    scripts/setup.sh rebuilds it whenever csrc/ changes."""
    if N.native_module() is not None:
        return
    if os.environ.get("EMBRACE_BUILD_NATIVE", "1") == "0":
        pytest.skip(f"EMBRACE_BUILD_NATIVE=0: built without native ops on purpose ({N.native_status()})")
    cxx = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build the native ops ({N.native_status()})")
    pytest.fail(
        f"{N.native_status()}, though a C++ compiler ({cxx}) is at hand and EMBRACE_BUILD_NATIVE is not 0: "
        "run scripts/setup.sh (it rebuilds the extension when csrc/ changes) or "
        "`python setup.py build_ext --inplace`; set EMBRACE_BUILD_NATIVE=0 to test without native ops",
        pytrace=False,
    )


@pytest.fixture
def native():
    require_native()
    return N.native_module()


needs_native = pytest.mark.usefixtures("native")

BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in BITS:
        return torch.equal(a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype]))
    return torch.equal(a, b)


def id_batches(vocab: int, world: int, gen: torch.Generator):
    """Named id batches: empty, random, heavy repeats, every shard edge, one owner."""
    b = ShardPlan(vocab, world).boundaries
    edges = sorted({x for r in range(world) for x in (b[r], b[r + 1] - 1) if b[r] < b[r + 1]})
    yield "empty", torch.zeros(0, dtype=torch.long)
    yield "random", torch.randint(0, vocab, (257,), generator=gen)
    yield "repeats", torch.randint(0, vocab, (3,), generator=gen).repeat(50)
    yield "edges", torch.tensor(edges * 3, dtype=torch.long)[torch.randperm(3 * len(edges), generator=gen)]
    yield "one_owner", torch.randint(b[-2], b[-1], (40,), generator=gen) if b[-1] > b[-2] else torch.zeros(0, dtype=torch.long)
    yield "single", torch.tensor([vocab - 1])


@needs_native
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab", [11, 1000, 100_003])
def test_dedup_bucket_matches_reference(world, vocab):
    gen = torch.Generator().manual_seed(world * 7 + vocab)
    bounds = ShardPlan(vocab, world).boundaries
    for name, ids in id_batches(vocab, world, gen):
        for dtype in (torch.int64, torch.int32):
            x = ids.to(dtype)
            ref = N.dedup_bucket_reference(x, bounds)
            assert sum(ref.send_counts) == ref.unique_ids.numel()
            for method in (0, 1, 2):  # auto, dense table, sort
                nat = N.dedup_bucket_native(x, bounds, method)
                where = (name, dtype, method)
                assert nat.bad_id is None, where
                assert same_bits(nat.unique_ids, ref.unique_ids), where
                assert same_bits(nat.inverse, ref.inverse), where
                assert nat.send_counts == ref.send_counts, where


@needs_native
def test_dedup_bucket_small_int_types_and_2d():
    bounds = ShardPlan(200, 3).boundaries
    ids = torch.randint(0, 200, (6, 9), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.uint8, torch.int16):
        ref, nat = N.dedup_bucket_reference(ids.to(dtype), bounds), N.dedup_bucket_native(ids.to(dtype), bounds)
        assert same_bits(nat.unique_ids, ref.unique_ids) and same_bits(nat.inverse, ref.inverse)
        assert nat.send_counts == ref.send_counts


@needs_native
@pytest.mark.parametrize("ids,bad", [([3, -2, 500, 7], -2), ([3, 10, 11, 4], 11), ([-1], -1), ([0, 12, 11], 12)])
def test_dedup_bucket_reports_the_same_bad_id(ids, bad):
    bounds = ShardPlan(11, 3).boundaries
    for dtype in (torch.int64, torch.int32):
        x = torch.tensor(ids, dtype=dtype)
        assert N.dedup_bucket_reference(x, bounds).bad_id == bad
        assert N.dedup_bucket_native(x, bounds).bad_id == bad


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_gather_rows_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(37, 24, generator=gen).to(dtype)
    for index in (torch.zeros(0, dtype=torch.long), torch.tensor([0, 36, 36, 0, 5]), torch.randint(0, 37, (300,), generator=gen)):
        for itype in (torch.int64, torch.int32):
            assert same_bits(N.gather_rows_native(table, index.to(itype)), N.gather_rows_reference(table, index.to(itype)))
    strided = torch.randn(24, 37, generator=gen).to(dtype).t()
    assert same_bits(N.gather_rows_native(strided, index), N.gather_rows_reference(strided, index))


@needs_native
def test_gather_rows_rejects_out_of_range_like_the_reference():
    table = torch.randn(5, 3)
    for bad in ([5], [-1], [0, 7]):
        with pytest.raises(IndexError):
            N.gather_rows_reference(table, torch.tensor(bad))
        with pytest.raises(IndexError, match="out of range"):
            N.gather_rows_native(table, torch.tensor(bad))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale,zero_row", [(1.0, None), (1.0 / 3, 2), (-0.5, None), (0.25, 0)])
def test_scatter_add_rows_bit_exact(dtype, scale, zero_row):
    gen = torch.Generator().manual_seed(3)
    rows, dim = 19, 40
    cases = {
        "empty": torch.zeros(0, dtype=torch.long),
        "random": torch.randint(0, rows, (500,), generator=gen),
        # hundreds of rows into one: half/bfloat16 show any change of order or rounding
        "pile_up": torch.full((700,), rows - 1, dtype=torch.long),
        "edges": torch.tensor([0, rows - 1] * 30),
    }
    for name, index in cases.items():
        src = (torch.randn(index.numel(), dim, generator=gen) * 3).to(dtype)
        ref = N.scatter_add_rows_reference(src, index, rows, scale, zero_row)
        for itype in (torch.int64, torch.int32):
            nat = N.scatter_add_rows_native(src, index.to(itype), rows, scale, zero_row)
            assert same_bits(nat, ref), (name, itype)
    src_t = torch.randn(dim, 500, generator=gen).to(dtype).t()  # non-contiguous gradient
    index = cases["random"]
    assert same_bits(N.scatter_add_rows_native(src_t, index, rows, scale, zero_row),
                     N.scatter_add_rows_reference(src_t, index, rows, scale, zero_row))


@needs_native
def test_scatter_add_rows_rejects_bad_input():
    src = torch.randn(3, 2)
    with pytest.raises(IndexError, match="out of range"):
        N.scatter_add_rows_native(src, torch.tensor([0, 4, 1]), 4)
    with pytest.raises(RuntimeError, match="one entry per src row"):
        N.scatter_add_rows_native(src, torch.tensor([0, 1]), 4)
    with pytest.raises(RuntimeError, match="zero_row"):
        N.scatter_add_rows_native(src, torch.tensor([0, 1, 2]), 4, 1.0, 4)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_rows_forward_and_backward(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(9, 16, generator=gen).to(dtype)
    inverse = torch.randint(0, 9, (120,), generator=gen)
    coef = torch.randn(120, 16, generator=gen).to(dtype)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("EMBRACE_NATIVE", mode)
        rows = base.clone().requires_grad_()
        y = N.expand_rows(rows, inverse)
        (y * coef).sum().backward()
        out[mode] = (y.detach(), rows.grad)
    assert same_bits(out["0"][0], out["1"][0]) and same_bits(out["0"][1], out["1"][1])


needs_native_cuda = pytest.mark.skipif(
    N.native_module() is None or not N.native_module().WITH_CUDA or not torch.cuda.is_available(),
    reason="needs the extension built with CUDA kernels and a GPU",
)


@needs_native_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernels_match_the_cpu_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    bounds = ShardPlan(1000, 3).boundaries
    for name, ids in id_batches(1000, 3, gen):
        ref = N.dedup_bucket_reference(ids, bounds)
        for method in (0, 1, 2):  # auto, dense, sort: each CUDA path
            nat = N.dedup_bucket_native(ids.cuda(), bounds, method)
            assert nat.unique_ids.is_cuda and same_bits(nat.unique_ids.cpu(), ref.unique_ids), (name, method)
            assert same_bits(nat.inverse.cpu(), ref.inverse) and nat.send_counts == ref.send_counts, (name, method)
    big = ShardPlan(7 * 2048 + 3, 2048).boundaries  # 2049 edges: more than one CUDA block
    ids = torch.randint(0, big[-1], (5000,), generator=gen)
    for method in (0, 1, 2):
        assert N.dedup_bucket_native(ids.cuda(), big, method).send_counts == N.dedup_bucket_reference(ids, big).send_counts
    with pytest.raises(N.RowIndexError, match="^gather_rows: index 50 out of range for a table of 50 rows$"):
        N.gather_rows_native(torch.zeros(50, 3, device="cuda"), torch.tensor([1, 50], device="cuda"))
    assert float(torch.ones(10, device="cuda").sum()) == 10.0  # the context survived the bad index
    assert N.dedup_bucket_native(torch.tensor([5, 1000]).cuda(), bounds).bad_id == 1000
    table = torch.randn(50, 33, generator=gen).to(dtype)
    index = torch.randint(0, 50, (400,), generator=gen)
    assert same_bits(N.gather_rows_native(table.cuda(), index.cuda()).cpu(), N.gather_rows_reference(table, index))
    src = torch.randn(400, 33, generator=gen).to(dtype)
    for scale, zero_row in ((1.0, None), (1.0 / 3, 7)):
        got = N.scatter_add_rows_native(src.cuda(), index.cuda(), 50, scale, zero_row).cpu()
        assert same_bits(got, N.scatter_add_rows_reference(src, index, 50, scale, zero_row)), (scale, zero_row)


def test_mode_switch(monkeypatch):
    monkeypatch.setenv("EMBRACE_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="EMBRACE_NATIVE must be one of"):
        N.dedup_bucket(torch.tensor([1]), [0, 5])
    monkeypatch.setenv("EMBRACE_NATIVE", "0")
    assert not any(N.use_native(op, torch.device("cpu")) for op in N.OPS)
    monkeypatch.delenv("EMBRACE_NATIVE")
    assert N.mode() == "auto"
    expected = N.native_module() is not None
    assert [N.use_native(op, torch.device("cpu")) for op in N.OPS] == [expected and N.AUTO_NATIVE[op] for op in N.OPS]


def test_missing_extension_falls_back_or_fails_clearly(monkeypatch):
    monkeypatch.setattr(N, "_load", lambda: (None, "the extension is not built (no module named _native)"))
    ids = torch.tensor([4, 1, 4, 9])
    monkeypatch.setenv("EMBRACE_NATIVE", "auto")
    got = N.dedup_bucket(ids, [0, 5, 10])
    assert got.unique_ids.tolist() == [1, 4, 9] and got.send_counts == [2, 1]
    monkeypatch.setenv("EMBRACE_NATIVE", "1")
    with pytest.raises(N.NativeOpsUnavailable, match="EMBRACE_NATIVE=1 but the extension is not built.*build_ext --inplace"):
        N.dedup_bucket(ids, [0, 5, 10])


@needs_native
def test_stale_build_is_detected(tmp_path):
    assert N.native_module().SOURCE_HASH == N.source_hash() == N.source_hash(ROOT)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    with open(tmp_path / "csrc" / "embrace_native.cpp", "a") as f:
        f.write("\n// edited\n")
    assert N.source_hash(tmp_path) != N.native_module().SOURCE_HASH


# ----------------------------------------------------------------- end to end, real ranks
def native_vs_reference_rank(rank, world):
    """Same seed, same batches: ShardedEmbedding outputs and grads with EMBRACE_NATIVE=0
    and =1, sharded over all ranks and over the 2-rank group {0, 1} (one spawn, two
    world sizes)."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # collective: every rank takes part
    vocab, dim = 23, 6  # 23 rows: uneven over 2 and 3 ranks
    results = {}
    for label, group, members in ((f"{world} ranks", None, world), ("2 ranks", pair, 2)):
        if rank >= members:
            continue
        for case in ("random", "padding_repeats", "empty_rank", "two_lookups"):
            got = {}
            for mode in ("0", "1"):
                os.environ["EMBRACE_NATIVE"] = mode
                torch.manual_seed(11)
                emb = ShardedEmbedding(vocab, dim, padding_idx=1 if case == "padding_repeats" else None, process_group=group)
                g = torch.Generator().manual_seed(100 + rank)
                ids = torch.randint(0, vocab, (4, 7), generator=g)
                if case == "padding_repeats":
                    ids[:, ::2] = 1
                    ids[1] = ids[0]
                if case == "empty_rank" and rank == members - 1:
                    ids = ids[:0]
                if case == "two_lookups":
                    ya, yb = emb.forward_many([ids[:2], ids[2:, :5]])
                    y = torch.cat([ya.reshape(-1, dim), yb.reshape(-1, dim)])
                else:
                    y = emb(ids).reshape(-1, dim)
                coef = torch.randn(y.shape, generator=g)
                (y * coef).sum().backward()
                got[mode] = (y.detach(), emb.weight.grad.clone())
            results[f"{label}/{case}"] = {
                "forward_identical": torch.equal(got["0"][0], got["1"][0]),
                "grad_identical": torch.equal(got["0"][1], got["1"][1]),
                "grad_nonzero": bool(got["1"][1].abs().sum() > 0),
            }
    return results


@needs_native
def test_sharded_embedding_native_equals_reference_on_2_and_3_ranks():
    per_rank = run_ranks(native_vs_reference_rank, 3, timeout_s=150)
    assert [len(r) for r in per_rank] == [8, 8, 4]
    for rank, per_case in enumerate(per_rank):
        for case, r in per_case.items():
            assert r == {"forward_identical": True, "grad_identical": True, "grad_nonzero": True}, (rank, case, r)


# ----------------------------------------------------------------- GPU twins (issue: CUDA kernels)
def dense_edges_twin(ids: torch.Tensor, boundaries) -> list:
    """The CUDA dense path's count formula in PyTorch (mark, inclusive prefix sum, one edge
    per boundary: ``edges_kernel``), for every boundary of any world size."""
    lo, hi = int(ids.min()), int(ids.max())
    slot = torch.zeros(hi - lo + 1, dtype=torch.int32)
    slot[ids - lo] = 1
    pos = torch.cumsum(slot, 0)
    edges = []
    for b in boundaries:
        off = b - lo
        edges.append(0 if off <= 0 else int(pos[-1] if off >= pos.numel() else pos[off - 1]))
    return [edges[r + 1] - edges[r] for r in range(len(boundaries) - 1)]


@needs_native
@pytest.mark.parametrize("world", [1024, 1025, 2048, 3001])
def test_dedup_counts_at_world_1024_and_beyond(world):
    """Counts per owner for 1024+ owners (one CUDA block held at most 1024 edges): the
    native CPU op under each method, and the CUDA dense formula's twin, against the reference."""
    vocab = 7 * world + 5  # uneven shards
    gen = torch.Generator().manual_seed(world)
    bounds = ShardPlan(vocab, world).boundaries
    ids = torch.cat([torch.randint(0, vocab, (3000,), generator=gen), torch.tensor([0, vocab - 1])])
    ref = N.dedup_bucket_reference(ids, bounds)
    assert len(ref.send_counts) == world and sum(ref.send_counts) == ref.unique_ids.numel()
    assert ref.send_counts[-1] > 0 and ref.send_counts[0] > 0  # owners past 1024 hold ids
    for method in (0, 1, 2):
        nat = N.dedup_bucket_native(ids, bounds, method)
        assert nat.send_counts == ref.send_counts, method
        assert same_bits(nat.unique_ids, ref.unique_ids) and same_bits(nat.inverse, ref.inverse), method
    assert dense_edges_twin(ids, bounds) == ref.send_counts


@needs_native
def test_sparse_ids_of_a_large_vocabulary_take_the_sort_path():
    """Two ids 2^30 apart: the dense table would need 2^30 flags. Auto and sort dedup
    them; a forced dense table beyond its bound is refused for the sort too (same result)."""
    vocab = 2**31 - 2
    bounds = ShardPlan(vocab, 4).boundaries
    ids = torch.tensor([5, 2**30 + 7, 5, vocab - 1])
    ref = N.dedup_bucket_reference(ids, bounds)
    for method in (0, 1, 2):
        nat = N.dedup_bucket_native(ids, bounds, method)
        assert same_bits(nat.unique_ids, ref.unique_ids) and nat.send_counts == ref.send_counts


@needs_native
def test_bad_row_index_raises_the_package_error():
    """gather/scatter: a bad index raises RowIndexError (an InvalidIdError and an
    IndexError) with the op's message, which the CUDA kernels repeat."""
    from embrace_fairseq import InvalidIdError

    table = torch.randn(5, 3)
    with pytest.raises(N.RowIndexError, match=r"^gather_rows: index 7 out of range for a table of 5 rows$") as e:
        N.gather_rows_native(table, torch.tensor([0, 7]))
    assert isinstance(e.value, InvalidIdError) and isinstance(e.value, IndexError)
    with pytest.raises(N.RowIndexError, match=r"^gather_rows: index -1 out of range for a table of 5 rows$"):
        N.gather_rows_native(torch.zeros(5, 0), torch.tensor([-1]))
    with pytest.raises(N.RowIndexError, match=r"^scatter_add_rows: index 4 out of range for 4 rows$"):
        N.scatter_add_rows_native(torch.randn(3, 2), torch.tensor([0, 4, 1]), 4)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rows_are_scaled_before_rounding(dtype):
    """An owner sums 4 ranks' rows of 40000 (fp16 max 65504) with scale 1/4: the average
    40000 is representable, the sum is not. Native and reference alike."""
    src = torch.full((4, 3), 40000.0).to(dtype)
    index = torch.zeros(4, dtype=torch.long)
    want = torch.full((2, 3), 40000.0).to(dtype)
    want[1] = 0
    for got in (N.scatter_add_rows_reference(src, index, 2, 0.25), N.scatter_add_rows_native(src, index, 2, 0.25)):
        assert torch.isfinite(got.float()).all() and same_bits(got, want)
