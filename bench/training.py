"""Sections 2, 3 and 4: fairseq-train's throughput and memory beside the stock transformer's, and
translation quality within a CPU budget; the data they train on."""

import json
import os
import random
import re
import statistics
import subprocess
import sys


from common import BIN, ROOT, sig


# ------------------------------------------------------ 2./4. throughput, memory
def model_flags(dims):
    layers, d, ffn, heads = dims
    return ["--encoder-layers", layers, "--decoder-layers", layers, "--encoder-embed-dim", d,
            "--decoder-embed-dim", d, "--encoder-ffn-embed-dim", ffn, "--decoder-ffn-embed-dim", ffn,
            "--encoder-attention-heads", heads, "--decoder-attention-heads", heads]


def train_command(data, save_dir, variant, dims, seed, extra):
    if variant == "stock-ln":
        arch = ["--arch", "transformer_iwslt_de_en", "--encoder-normalize-before", "--decoder-normalize-before"]
    else:
        arch = ["--user-dir", str(ROOT / "powernorm_fairseq"), "--arch", "powernorm_transformer_iwslt_de_en",
                "--norm-type", variant]
    return [str(BIN / "fairseq-train"), str(data), *arch, *map(str, model_flags(dims)),
            "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.002",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "300", "--dropout", "0.2",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "2048",
            "--seed", str(seed), "--save-dir", str(save_dir), "--log-format", "json", "--log-interval", "10",
            "--num-workers", "0", "--cpu", *map(str, extra)]


def run_training(cmd, cuda=False):
    """Run fairseq-train in a child process; return its log and its peak memory (MiB):
    resident memory on the CPU, torch.cuda.max_memory_allocated on a GPU."""
    peak_kib = ("torch.cuda.max_memory_allocated() // 1024" if cuda
                else "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss")
    code = ("import resource, sys\n"
            "import torch\n"
            "from fairseq_cli.train import cli_main\n"
            # the plugin's clean exit also for stock runs (see powernorm_fairseq/patches/shutdown.py)
            "from powernorm_fairseq.patches.shutdown import install\n"
            "install()\n"
            f"sys.argv = {cmd!r}\n"
            "try:\n    cli_main()\n"
            f"finally:\n    print('PEAK_KIB', {peak_kib}, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-train failed:\n{proc.stderr[-3000:]}")
    peak = int(re.search(r"PEAK_KIB (\d+)", proc.stdout).group(1)) / 1024
    return proc.stdout + proc.stderr, peak


def words_per_second(log, skip=1):
    """Median words/s of the logged intervals after the first (start-up), or the epoch's."""
    rows = [json.loads(m) for m in re.findall(r"\| train_inner \| (\{.*\})", log)]
    rows = rows[skip:] or [json.loads(m) for m in re.findall(r"\| train \| (\{.*\})", log)]
    return statistics.median(float(r.get("wps", r.get("train_wps"))) for r in rows)


#: what a throughput run of PN measures: its Algorithm-2 phase, which is most of a
#: training run. Runs this short would otherwise fall wholly in its warmup
#: (``--pn-warmup-updates``, by default ``--warmup-updates``), where PN's forward
#: uses the batch's statistics as pn-v's does: the pn-v row is that phase's cost.
PN_STEADY = ("--pn-warmup-updates", "0")


def throughput_flags(variant):
    """fairseq-train flags of one throughput run beyond its model's."""
    return PN_STEADY if variant == "pn" else ()


def _run_name(name, row):
    """A throughput row's name, with the flags its run added (older rows record none)."""
    return f"{name} (`{row['flags']}`)" if row.get("flags") else name


def bench_throughput(data, work, variants, dims, updates, rounds):
    """Words/s and peak memory of fairseq-train per norm, interleaved with stock LN."""
    results = {v: {"wps": [], "peak_mib": []} for v in variants}
    for r in range(rounds):
        order = variants[:]
        random.Random(r).shuffle(order)
        for v in order:
            cmd = train_command(data, work / f"tp-{v}-{r}", v, dims, 1,
                                ["--max-update", updates, "--no-save", "--disable-validation",
                                 *throughput_flags(v)])
            log, peak = run_training(cmd)
            results[v]["wps"].append(words_per_second(log))
            results[v]["peak_mib"].append(peak)
    base_wps = statistics.median(results["stock-ln"]["wps"])
    base_mem = statistics.median(results["stock-ln"]["peak_mib"])
    return [dict(variant=v, flags=" ".join(throughput_flags(v)),
                 wps=round(statistics.median(r["wps"]), 1),
                 wps_ratio=round(statistics.median(r["wps"]) / base_wps, 3),
                 peak_mib=round(statistics.median(r["peak_mib"]), 1),
                 memory_ratio=round(statistics.median(r["peak_mib"]) / base_mem, 3))
            for v, r in results.items()]


