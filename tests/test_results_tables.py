"""The figures of README.md and docs/ are rendered from benchmarks/results/*.jsonl
(benchmarks/render_tables.py, `make tables`), and stay so."""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "render_tables", ROOT / "benchmarks" / "render_tables.py"
)
render_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_tables)

NUMBER = (int, float, type(None))
TEXT = (str, type(None))
SCHEMA = {
    "table": str, "row": str, "what": str, "system": str, "model": str, "precision": str,
    "batch": (int, type(None)), "sentences_per_s": NUMBER, "tokens_per_s": NUMBER,
    "ms_per_step": NUMBER, "peak_mib": NUMBER, "ratio": (dict, type(None)),
    "same_as_reference": TEXT, "command": str, "commit": TEXT, "date": TEXT, "device": str,
    "host_cpu": TEXT, "cpu_flags": TEXT, "kernels": TEXT,
}  # fmt: skip


def test_every_rendered_table_in_the_tree_is_what_the_results_render():
    assert render_tables.out_of_date(ROOT) == []


def test_readme_and_performance_page_show_a_table_per_device():
    for page in ("README.md", "docs/performance.md"):
        tables = {m[2] for m in render_tables.BLOCK.finditer((ROOT / page).read_text())}
        assert tables == {"cpu-avx512", "cpu-avx2", "gpu"}, page


def test_every_record_has_the_schema_fields():
    records = render_tables.load_records(ROOT)
    # a device each: the CPU with AVX-512 (and its AVX2 runs), a CPU with AMX, the GPUs (H100
    # and H200)
    assert {r["table"] for r in records} == {"cpu-avx512", "cpu-avx2", "cpu-amx", "gpu", "gpu-h200"}
    for record in records:
        for field, kind in SCHEMA.items():
            assert isinstance(record[field], kind), (field, record)
        if record["ratio"] is not None:
            assert set(record["ratio"]) == {"against", "value"}, record
        if record["batch"] is None:
            assert record["batch_label"], record
        if record["date"] is not None:
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", record["date"]), record


def test_a_figure_edited_by_hand_is_found_and_rendered_back(tmp_path):
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    readme = (ROOT / "README.md").read_text()
    (tmp_path / "README.md").write_text(readme.replace(" sent/s", "0 sent/s", 1))
    assert render_tables.main(["--check", "--root", str(tmp_path)]) == 1
    assert render_tables.out_of_date(tmp_path) != []
    assert render_tables.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == readme
    assert render_tables.main(["--check", "--root", str(tmp_path)]) == 0


def _gpu(system, model, batch, ms, tokens):
    return {
        "table": "gpu", "row": f"{model}-{system}", "what": model, "system": system,
        "model": model, "precision": "fp16", "batch": batch, "sentences_per_s": None,
        "tokens_per_s": tokens, "ms_per_step": ms, "peak_mib": None, "ratio": None,
        "same_as_reference": None, "command": f"bench {model}", "commit": None, "date": None,
        "device": "GPU", "host_cpu": "CPU", "cpu_flags": None, "kernels": None,
    }  # fmt: skip


def test_gpu_records_are_grouped_by_model_batch_and_precision_with_fairseq_as_reference():
    # As the GPU benchmark appends them: a row id per system, ratios left to the renderer.
    records = [
        _gpu("ours graphs", "transformer base", 64, 2.0, 8000.0),
        _gpu("fairseq", "transformer base", 64, 5.0, 3000.0),
        _gpu("ours no graphs", "transformer base", 64, 4.0, 4000.0),
        _gpu("fairseq", "transformer big", 1, 8.0, 100.0),
    ]
    lines = render_tables.render("gpu", records).splitlines()
    assert lines[0] == (
        "| model | precision | batch | fairseq | ours graphs | ours no graphs | command |"
    )
    # one speed a cell: at batch 1 a step's time, else tokens/s (the GPU goals' terms)
    assert lines[2] == (
        "| transformer base | fp16 | 64 | 3,000 tok/s | 8,000 tok/s; x2.50 fairseq "
        "| 4,000 tok/s; x1.25 fairseq | (1) |"
    )
    assert lines[3] == "| transformer big | fp16 | 1 | 8.00 ms/step |  |  | (2) |"
    assert lines[5:] == [
        "1. `bench transformer base` (GPU, host CPU)",
        "2. `bench transformer big` (GPU, host CPU)",
    ]


def test_a_ratio_is_computed_on_a_speed_both_systems_measured():
    fairseq = _gpu("fairseq", "transformer base", 64, None, 3000.0)
    ours = _gpu("ours graphs", "transformer base", 64, 2.0, 6000.0)
    assert render_tables.cell(ours, fairseq) == "6,000 tok/s; x2.00 fairseq"
    assert render_tables.cell(fairseq, fairseq) == "3,000 tok/s"


def test_a_system_measured_again_shows_its_last_record_and_its_run_alone():
    old = _gpu("fairseq", "transformer base", 64, 6.0, 2500.0)
    old["command"], old["commit"] = "bench old", "aaaaaaa"
    new_fairseq = _gpu("fairseq", "transformer base", 64, 5.0, 3000.0)
    ours = _gpu("ours graphs", "transformer base", 64, 2.0, 8000.0)
    lines = render_tables.render("gpu", [old, ours, new_fairseq]).splitlines()
    assert lines[2] == (
        "| transformer base | fp16 | 64 | 3,000 tok/s | 8,000 tok/s; x2.50 fairseq | (1) |"
    )
    assert lines[3:] == ["", "1. `bench transformer base` (GPU, host CPU)"]


def test_a_row_filter_keeps_only_those_rows():
    records = render_tables.load_records(ROOT)
    lines = render_tables.render("cpu-avx512", records, ["demo"]).splitlines()
    assert len(lines) == 5 and lines[2].startswith("| make demo from a fresh clone")
    assert lines[4].startswith("1. `make demo` (")


@pytest.mark.parametrize("table", ["cpu-avx512", "cpu-avx2", "gpu"])
def test_no_rendered_cell_is_over_200_characters(table):
    text = render_tables.render(table, render_tables.load_records(ROOT))
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    assert max(len(c) for c in cells) <= 200
