"""Every benchmark runs on a tiny size and writes its table, JSON and plots
(speed itself is measured by bench/run.py, never asserted in tests)."""

import json
import subprocess
import sys

from conftest import ROOT
from powernorm_fairseq.norms import NORM_TYPES


def test_every_benchmark_runs_on_a_tiny_size(toy_data, tmp_path):
    corpus = toy_data.parent  # raw train/valid/test.{de,en}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--tiny", "--out", str(tmp_path),
         "--corpus", str(corpus), "--seeds", "1", "--quality-norms", "ln,pn"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    layers = results["layers"]
    assert {(r["norm"], r["dtype"]) for r in layers} == {(k, d) for k in NORM_TYPES for d in ("float32", "bfloat16")}
    assert all(r["ratio_to_ln"] > 0 and r["gb_per_s"] > 0 for r in layers)
    assert [r["variant"] for r in results["throughput"]] == ["stock-ln", *NORM_TYPES]
    assert all(r["wps"] > 0 and r["peak_mib"] > 100 for r in results["throughput"])
    assert [r["norm"] for r in results["quality"]["summary"]] == ["ln", "pn"]
    assert all(r["updates"] > 0 for r in results["quality"]["runs"])
    table = (tmp_path / "results.md").read_text()
    for heading in ("### 1. Norm layer", "### 2 and 4.", "### 3. Translation quality"):
        assert heading in table
    for png in ("layers.png", "throughput_memory.png", "quality.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
