"""The memory-trace report: JSON, HTML and PyTorch memory snapshot agree with the ledger."""

from __future__ import annotations

import json
import os
import pickle
import pickletools
from collections import Counter
from html import escape
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.cuda import _memory_viz

import chunkmem
from chunkmem.chunk import ChunkKind
from chunkmem.config import Config
from chunkmem.errors import ConfigError
from chunkmem.ledger import WORKSPACE, Ledger
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.report import write_report
from chunkmem.report.html_page import MAX_POINTS, render_html
from chunkmem.report.memory_trace import SCHEMA, build_memory_trace
from chunkmem.report.snapshot import build_snapshot
from chunkmem.report.svg import format_bytes
from chunkmem.report.timeline import place_moments
from tests.reference import token_batches, train_engine

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
ODD_NAME = 'gpt<b>&"q"'  # a legal module name that is also HTML markup
ODD_LABEL = f"fwd:{ODD_NAME}.blocks.0.attn.qkv"
KINDS = {kind.value for kind in ChunkKind.all()} | {WORKSPACE}
# Opcodes the unpickler inside MemoryViz.js (pytorch.org/memory_viz) implements.
MEMORY_VIZ_JS_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
    "LONG_BINGET", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND",
    "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE",
    "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE",
    "BINUNICODE",
}  # fmt: skip


class OddlyNamed(nn.Module):
    """A GPT registered under a name that needs escaping, so its labels test the HTML."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module(ODD_NAME, GPT(SMALL))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return getattr(self, ODD_NAME)(idx, targets)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[chunkmem.Engine, dict[str, Path]]:
    """Three bf16 steps on a simulated device that holds under half the model state."""
    torch.manual_seed(0)
    capacity = int(SMALL.num_parameters() * 14 * 0.45)
    engine = chunkmem.initialize(
        OddlyNamed(),
        config={
            "device": {"type": "simulated", "capacity": capacity},
            "precision": "bf16",
            "placement": {"unit_elements": 1},  # a moment per module: many labels to escape
        },
    )
    train_engine(engine, token_batches(3, 2, 16, SMALL.vocab_size))
    return engine, engine.write_report(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def doc(run: tuple[chunkmem.Engine, dict[str, Path]]) -> dict[str, Any]:
    return json.loads(run[1]["json"].read_text())


@pytest.fixture(scope="module")
def snapshot(run: tuple[chunkmem.Engine, dict[str, Path]]) -> dict[str, Any]:
    with open(run[1]["snapshot"], "rb") as file:
        return pickle.load(file)


def nonzero(by_kind: dict[str, int]) -> dict[str, int]:
    return {kind: nbytes for kind, nbytes in by_kind.items() if nbytes}


def device_total(by_kind: dict[str, int], nonmodel: int) -> int:
    return sum(by_kind.values()) + nonmodel


def replay(entries: list[dict[str, Any]]) -> list[int]:
    """Allocated bytes before each entry and after the last (memory_viz's own arithmetic)."""
    totals = [0]
    for entry in entries:
        change = {"alloc": entry["size"], "free_completed": -entry["size"]}
        totals.append(totals[-1] + change.get(entry["action"], 0))
    return totals


# ---------------------------------------------------------------- files
def test_each_format_is_written_once_under_its_name_and_no_temporary_file_remains(run) -> None:
    _engine, paths = run
    assert {name: path.name for name, path in paths.items()} == {
        "json": "memory_trace.json",
        "html": "memory_trace.html",
        "snapshot": "memory_snapshot.pickle",
    }
    directory = paths["json"].parent
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in paths.values())


def test_unknown_format_is_rejected_before_anything_is_written(run, tmp_path: Path) -> None:
    engine, _paths = run
    target = tmp_path / "report"
    with pytest.raises(ConfigError, match=r"'pdf'.*\['html', 'json', 'snapshot'\]"):
        write_report(engine.run_summary(), engine.ledger, target, ["json", "pdf"])
    assert not target.exists()


