"""results.md and the figures, from results.json (the CPU's and, with ``--device cuda``, the GPU's)."""

from common import (GPU_CALLS, TARGETS, _layer_rows, _layer_targets, _machine_line, _met, _pyplot, _save,
                    _speed_and_memory)
from hostcost import STANDIN_TARGETS
from launches import device_markdown
from training import _run_name
from powernorm_fairseq.norms import NORM_TYPES


def gpu_markdown(results):
    out = []
    if results.get("layers"):
        out += ["### 1. Norm layer on the GPU, forward + backward, relative to `F.layer_norm`", "",
                _machine_line(results, "layers"), "",
                f"20% padding; median of interleaved pairs, each the mean of {GPU_CALLS} calls timed with CUDA "
                f"events; copy bandwidth {results['copy_bandwidth_gb_s']} GB/s; bytes = 5 x tensor.", "",
                *_layer_rows(results["layers"], 3, copy=False), ""]
    if results.get("device"):
        out += [_machine_line(results, "device"), "", *device_markdown(results["device"])]
    if results.get("train"):
        out += ["### 2. `fairseq-train --fp16` words/s and peak GPU memory, relative to stock "
                "`transformer_iwslt_de_en` (pre-norm LN)", "",
                _machine_line(results, "train"), "",
                "Full-size model (6+6 layers, 512 dims); words/s is the median of the logged intervals over the "
                "second half of each run; peak memory is `torch.cuda.max_memory_allocated`; runs interleaved in "
                "shuffled order, median over rounds.", "",
                "| encoder norm | tokens per batch | updates x rounds | words/s | / stock | peak MiB | / stock "
                "| target (pn) |",
                "|---|---|---|---|---|---|---|---|"]
        for r in results["train"]:
            met = ""
            if r["norm"] == "pn":
                ok = r["wps_ratio"] >= TARGETS["throughput"] and r["mem_ratio"] <= TARGETS["memory"]
                met = f">= {TARGETS['throughput']}, <= {TARGETS['memory']} " + ("met" if ok else "**missed**")
            out.append(f"| {_run_name(r['norm'], r)} | {r['max_tokens']} | {r['updates']} x {r['rounds']} | "
                       f"{r['wps']} | {r['wps_ratio']:.3f} | {r['peak_mib']} | {r['mem_ratio']:.3f} | {met} |")
        out.append("")
    return "\n".join(out)


def gpu_plots(results, out):
    plt = _pyplot()
    if results.get("layers"):
        rows = results["layers"]
        panels = sorted({(r["dtype"], r["shape"]) for r in rows})
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.5), sharey=True, squeeze=False)
        for ax, (dtype, shape) in zip(axes[0], panels):
            vals = [next(r["ratio_to_ln"] for r in rows if (r["dtype"], r["shape"], r["norm"]) == (dtype, shape, k))
                    for k in NORM_TYPES]
            ax.bar(range(len(NORM_TYPES)), vals, color="tab:blue")
            _layer_targets(ax, 0.4, 0.4)
            ax.set_xticks(range(len(NORM_TYPES)), NORM_TYPES, rotation=60, fontsize=8)
            ax.set_title(f"{dtype}, {shape}")
        axes[0][0].set_ylabel("forward + backward time / LayerNorm (ratio)")
        device = results.get("machines", {}).get("layers", {}).get("device", "a GPU not recorded")
        fig.suptitle(f"Norm layer cost on {device}, 20% padding")
        _save(plt, fig, out / "layers-cuda.png")
    if results.get("train"):
        rows = results["train"]
        _speed_and_memory(plt, [f"{r['norm']}\n{r['max_tokens']}" for r in rows], rows, "mem_ratio",
                          "fairseq-train --fp16 throughput", "peak GPU memory (max_memory_allocated)",
                          "peak GPU memory", "encoder norm, tokens per batch", out / "train-cuda.png")


