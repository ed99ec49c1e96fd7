"""The benchmark suite: norm layers, training throughput, translation quality
and memory, each norm side by side with LayerNorm in one run.

    python bench/run.py [--sections layers,throughput,quality] [--out bench/results]

Writes OUT/results.json, OUT/results.md and one PNG per section. Timings on a
shared machine are noisy, so every comparison is a ratio of runs interleaved
with their LayerNorm baseline, and the median is reported.
"""

import argparse
import json
from pathlib import Path

import torch

from common import ROOT, gpu_machine, machine, merge_rows, norm_list, ran_on
from hostcost import bench_host, bench_host_standin
from launches import bench_device, bench_launches
from layers import bench_layers
from powernorm_fairseq.norms import NORM_TYPES
from report import gpu_markdown, gpu_plots, markdown, plots
from training import bench_quality, bench_throughput, bench_train_gpu, prepare


def main_gpu(p, args, out):
    """``--device cuda``: layer timings and fairseq-train --fp16 runs on the GPU."""
    if not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    sections = set(args.sections.split(","))
    unknown = sections - {"layers", "throughput", "device"}
    if unknown:
        p.error(f"--sections: {', '.join(sorted(unknown))} not available with --device cuda; allowed: layers, "
                "throughput, device (GPU quality runs are the recipes': scripts/train.sh and evaluate.sh)")
    previous = out / "results-cuda.json"
    results = json.loads(previous.read_text()) if previous.exists() else {}
    for key in ("device", "torch", "triton", "cuda", "python", "date", "backend"):
        results.pop(key, None)  # before each section named its own
    if "layers" in sections:
        shapes = [(64, 64, 512), (128, 128, 1024)]
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
        rows, bw = bench_layers(shapes, max(30, args.reps), dtypes, device="cuda")
        results["layers"], results["copy_bandwidth_gb_s"] = rows, round(bw / 1e9, 1)
        ran_on(results, ["layers"], gpu_machine())
    if "device" in sections:
        results["device"] = bench_device([(64, 64, 512), (128, 128, 1024)],
                                         [torch.float32, torch.float16, torch.bfloat16])
        ran_on(results, ["device"], gpu_machine())
    if "throughput" in sections:
        data = prepare(args.corpus, out / "work" / "data")
        sizes = [int(t) for t in args.gpu_tokens.split(",")]
        rows = bench_train_gpu(data / "bin", out / "work", ["stock-ln", "ln", "pn", "pn-v", "bn"],
                               sizes, args.updates or 500, args.rounds)
        results["train"] = merge_rows(results.get("train", []), rows, ("norm", "max_tokens"))
        ran_on(results, ["train"], gpu_machine())
    (out / "results-cuda.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results-cuda.md").write_text(gpu_markdown(results) + "\n")
    gpu_plots(results, out)
    print(gpu_markdown(results))
    print(f"\nwritten: {out}/results-cuda.json, results-cuda.md, *-cuda.png")


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--sections", default="layers,throughput,quality,launches,host",
                   help="comma-separated subset of layers,throughput,quality,launches,host (memory comes with "
                        "throughput)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--corpus", default=str(ROOT / "data-prep" / "quickstart"),
                   help="raw {train,valid,test}.{de,en} for throughput and quality "
                        "(e.g. ../shared/data/l10n-de-en; default: the shipped quickstart corpus)")
    p.add_argument("--seeds", default="1,2", help="seeds of the quality runs")
    p.add_argument("--quality-norms", default="ln,bn,pn-v,pn", help="encoder norms of the quality runs")
    p.add_argument("--throughput-norms", default=",".join(NORM_TYPES),
                   help="encoder norms of the throughput runs (each beside fairseq's stock transformer)")
    p.add_argument("--minutes", type=float, default=3.0, help="CPU minutes per quality run")
    p.add_argument("--reps", type=int, default=60, help="interleaved repetitions per layer timing")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the throughput runs")
    p.add_argument("--updates", type=int, default=None,
                   help="updates per throughput run (default 60 on the CPU, 500 with --device cuda)")
    p.add_argument("--gpu-tokens", default="4096,16384",
                   help="tokens per batch of the --device cuda training rows; a run with some sizes replaces "
                        "those rows in results-cuda.json and keeps the others")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: layer timings in float32/16/bfloat16 and fairseq-train --fp16 runs on the GPU, "
                        "written to results-cuda.{md,json} and *-cuda.png")
    p.add_argument("--tiny", action="store_true", help="tiny sizes, to check that every benchmark runs")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        return main_gpu(p, args, out)
    work = out / "work"
    sections = set(args.sections.split(","))
    unknown = sections - {"layers", "throughput", "quality", "launches", "host"}
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; allowed: layers, throughput, quality, launches, "
                "host")
    dims = (1, 32, 64, 4) if args.tiny else (3, 256, 512, 4)
    # a run of some sections updates those in an existing results.json and keeps the others
    previous = out / "results.json"
    results = json.loads(previous.read_text()) if previous.exists() else {}
    results.pop("machine", None)  # before each section named its own
    ran_on(results, sections, machine())
    if "throughput" in sections:  # the model of its rows
        results["dims"] = "layers {} + {}, {} dims, FFN {}, {} heads".format(dims[0], *dims)
    if "layers" in sections:
        shapes = [(8, 4, 64)] if args.tiny else [(64, 64, 512), (128, 32, 1024)]
        rows, bw = bench_layers(shapes, 3 if args.tiny else args.reps, [torch.float32, torch.bfloat16])
        results["layers"], results["layers_bandwidth_gb_s"] = rows, round(bw / 1e9, 1)
    if "launches" in sections:
        shape = (16, 4, 64) if args.tiny else (512, 8, 512)
        results["launches"], results["launches_shape"] = bench_launches(*shape), "x".join(map(str, shape))
    if "host" in sections:
        rounds = 2 if args.tiny else 20
        results["host"] = bench_host(*((rounds, 4) if args.tiny else (rounds, 40)))
        results["host_standin"] = bench_host_standin(*((rounds, 4) if args.tiny else (rounds, 40)))
        results["host_rounds"] = rounds
    if "throughput" in sections or "quality" in sections:
        data = prepare(args.corpus, work / "data")
    if "throughput" in sections:
        variants = ["stock-ln", *norm_list(p, "--throughput-norms", args.throughput_norms)]
        results["throughput"] = bench_throughput(data / "bin", work, variants, dims,
                                                 4 if args.tiny else args.updates or 60,
                                                 1 if args.tiny else args.rounds)
    if "quality" in sections:
        seeds = [int(s) for s in args.seeds.split(",")]
        norms = norm_list(p, "--quality-norms", args.quality_norms)
        minutes = 0.2 if args.tiny else args.minutes
        extra = ["--max-update", 5] if args.tiny else []  # tiny: whichever comes first
        runs, summary = bench_quality(args.corpus, work, norms, seeds, minutes, dims, extra)
        corpus = Path(args.corpus).resolve()  # named relative to the checkout: results name no machine's path
        corpus = corpus.relative_to(ROOT) if corpus.is_relative_to(ROOT) else corpus.name
        results["quality"] = dict(corpus=str(corpus), minutes=minutes, seeds=seeds, runs=runs, summary=summary)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")
    plots(results, out)
    print(markdown(results))
    print(f"\nwritten: {out}/results.json, results.md, *.png")


if __name__ == "__main__":
    main()
