"""The native Adam over rows by address (``kernels.host_optim.adam_rows_``) and the chunk
pieces' addresses it takes (``chunkmem.pieces.addresses``, through ``chunkmem.host_rows`` in an
update): the bits of the tensor kernel on views of the same rows, the outputs' version counters
bumped, and bad rows refused."""

from __future__ import annotations

import pytest
import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.host_rows import HostRows, RowsCache, written_tensors
from chunkmem.pieces import addresses, owned_pieces, spans
from kernels import host_optim
from tests.kernels_helpers import assert_same_bits

BF16, F32 = torch.bfloat16, torch.float32
ADAM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
SIZES = [(7,), (13, 3), (1000,), (29,)]  # rows of a few elements and of several vector steps


def _chunks(dtype_of: dict[ChunkKind, torch.dtype], seed: int) -> tuple[ChunkLayout, dict]:
    """A layout of SIZES' slots and a chunk of each kind over its elements 5..end (a piece
    of the first slot, whole slots after it), payloads of random values (positive for the
    second moment)."""
    layout = ChunkLayout(0, 1200, trainable=True)
    for index, shape in enumerate(SIZES):
        layout.add(f"p{index}", torch.nn.Parameter(torch.empty(shape)))
    start = 5
    numel = layout.used - start
    generator = torch.Generator().manual_seed(seed)
    chunks = {}
    for chunk_id, (kind, dtype) in enumerate(dtype_of.items()):
        chunk = Chunk(chunk_id, layout, kind, dtype, start=start, numel=numel)
        values = torch.randn(numel, generator=generator)
        chunk.payload = (values.abs() if kind == ChunkKind.EXP_AVG_SQ else values).to(dtype)
        chunks[kind] = chunk
    return layout, chunks


def _step(chunks, pieces, by_address: bool, grads, shadows=None, saves=None, norms=None):
    """One AdamW step over the pieces: by address, or the tensor kernel on their views."""
    master, param = chunks[ChunkKind.MASTER], chunks[ChunkKind.PARAM]
    moments = [chunks[ChunkKind.EXP_AVG], chunks[ChunkKind.EXP_AVG_SQ]]
    steps = [torch.tensor(float(3 * i + 1)) for i in range(len(pieces))]
    kinds = [ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ]
    if by_address:
        new = None
        if shadows is not None:
            new = tuple(addresses(chunks[k], pieces, shadows[k]) for k in kinds)
        rows = host_optim.AdamRows(
            params=addresses(master, pieces),
            grads=[g.data_ptr() for g in grads],
            exp_avgs=addresses(moments[0], pieces),
            exp_avg_sqs=addresses(moments[1], pieces),
            steps=[s.data_ptr() for s in steps],
            numels=[hi - lo for _s, lo, hi in pieces],
            params_out=addresses(param, pieces),
            new_states=new,
            grads_saved=None if saves is None else [s.data_ptr() for s in saves],
        )
        types = host_optim.RowTypes(params=F32, grads=grads[0].dtype, states=F32, out=BF16)
        written = [shadows[k] for k in kinds] if shadows else [master.payload]
        host_optim.adam_rows_(rows, types, **ADAM, decoupled=True, grad_norms=norms,
                              written=[*written, param.payload], num_threads=1)  # fmt: skip
    else:
        new = None
        if shadows is not None:
            new = host_optim.NewStates(*(spans(chunks[k], pieces, shadows[k]) for k in kinds))
        host_optim.fused_adamw_(
            spans(master, pieces), grads, *(spans(m, pieces) for m in moments), [], steps,
            **ADAM, params_out=spans(param, pieces), new_states=new, grads_saved=saves,
            grad_norms=norms, num_threads=1,
        )  # fmt: skip


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in_place", "out_of_place"])
def test_rows_by_address_give_the_tensor_kernels_bits(out_of_place):
    kinds = {ChunkKind.MASTER: F32, ChunkKind.PARAM: BF16, ChunkKind.EXP_AVG: F32,
             ChunkKind.EXP_AVG_SQ: F32}  # fmt: skip
    results = []
    for by_address in (True, False):
        layout, chunks = _chunks(kinds, seed=1)
        pieces = owned_pieces(layout, (chunks[ChunkKind.MASTER].start, layout.used - 5), False)
        assert pieces[0][1] == 5  # the first slot is a piece from element 5
        generator = torch.Generator().manual_seed(2)
        grads = [torch.randn(hi - lo, generator=generator).to(BF16) for _s, lo, hi in pieces]
        shadows = None
        if out_of_place:
            shadows = {k: torch.full_like(chunks[k].payload, float("nan"))
                       for k in (ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)}  # fmt: skip
        saves = [torch.full_like(g, float("nan")) for g in grads]
        norms = torch.full((len(pieces),), float("nan"))
        _step(chunks, pieces, by_address, grads, shadows, saves, norms)
        outputs = [chunks[ChunkKind.PARAM].payload, *saves, norms]
        if shadows is None:
            outputs += [chunks[k].payload for k in kinds if k != ChunkKind.PARAM]
        else:
            outputs += list(shadows.values())
        results.append(outputs)
    for index, (by_address, by_views) in enumerate(zip(*results, strict=True)):
        assert_same_bits(by_address, by_views, f"output {index}")


