"""Section 6: what a step costs the host (``powernorm_fairseq/measure/host.py``), on the Triton path
with launches replaced by nothing, on the CPU backend, and on Triton's real launch path with the
stand-in driver (``measure/standin.py``)."""

import json
import os
import subprocess
import sys


from common import ROOT


# ---------------------------------------------------------------- 6. host
#: the fused kinds and what each may cost the host against nn.LayerNorm's step (calls, time)
HOST_KINDS = ["pn", "bn", "pn-v", "scalenorm", "rmsnorm", "dyt", "derf"]
HOST_TARGETS = {"calls": 2.0, "time": {"pn": 1.3, "scalenorm": 1.3, "rmsnorm": 1.3, "dyt": 1.3, "derf": 1.3,
                                       "bn": 1.5, "pn-v": 1.5}}


#: the CPU gate under the stand-in driver: a step / nn.LayerNorm's step, and Python calls / LayerNorm's
STANDIN_TARGETS = {"step": {"pn": 1.5, "bn": 1.7, "pn-v": 1.7, "scalenorm": 1.2, "rmsnorm": 1.2, "dyt": 1.2,
                            "derf": 1.2},
                   "calls": 1.3}


def bench_host_standin(rounds=20, reps=40):
    """Each fused kind's training step on Triton's real CUDA launch path with
    a stand-in driver (measure/standin.py), beside nn.LayerNorm's step, at
    4 x 4 x 64 and 8 x 8 x 64, the median of ``rounds`` and their least: in a fresh process,
    which does not interpret the kernels."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "powernorm_fairseq.measure.standin", "--rounds", str(rounds),
                           "--reps", str(reps), "--kinds", *HOST_KINDS], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"bench: the stand-in driver's run failed: {proc.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(proc.stdout)
    for r in rows:
        r.update(step_target=STANDIN_TARGETS["step"][r["kind"]], calls_target=STANDIN_TARGETS["calls"])
    return rows


def bench_host(rounds=20, reps=40):
    """A training step's host cost (measure/host.py): the Triton path with
    every launch replaced by nothing, and the CPU backend as it runs, each
    beside nn.LayerNorm's step in the same harness, at 4 x 4 x 64."""
    from powernorm_fairseq.measure import host

    rows = []
    for backend in ("triton", "cpu"):
        measured = host.measure(HOST_KINDS, backend, rounds, reps)
        ln_calls = measured["nn.LayerNorm"][0]
        for kind in HOST_KINDS:
            calls, time_ratio, _ = measured[kind]
            rows.append(dict(backend=backend, norm=kind, calls=calls, ln_calls=ln_calls,
                             calls_ratio=round(calls / ln_calls, 2), time_ratio=round(time_ratio, 2),
                             calls_target=HOST_TARGETS["calls"], time_target=HOST_TARGETS["time"][kind]))
    return rows