def test_failed_write_keeps_the_previous_file_and_removes_its_temporary(
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _paths = run
    (tmp_path / "memory_trace.json").write_text("previous report")

    def disk_full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_report(engine.run_summary(), engine.ledger, tmp_path, ["json"])
    assert [p.name for p in tmp_path.iterdir()] == ["memory_trace.json"]
    assert (tmp_path / "memory_trace.json").read_text() == "previous report"


# ---------------------------------------------------------------- JSON
def test_json_moments_are_the_ledger_samples_and_stay_within_capacity(run, doc) -> None:
    engine, _paths = run
    samples = engine.ledger.moment_samples
    capacity = engine.ledger.device.capacity
    assert doc["schema"] == SCHEMA
    assert len(doc["moments"]) == len(samples) > 0
    for moment, sample in zip(doc["moments"], samples, strict=True):
        assert (moment["iteration"], moment["index"], moment["label"]) == (
            sample.iteration,
            sample.index,
            sample.label,
        )
        assert nonzero(moment["device"]["by_kind"]) == nonzero(sample.by_tier["device"])
        assert moment["device"]["nonmodel"] == sample.nonmodel
        assert nonzero(moment["host"]["by_kind"]) == nonzero(sample.by_tier["host"])
        assert device_total(moment["device"]["by_kind"], moment["device"]["nonmodel"]) <= capacity
        assert all(type(v) is int for v in moment["device"]["by_kind"].values())
    assert ODD_LABEL in {m["label"] for m in doc["moments"]}


def test_json_moves_add_up_to_the_ledger_bytes_moved_per_iteration(run, doc) -> None:
    engine, _paths = run
    ledger = engine.ledger
    assert doc["moves_dropped"] == 0
    directions = Counter(move["direction"] for move in doc["moves"])
    assert directions["to_device"] > 0 and directions["to_host"] > 0  # the capacity forced moves
    moved: Counter[int] = Counter()
    for move in doc["moves"]:
        moved[move["iteration"]] += move["nbytes"]
    iterations = ledger.iterations_with_moves()
    assert iterations == sorted(moved) == [0, 1, 2]
    for iteration in iterations:
        assert moved[iteration] == ledger.bytes_moved(iteration)
    into = ledger.bytes_into
    assert doc["bytes_moved"] == [
        {"iteration": i, "to_device": into("device", i), "to_host": into("host", i)}
        for i in iterations
    ]


def test_every_json_move_has_a_valid_direction_and_kind(doc) -> None:
    assert doc["moves"]
    for move in doc["moves"]:
        assert {move["src"], move["dst"]} == {"device", "host"}
        assert move["direction"] == f"to_{move['dst']}"
        assert move["kind"] in KINDS
        assert type(move["nbytes"]) is int and move["nbytes"] > 0


def test_json_summary_reports_the_engine_and_the_config_reloads(run, doc) -> None:
    engine, _paths = run
    summary = doc["summary"]
    device = engine.ledger.device
    assert summary["tiers"]["device"] == {
        "capacity": device.capacity,
        "peak": device.peak,
        "peak_model": device.peak_model,
        "used_now": device.used,
    }
    assert 0 < summary["tiers"]["device"]["peak"] <= device.capacity
    assert summary["model_state_bytes"] == engine.model_state_bytes()
    assert summary["chunks"] == json.loads(json.dumps(engine.chunk_summary()))
    layouts = engine.params.trainable_layouts()
    assert sum(summary["optimizer_state_homes"].values()) == len(layouts)
    padding = sum(layout.padding for layout in engine.params.layouts)
    assert summary["padding_bytes"] >= padding * 2  # at least the bf16 parameter chunks
    assert (summary["global_steps"], summary["iterations"], summary["precision"]) == (3, 3, "bf16")
    assert summary["tracer"]["cycles_recorded"] == engine.tracer.cycles_recorded >= 1
    assert Config.from_dict(doc["config"]) == engine.config


# ---------------------------------------------------------------- HTML
def test_html_is_self_contained_and_escapes_module_labels(run) -> None:
    html = run[1]["html"].read_text()
    assert html.count("<svg") == 3  # device, host, bytes moved
    for reference in ("http://", "https://", "<script", "<link", "@import", "url("):
        assert reference not in html
    assert "fwd:gpt&lt;b&gt;&amp;&quot;q&quot;.blocks.0.attn.qkv" in html
    assert ODD_NAME not in html
    assert f"capacity {format_bytes(run[0].ledger.device.capacity)}</text>" in html


def test_html_move_tables_count_every_recorded_move(run) -> None:
    engine, paths = run
    html = paths["html"].read_text()
    whole_run: Counter[tuple[str, str, str]] = Counter()
    whole_run_bytes: Counter[tuple[str, str, str]] = Counter()
    for move in engine.ledger.moves:
        key = (f"to_{move.dst}", move.kind, move.reason)
        whole_run[key] += 1
        whole_run_bytes[key] += move.nbytes
    assert len(whole_run) > 1
    for key, count in whole_run.items():
        cells = "".join(f"<td>{value}</td>" for value in key)
        assert (
            f'<tr>{cells}<td class="n">{count:,}</td><td class="n">{whole_run_bytes[key]:,}</td></tr>'
            in html
        )
    assert f"First {len(engine.ledger.moves)} of {len(engine.ledger.moves)} recorded moves" in html


def test_html_of_a_long_run_keeps_peaks_and_says_it_shows_fewer_moments(doc) -> None:
    long_doc = dict(doc, moments=doc["moments"] * 20)  # 20 x 117 moments > MAX_POINTS
    peak = max(doc["moments"], key=lambda m: device_total(**m["device"]))
    html = render_html(long_doc)
    device_chart = html[html.index("<svg") : html.index("</svg>")]
    assert device_chart.count("<title>iteration ") <= MAX_POINTS
    assert (
        f"Showing {device_chart.count('<title>iteration '):,} of {len(long_doc['moments']):,}"
        in html
    )
    assert escape(f"moment {peak['index']}: {peak['label']}") in device_chart
    assert len(html) < 1_500_000


# ---------------------------------------------------------------- snapshot
def test_memory_viz_reads_the_snapshot(snapshot) -> None:
    def as_text(lines: str) -> str:  # instead of flamegraph.pl, which memory_viz downloads
        return lines

    assert "total_reserved" in _memory_viz.segsum(snapshot)
    assert "entries" in _memory_viz.trace(snapshot)
    for page in (_memory_viz.trace_plot(snapshot), _memory_viz.segment_plot(snapshot)):
        assert "add_local_files" in page
    _memory_viz.memory(snapshot, format_flamegraph=as_text)
    _memory_viz.segments(snapshot, format_flamegraph=as_text)
    _memory_viz.compare(snapshot["segments"], snapshot["segments"], format_flamegraph=as_text)


def test_replaying_the_snapshot_gives_the_ledger_device_bytes_at_every_moment(
    run, snapshot
) -> None:
    engine, _paths = run
    ledger = engine.ledger
    samples = ledger.moment_samples
    entries = snapshot["device_traces"][0]
    moments = snapshot["chunkmem"]["moments"]
    assert snapshot["chunkmem"]["moments_omitted"] == 0
    assert [(m["iteration"], m["index"], m["label"]) for m in moments] == [
        (s.iteration, s.index, s.label) for s in samples
    ]
    totals = replay(entries)
    for moment, sample in zip(moments, samples, strict=True):
        expected = device_total(sample.by_tier["device"], sample.nonmodel)
        assert totals[moment["trace_index"]] == expected, moment
    assert any(s.nonmodel and sum(s.by_tier["device"].values()) for s in samples)
    assert totals[-1] == ledger.device.used
    assert sum(segment["allocated_size"] for segment in snapshot["segments"]) == totals[-1]


def test_snapshot_blocks_never_overlap_and_a_chunk_keeps_its_address(snapshot) -> None:
    live: dict[int, int] = {}
    address_of: dict[str, set[int]] = {}
    for entry in snapshot["device_traces"][0]:
        if entry["action"] == "alloc":
            start, end = entry["addr"], entry["addr"] + entry["size"]
            assert all(end <= a or a + s <= start for a, s in live.items()), entry
            assert end < 2**53  # exact as a JavaScript number
            live[entry["addr"]] = entry["size"]
            owner = entry["frames"][0]["name"].split(" @ ")[0]
            address_of.setdefault(owner, set()).add(entry["addr"])
        elif entry["action"] == "free_completed":
            assert live.pop(entry["addr"]) == entry["size"]
    chunks = {owner: addrs for owner, addrs in address_of.items() if " chunk " in owner}
    assert chunks and all(len(addrs) == 1 for addrs in chunks.values())


def test_snapshot_pickle_uses_only_what_memory_viz_js_can_unpickle(run, snapshot) -> None:
    data = run[1]["snapshot"].read_bytes()
    opcodes = {opcode.name for opcode, _arg, _pos in pickletools.genops(data)}
    assert opcodes <= MEMORY_VIZ_JS_OPCODES, opcodes - MEMORY_VIZ_JS_OPCODES
    assert data[1] <= 4  # protocol byte after PROTO
    categories = {e["category"] for e in snapshot["device_traces"][0]}
    # MemoryViz.js throws when categories are used but "unknown" is not among them.
    assert {"unknown", "param", "activations"} <= categories


# ---------------------------------------------------------------- placing moments
def test_moments_are_placed_exactly_when_labels_repeat_and_a_run_sums_to_zero() -> None:
    # Three samples labelled "a" in a row: placing sample 1 at the last position with its bytes
    # (after the zero-sum alloc/free of chunk 1) would leave no position for sample 2.
    ledger = Ledger({"device": 1000, "host": None})
    ledger.sample_moment(0, "fwd:a")
    ledger.allocate("device", "param", 10, "x", "chunk 0")
    ledger.sample_moment(1, "fwd:a")
    ledger.allocate("device", "param", 5, "y", "chunk 1")
    ledger.sample_moment(2, "fwd:a")
    ledger.free("device", "param", 5, "chunk 1")
    ledger.set_nonmodel(7)
    ledger.sample_moment(3, "fwd:b")
    assert place_moments(ledger.allocations, ledger.moment_samples) == [0, 1, 2, 3]
    snapshot = build_snapshot(ledger)
    totals = replay(snapshot["device_traces"][0])
    assert [totals[m["trace_index"]] for m in snapshot["chunkmem"]["moments"]] == [0, 10, 15, 17]


def test_snapshot_stops_at_the_last_moment_its_recorded_allocations_support() -> None:
    # The cap of 3 keeps samples m0..m2 and the allocations c0a, c0b, c1a: the state at m1 is
    # fully known, the one at m2 needs the dropped c1b, and m3 was never sampled.
    ledger = Ledger({"device": 1000, "host": None}, max_move_events=3)
    for index in range(4):
        ledger.sample_moment(index, f"fwd:m{index}")
        ledger.allocate("device", "param", 10, "x", f"chunk {index}a")
        ledger.allocate("device", "param", 10, "x", f"chunk {index}b")
    assert ledger.allocations_dropped == 5 and ledger.moment_samples_dropped == 1
    snapshot = build_snapshot(ledger)
    assert [m["label"] for m in snapshot["chunkmem"]["moments"]] == ["fwd:m0", "fwd:m1"]
    assert snapshot["chunkmem"]["moments_omitted"] == 1
    assert snapshot["chunkmem"]["allocations_dropped"] == 5


def test_memory_trace_of_an_engine_that_never_ran_is_valid(tmp_path: Path) -> None:
    engine = chunkmem.initialize(
        GPT(SMALL), config={"device": {"type": "simulated", "capacity": 10**6}}
    )
    doc = build_memory_trace(engine.run_summary(), engine.ledger)
    assert (doc["moments"], doc["moves"], doc["bytes_moved"]) == ([], [], [])
    assert doc["summary"]["optimizer_state_homes"] is None
    paths = write_report(
        engine.run_summary(), engine.ledger, tmp_path, ["json", "html", "snapshot"]
    )
    assert "No moment was recorded" in paths["html"].read_text()
    assert pickle.loads(paths["snapshot"].read_bytes())["device_traces"] == [[]]