def test_rows_by_address_bump_what_they_write():
    kinds = {ChunkKind.MASTER: F32, ChunkKind.PARAM: BF16, ChunkKind.EXP_AVG: F32,
             ChunkKind.EXP_AVG_SQ: F32}  # fmt: skip
    layout, chunks = _chunks(kinds, seed=3)
    pieces = owned_pieces(layout, (5, layout.used - 5), False)
    grads = [torch.ones(hi - lo, dtype=BF16) for _s, lo, hi in pieces]
    view = chunks[ChunkKind.PARAM].span(*pieces[1])
    before = view._version
    _step(chunks, pieces, True, grads)
    assert view._version > before


def test_addresses_are_the_views_data_pointers_and_refuse_bad_buffers():
    layout, chunks = _chunks({ChunkKind.MASTER: F32}, seed=4)
    master = chunks[ChunkKind.MASTER]
    pieces = owned_pieces(layout, (5, layout.used - 5), False)
    assert addresses(master, pieces) == [v.data_ptr() for v in spans(master, pieces)]
    shadow = torch.zeros_like(master.payload)
    assert addresses(master, pieces, shadow) == [
        v.data_ptr() for v in spans(master, pieces, shadow)
    ]
    with pytest.raises(TypeError, match="is torch.bfloat16, not torch.float32"):
        addresses(master, pieces, shadow.to(BF16))
    with pytest.raises(IndexError, match=r"p3\[0:29\] lies outside"):
        addresses(master, pieces, shadow[:-1])
    with pytest.raises(ValueError, match="flat contiguous"):
        addresses(master, pieces, torch.zeros(2, master.numel)[:, 0])
    master.payload = None
    with pytest.raises(RuntimeError, match="has no payload"):
        addresses(master, pieces)


def test_a_host_updates_rows_name_a_chunk_without_payload():
    """Built through the cache as an update builds them: a chunk whose payload is gone (it
    must be fetched first) is named, before the written buffers are checked."""
    kinds = {ChunkKind.MASTER: F32, ChunkKind.PARAM: BF16, ChunkKind.EXP_AVG: F32,
             ChunkKind.EXP_AVG_SQ: F32}  # fmt: skip
    layout, chunks = _chunks(kinds, seed=5)
    pieces = owned_pieces(layout, (5, layout.used - 5), False)
    grads = [torch.ones(hi - lo, dtype=BF16) for _s, lo, hi in pieces]
    steps = [torch.tensor(1.0) for _ in pieces]
    moments = (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)
    chunks[ChunkKind.EXP_AVG_SQ].payload = None
    written = written_tensors(chunks, ChunkKind.MASTER, moments, None, None, {})

    def build() -> HostRows:
        return HostRows(host_optim, chunks, ChunkKind.MASTER, moments, pieces, grads, None,
                        None, {}, steps, written, {0: list(range(len(pieces)))})  # fmt: skip

    buffers = [*(chunks[k].payload for k in (ChunkKind.MASTER, *moments)), *written]
    with pytest.raises(RuntimeError, match=r"id=3, exp_avg_sq.*has no payload"):
        RowsCache().rows(layout.index, build, buffers, pieces, grads, None, steps)


def _rows(count: int, **changes) -> host_optim.AdamRows:
    rows = host_optim.AdamRows(*([1] * count for _ in range(6)))
    return rows._replace(**changes)


@pytest.mark.parametrize(
    "rows, types, error, match",
    [
        (_rows(2), host_optim.RowTypes(BF16, BF16, F32), TypeError, "params must be float32"),
        (_rows(2), host_optim.RowTypes(F32, torch.int32, F32), TypeError, "grads must be one of"),
        (_rows(2), host_optim.RowTypes(F32, BF16, torch.float16), TypeError,
         "exp_avgs and exp_avg_sqs must be one of"),
        (_rows(2), host_optim.RowTypes(F32, BF16, F32, BF16), ValueError,
         "params_out rows and their dtype come together"),
        (_rows(2, grads=[1]), host_optim.RowTypes(F32, BF16, F32), ValueError,
         "grads has 1 rows but numels has 2"),
        (_rows(2, exp_avgs=[1, None]), host_optim.RowTypes(F32, BF16, F32), ValueError,
         "exp_avgs has a null row"),
        (_rows(2, new_states=([1, 1], [1], [1, 1])), host_optim.RowTypes(F32, BF16, F32),
         ValueError, "new exp_avgs has 1 rows"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused_before_the_native_call(rows, types, error, match):
    with pytest.raises(error, match=match):
        host_optim.adam_rows_(rows, types, **ADAM, decoupled=True, written=[])
