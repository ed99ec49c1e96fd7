"""Every benchmark runs on a tiny size and writes its table, JSON and plots
(speed itself is measured by bench/run.py, never asserted in tests)."""

import json
import os
import re
import subprocess
import sys

import pytest

from support import ROOT
from powernorm_fairseq.norms import NORM_TYPES

pytestmark = pytest.mark.fast


@pytest.mark.slow
def test_every_benchmark_runs_on_a_tiny_size(toy_data, tmp_path):
    """Every section at its smallest: the throughput and quality runs for PN
    only (each norm trains through fairseq-train in test_cli.py; the default
    list of runs is checked below)."""
    corpus = toy_data.parent  # raw train/valid/test.{de,en}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--tiny", "--out", str(tmp_path),
         "--corpus", str(corpus), "--seeds", "1", "--quality-norms", "pn", "--throughput-norms", "pn"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    layers = results["layers"]
    timed = [*NORM_TYPES, "torch BatchNorm1d", "torch F.rms_norm"]  # with torch's own beside them
    assert {(r["norm"], r["dtype"]) for r in layers} == {(k, d) for k in timed for d in ("float32", "bfloat16")}
    assert all(r["ratio_to_ln"] > 0 and (r["gbps"] is None) == (r["norm"] == "none") for r in layers)
    assert all(r["gbps"] > 0 for r in layers if r["norm"] != "none")
    launched = results["launches"]
    assert all(r["host_waits"] == 0 and r["cpu_host_waits"] == 0 for r in launched)
    assert all(r["launches"] <= r["target"] and r["spill_bytes"] == 0 for r in launched if r["target"])
    assert [r["variant"] for r in results["throughput"]] == ["stock-ln", "pn"]
    # PN's throughput is its Algorithm-2 phase's: a run this short would otherwise be all warmup
    assert [r["flags"] for r in results["throughput"]] == ["", "--pn-warmup-updates 0"]
    assert all(r["wps"] > 0 and r["peak_mib"] > 100 for r in results["throughput"])
    assert [r["norm"] for r in results["quality"]["summary"]] == ["pn"]
    assert all(r["updates"] > 0 for r in results["quality"]["runs"])
    table = (tmp_path / "results.md").read_text()
    for heading in ("### 1. Norm layer", "### 2 and 4.", "### 3. Translation quality", "### 5. Launches",
                    "### 6. Host cost"):
        assert heading in table
    assert {(r["backend"], r["norm"]) for r in results["host"]} == {
        (b, k) for b in ("triton", "cpu") for k in ("pn", "bn", "pn-v", "scalenorm", "rmsnorm", "dyt", "derf")}
    assert {(r["kind"], r["shape"]) for r in results["host_standin"]} == {
        (k, s) for k in ("pn", "bn", "pn-v", "scalenorm", "rmsnorm", "dyt", "derf") for s in ("4x4x64", "8x8x64")}
    assert all(r["step_ratio"] > 0 and r["calls_ratio"] > 0 and r["launches"] >= 2 for r in results["host_standin"])
    assert "stand-in driver" in table and "| kind | shape | step / LN (median) | least | python calls / LN |" in table
    assert "| pn (`--pn-warmup-updates 0`) |" in table
    assert table.count("\n\nMachine: ") == 5 == len(results["machines"])  # each section names its machine
    report = table + (tmp_path / "results.json").read_text()
    assert all(path not in report for path in (str(ROOT), str(corpus), str(tmp_path)))  # no machine's path
    for png in ("layers.png", "throughput_memory.png", "quality.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.fast
def test_the_throughput_section_runs_every_norm_by_default():
    sys.path.insert(0, str(ROOT / "bench"))
    import common
    import run as bench

    p = bench.parser()
    assert common.norm_list(p, "--throughput-norms", p.parse_args([]).throughput_norms) == list(NORM_TYPES)
    with pytest.raises(SystemExit):
        common.norm_list(p, "--throughput-norms", "pn,layer")


@pytest.mark.slow
def test_gpu_benchmark_refuses_a_machine_without_cuda(tmp_path):
    """On any machine: a GPU there is hidden from the run."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--device", "cuda", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--device cuda: no CUDA device is visible "
                                                         "(torch.cuda.is_available() is False)")
    assert not (tmp_path / "results-cuda.json").exists()


@pytest.mark.slow  # matplotlib's import and six plots: 1.7 s
def test_gpu_report_marks_each_target_met_or_missed(tmp_path):
    """The GPU tables and plots from results in the documented JSON shape,
    each section under the device that measured it (a run of one section
    keeps the other's rows)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import common
    import report

    layers = [dict(norm=k, dtype=d, shape=s, ratio_to_ln=1.2 if k == "pn" else 1.6, ms=0.1, ln_ms=0.07, gbps=900.0,
                   fraction_of_bandwidth=0.3, target=common.layer_target("cuda", d, k))
              for k in NORM_TYPES for d in ("float32", "float16") for s in ("64x64x512", "128x128x1024")]
    train = [dict(norm=k, max_tokens=t, precision="fp16", updates=500, rounds=2, wps=9000.0, stock_wps=10000.0,
                  wps_ratio=0.9 if t == 4096 else 0.97, peak_mib=1000.0, stock_peak_mib=1000.0, mem_ratio=1.0)
             for k in ("ln", "pn") for t in (4096, 16384)]
    results = dict(layers=layers, train=train, copy_bandwidth_gb_s=3000.0)
    for section, device in (("layers", "NVIDIA H100"), ("train", "NVIDIA H200")):
        common.ran_on(results, [section], dict(device=device, torch="2.x", triton="3.x", cuda="12", python="3.12",
                                              date="today", backend="triton"))
    table = report.gpu_markdown(results)
    devices = [line.split(",")[0] for line in table.splitlines() if line.startswith(("###", "Device:"))]
    assert devices == ["### 1. Norm layer on the GPU", "Device: NVIDIA H100",
                       "### 2. `fairseq-train --fp16` words/s and peak GPU memory", "Device: NVIDIA H200"]
    pn_rows = [line for line in table.splitlines() if line.startswith("| float") and "| pn |" in line]
    assert len(pn_rows) == 4 and all(line.endswith("<= 1.3 met |") for line in pn_rows)
    bn_rows = [line for line in table.splitlines() if "| bn |" in line]
    assert bn_rows and all(line.endswith("<= 1.5 **missed** |") for line in bn_rows)
    train_rows = [line for line in table.splitlines() if line.startswith("| pn | ")]
    assert [r.endswith("**missed** |") for r in train_rows] == [True, False]
    report.gpu_plots(results, tmp_path)
    for png in ("layers-cuda.png", "train-cuda.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_training_rows_of_one_size_replace_only_that_size():
    sys.path.insert(0, str(ROOT / "bench"))
    import common as bench

    old = [dict(norm=k, max_tokens=t, wps_ratio=0.5) for k in ("ln", "pn") for t in (4096, 16384)]
    new = [dict(norm=k, max_tokens=16384, wps_ratio=0.9) for k in ("ln", "pn")]
    merged = bench.merge_rows(old, new, ("norm", "max_tokens"))
    assert [(r["norm"], r["max_tokens"], r["wps_ratio"]) for r in merged] == [
        ("ln", 4096, 0.5), ("pn", 4096, 0.5), ("ln", 16384, 0.9), ("pn", 16384, 0.9)]


def test_the_gpu_training_runs_time_pn_after_its_warmup():
    """A run of 100-500 updates lies wholly in PN's warmup (the learning rate's,
    8,000 updates), where its forward is pn-v's: PN's own row turns it off, no other row."""
    sys.path.insert(0, str(ROOT / "bench"))
    import training as bench

    def flag(variant):
        cmd = bench.gpu_train_command(ROOT, ROOT, variant, 4096, 100)
        return cmd[cmd.index("--pn-warmup-updates") + 1] if "--pn-warmup-updates" in cmd else None
    assert [flag(v) for v in ("stock-ln", "ln", "pn", "pn-v", "bn")] == [None, None, "0", None, None]


@pytest.mark.slow
def test_the_gpu_script_keeps_its_deadline_and_returns_what_it_wrote(tmp_path):
    """bench/gpu.sh, here with a .gpu that sets nothing up and no GPU: each
    step ends within what is left of the deadline, or is skipped, and the
    results and logs land in $OUT; without .gpu it stops in one line."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv", "build", "data", "out", "*.so",
                                                                "__pycache__", "third_party"))
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "bench/gpu.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "bench/gpu.sh: no .gpu here: cp -r ../shared/gpu .gpu, and carry it"], proc.stderr
    (repo / ".gpu").mkdir()
    (repo / ".gpu" / "setup.sh").write_text("sleep 3\n")
    (repo / ".gpu" / "env.sh").write_text("export PYTHONPATH=$PWD\n")
    out = tmp_path / "out"
    subprocess.run(["bash", "bench/gpu.sh"], cwd=repo, env=dict(env, OUT=str(out), DEADLINE="22"),
                   capture_output=True, text=True, timeout=120)
    steps = (out / "steps.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in steps[:-1]] == ["== setup", "== build", "== tests", "== layers",
                                                          "== device", "== train"], steps
    # the limit is what the deadline left when the step started: a loaded machine may have spent a second
    assert re.fullmatch(r"== setup: exit 0 after [34] s \(limit 2[12] s\)", steps[0]), steps
    assert all(line.endswith("s left") and "skipped" in line for line in steps[1:6]), steps  # under 20 s left
    assert steps[-1].startswith("== total ") and int(steps[-1].split()[2]) <= 22, steps
    assert (out / "results-cuda.json").exists() and (out / "setup.log").exists()


def test_the_device_only_table_has_the_columns_a_gpu_run_fills():
    """bench/run.py --device cuda --sections device writes its rows under a
    "Device-only" heading with the issue's columns, each fused kind at
    128x128x1024 held to half the copy bandwidth (a GPU run fills it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import launches
    finally:
        sys.path.remove(str(ROOT / "bench"))
    rows = [dict(dtype="float16", shape="128x128x1024", norm=n, host_us=30.0, device_ms=0.2, gbps=1600.0,
                 of_copy=share) for n, share in (("ln", 0.7), ("pn", 0.55), ("bn", 0.31))]
    text = "\n".join(launches.device_markdown(rows))
    columns = "| dtype | shape | norm | device ms | GB/s | of copy bandwidth |"
    assert text.startswith("### Device-only") and columns in text
    assert "| float16 | 128x128x1024 | pn | 0.2 | 1600.0 | 55% (met) |" in text, text
    assert "| bn | 0.2 | 1600.0 | 31% **(missed)** |" in text and "| ln | 0.2 | 1600.0 | 70% |" in text