def gpu_train_command(data, save_dir, variant, max_tokens, updates):
    """The paper's IWSLT14 model at full size, --fp16, on one GPU."""
    if variant == "stock-ln":
        arch = ["--arch", "transformer_iwslt_de_en", "--encoder-normalize-before", "--decoder-normalize-before"]
    else:
        arch = ["--user-dir", str(ROOT / "powernorm_fairseq"), "--arch", "powernorm_transformer_iwslt_de_en",
                "--norm-type", variant]
    return [str(BIN / "fairseq-train"), str(data), *arch, "--share-all-embeddings", "--fp16",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.0015",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "8000", "--dropout", "0.3",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", str(max_tokens), "--max-update", str(updates), "--seed", "1",
            "--save-dir", str(save_dir), "--no-save", "--disable-validation", "--log-format", "json",
            "--log-interval", "10", "--num-workers", "0", *throughput_flags(variant)]


def bench_train_gpu(data, work, variants, token_sizes, updates, rounds):
    """fairseq-train --fp16 words/s (median over the second half of the logged
    intervals) and peak GPU memory of each variant over stock LN, runs
    interleaved in shuffled order, each round repeating every pair."""
    rows = []
    for max_tokens in token_sizes:
        runs = {v: {"wps": [], "peak_mib": []} for v in variants}
        for r in range(rounds):
            order = variants[:]
            random.Random(r).shuffle(order)
            for v in order:
                cmd = gpu_train_command(data, work / f"gpu-{v}-{max_tokens}-{r}", v, max_tokens, updates)
                log, peak = run_training(cmd, cuda=True)
                intervals = [json.loads(m) for m in re.findall(r"\| train_inner \| (\{.*\})", log)]
                if len(intervals) < 2:
                    raise RuntimeError(f"{v} at {max_tokens} tokens logged {len(intervals)} intervals")
                second_half = intervals[len(intervals) // 2:]
                runs[v]["wps"].append(statistics.median(float(i["wps"]) for i in second_half))
                runs[v]["peak_mib"].append(peak)
        base = {key: statistics.median(runs["stock-ln"][key]) for key in ("wps", "peak_mib")}
        for v in variants:
            if v == "stock-ln":
                continue
            wps, mem = statistics.median(runs[v]["wps"]), statistics.median(runs[v]["peak_mib"])
            rows.append(dict(norm=v, flags=" ".join(throughput_flags(v)), max_tokens=max_tokens,
                             precision="fp16", updates=updates, rounds=rounds,
                             wps=sig(wps), stock_wps=sig(base["wps"]), wps_ratio=sig(wps / base["wps"]),
                             peak_mib=sig(mem), stock_peak_mib=sig(base["peak_mib"]),
                             mem_ratio=sig(mem / base["peak_mib"])))
    return rows


# ---------------------------------------------------------------- 3. quality
def bench_quality(corpus, work, norms, seeds, minutes, dims, extra=()):
    """BLEU of each encoder norm after a fixed CPU time budget, several seeds."""
    data = prepare(corpus, work / "data")
    rows = []
    for seed in seeds:
        for norm in norms:
            save = work / f"q-{norm}-seed{seed}"
            cmd = train_command(data / "bin", save, norm, dims, seed,
                                ["--stop-time-hours", minutes / 60, "--keep-last-epochs", "3", *extra])
            log, _ = run_training(cmd)
            updates = max([int(m) for m in re.findall(r'"(?:train_)?num_updates": "(\d+)"', log)] or [0])
            epochs = sorted(save.glob("checkpoint[0-9]*.pt"))
            average = min(3, len(epochs)) or 1
            ev = subprocess.run(["bash", str(ROOT / "scripts/evaluate.sh"), "--dataset", "quickstart",
                                 "--data", str(data / "bin"), "--save-dir", str(save), "--average", str(average),
                                 "--cpu"], capture_output=True, text=True,
                                env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
            if ev.returncode != 0:
                raise RuntimeError(f"evaluate.sh failed:\n{ev.stderr[-2000:]}")
            result = json.loads((save / "bleu-test.json").read_text())
            rows.append(dict(norm=norm, seed=seed, updates=updates, bleu=result["bleu"][0],
                             sacrebleu=result["sacrebleu"][0], checkpoints_averaged=average,
                             signature=result["sacrebleu_signature"]))
    summary = []
    for norm in norms:
        scores = [r["sacrebleu"] for r in rows if r["norm"] == norm]
        tok = [r["bleu"] for r in rows if r["norm"] == norm]
        summary.append(dict(norm=norm, seeds=len(scores), sacrebleu_mean=round(statistics.mean(scores), 2),
                            sacrebleu_std=round(statistics.stdev(scores), 2) if len(scores) > 1 else 0.0,
                            bleu_mean=round(statistics.mean(tok), 2),
                            bleu_std=round(statistics.stdev(tok), 2) if len(tok) > 1 else 0.0))
    return rows, summary


def prepare(corpus, out):
    """Tokenize, BPE and binarize a raw {train,valid,test}.{de,en} directory."""
    subprocess.run(["bash", str(ROOT / "data-prep/prepare-quickstart.sh"), "--src-dir", str(corpus),
                    "--out", str(out)], check=True, capture_output=True,
                   env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    return out