def markdown(results):
    out = []
    if "layers" in results:
        bw = results["layers_bandwidth_gb_s"]
        out += ["### 1. Norm layer, forward + backward, relative to `F.layer_norm`", "",
                _machine_line(results, "layers"), "",
                "20% padding, median of interleaved pairs, glibc's allocator thresholds fixed (steady_allocator); "
                f"memory bandwidth (large copy) {bw} GB/s; "
                "bytes = 5 x tensor (read x, write y; read x and dy, write dx); 'of copy' is against "
                "the best copy of a tensor of the layer's own size (copy GB/s).", "",
                *_layer_rows(results["layers"], 2, copy=True), ""]
    if "launches" in results:
        out += ["### 5. Launches, host waits, bytes and registers per training step of one layer", "",
                _machine_line(results, "launches"), "",
                f"Forward + backward, T x B x C = {results.get('launches_shape', '512x8x512')}, 20% padding, "
                "float16 on the Triton path "
                "(counted under Triton's interpreter: what a GPU would be sent; measure/launches.py), "
                "after the first step. Activation tensors: (N, C) tensors the kernels read or write "
                "(LayerNorm's minimum: 5). Registers and spills: the largest over the sm_90 builds of "
                "the kernels launched (measure/sm90.py); programs/SM: how many the grid launches per "
                "multiprocessor; all resident: whether every kernel's registers allow that many at once. "
                "Busiest / mean: the bytes the busiest program moves over the mean program's, the largest "
                "over the launches of a step at 128 x 128 x 1024, modelled from the plans (sm90.balance).", "",
                "| norm | launches | Triton kernels | host waits (triton / cpu) | activation tensors | "
                "registers | spill bytes | programs/SM | all resident | resident warps/SM (least) | "
                "programs per launch | busiest / mean | launch target |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["launches"]:
            met = _met(r["launches"], r["target"])
            resident = {True: "yes", False: "**no**"}.get(r.get("all_resident"), "")
            warps = r.get("resident_warps")
            warps = "" if warps is None else f"{warps}" + (" **< 32**" if warps < 32 else "")
            busiest = r.get("busiest_to_mean")
            busiest = "" if busiest is None else f"{busiest}" + (" **> 2**" if busiest > 2 else "")
            out.append(f"| {r['norm']} | {r['launches']} | {r['kernels']} | {r['host_waits']} / "
                       f"{r['cpu_host_waits']} | {r['activation_tensors']} | {r.get('max_registers', '')} | "
                       f"{r.get('spill_bytes', '')} | {r.get('programs_per_sm', '')} | {resident} | {warps} | "
                       f"{r.get('programs', '')} | {busiest} | {met} |")
        out.append("")
    if "host" in results:
        out += ["### 6. Host cost of a training step of one layer, relative to `nn.LayerNorm`'s", "",
                _machine_line(results, "host"), "",
                "Forward + backward at 4 x 4 x 64 (T x B x C), one token of padding (measure/host.py): "
                "the Triton path under Triton's interpreter with every launch replaced by nothing (the host "
                "code that drives a GPU), the CPU backend as it runs. Calls: sys.setprofile's call and c_call "
                "events of one step; time: the median over interleaved rounds (LN, kind, kind, LN).", "",
                "| backend | norm | calls | / LN | time / LN | calls target | time target |",
                "|---|---|---|---|---|---|---|"]
        for r in results["host"]:
            out.append(f"| {r['backend']} | {r['norm']} | {r['calls']} | {r['calls_ratio']:.2f} | "
                       f"{r['time_ratio']:.2f} | {_met(r['calls_ratio'], r['calls_target'])} | "
                       f"{_met(r['time_ratio'], r['time_target'])} |")
        out.append("")
    if "host_standin" in results:
        rows = results["host_standin"]
        out += ["#### The Triton path on Triton's real launch code, under a stand-in driver", "",
                "Forward + backward of one layer, one token of padding, on Triton's CUDA launch path with a "
                "stand-in libcuda that records each launch and runs nothing (measure/standin.py; kernels "
                "compiled for sm_90), beside `nn.LayerNorm`'s step in the same run: the median of "
                f"{results.get('host_rounds', 20)} interleaved rounds (LN, kind, kind, LN), which the gate holds, "
                "beside their least.", "",
                "| kind | shape | step / LN (median) | least | python calls / LN |", "|---|---|---|---|---|"]
        for r in rows:
            least = r.get("step_least", float("nan"))
            out.append(f"| {r['kind']} | {r['shape']} | {r['step_ratio']:.2f} | {least:.2f} | {r['calls_ratio']:.2f} |")
        missed = [f"{r['kind']} {r['shape']}" for r in rows
                  if r["step_ratio"] > r["step_target"] or r["calls_ratio"] > r["calls_target"]]
        out += ["", "The gate: a step within " + ", ".join(f"{k} {v}x" for k, v in STANDIN_TARGETS["step"].items())
                + f" of LayerNorm's, and calls within {STANDIN_TARGETS['calls']}x: "
                + (f"missed by {', '.join(missed)}." if missed else "met by every row."), ""]
    if "throughput" in results:
        out += ["### 2 and 4. `fairseq-train` words/s and peak memory, relative to stock "
                "`transformer_iwslt_de_en` (LN)", "",
                _machine_line(results, "throughput"), "",
                f"Model {results['dims']}, interleaved runs, median; peak memory is the process's peak RSS.", "",
                "| variant | words/s | / stock LN | peak MiB | / stock LN |", "|---|---|---|---|---|"]
        for r in results["throughput"]:
            out.append(f"| {_run_name(r['variant'], r)} | {r['wps']} | {r['wps_ratio']:.3f} | {r['peak_mib']} | "
                       f"{r['memory_ratio']:.3f} |")
        out += ["", f"Targets: `--norm-type pn` words/s >= {TARGETS['throughput']} x stock, "
                    f"memory <= {TARGETS['memory']} x stock.", ""]
    if "quality" in results:
        q = results["quality"]
        out += ["### 3. Translation quality at a fixed CPU budget", "",
                _machine_line(results, "quality"), "",
                f"Corpus {q['corpus']}, {q['minutes']} CPU minutes per run, seeds {q['seeds']}, "
                f"last <= 3 epoch checkpoints averaged; mean +- standard deviation over seeds.", "",
                "| encoder norm | sacreBLEU | tokenized BLEU (case-insens.) |", "|---|---|---|"]
        for r in q["summary"]:
            out.append(f"| {r['norm']} | {r['sacrebleu_mean']:.2f} +- {r['sacrebleu_std']:.2f} | "
                       f"{r['bleu_mean']:.2f} +- {r['bleu_std']:.2f} |")
        out += ["", "| norm | seed | updates | sacreBLEU | tokenized BLEU |", "|---|---|---|---|---|"]
        for r in q["runs"]:
            out.append(f"| {r['norm']} | {r['seed']} | {r['updates']} | {r['sacrebleu']} | {r['bleu']} |")
        out += ["", f"sacreBLEU signature: `{q['runs'][0]['signature']}`", ""]
    return "\n".join(out)


def plots(results, out):
    plt = _pyplot()
    if "layers" in results:
        rows = [r for r in results["layers"] if r["dtype"] == "float32"]
        shapes = sorted({r["shape"] for r in rows})
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(shapes)
        for i, shape in enumerate(shapes):
            vals = [next(r["ratio_to_ln"] for r in rows if r["shape"] == shape and r["norm"] == k) for k in NORM_TYPES]
            ax.bar([j + i * width for j in range(len(NORM_TYPES))], vals, width, label=f"(T, B, C) = {shape}")
        _layer_targets(ax, 0.1, 0.8, TARGETS["layers"]["cuda"])
        ax.set_yscale("log")  # the per-token norms of the plain path sit an order of magnitude above the rest
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(NORM_TYPES))], NORM_TYPES, rotation=45, ha="right")
        ax.set_ylabel("fwd + bwd time / LayerNorm (log scale)")
        ax.set_title("Norm layer cost on the CPU, float32, 20% padding")
        ax.legend()
        _save(plt, fig, out / "layers.png")
    if "throughput" in results:
        rows = results["throughput"]
        _speed_and_memory(plt, [r["variant"] for r in rows], rows, "memory_ratio", "fairseq-train throughput",
                          "fairseq-train peak memory (RSS)", "peak memory",
                          "encoder norm (stock-ln: fairseq's transformer)", out / "throughput_memory.png", 20)
    if "quality" in results:
        q = results["quality"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        names = [r["norm"] for r in q["summary"]]
        ax.bar(names, [r["sacrebleu_mean"] for r in q["summary"]],
               yerr=[r["sacrebleu_std"] for r in q["summary"]], capsize=6, color="tab:green", alpha=0.7,
               label="mean +- std over seeds")
        for r in q["runs"]:
            ax.plot(names.index(r["norm"]), r["sacrebleu"], "ko", markersize=4)
        ax.plot([], [], "ko", markersize=4, label="one seed")
        ax.set_xlabel("encoder norm (decoder: LN)")
        ax.set_ylabel("sacreBLEU (detokenized)")
        ax.set_title(f"BLEU after {q['minutes']} CPU minutes per run")
        ax.legend()
        _save(plt, fig, out / "quality.png")
