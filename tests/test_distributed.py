"""--norm-sync: two gloo workers on halves of a batch against one process on the whole of it."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support import backend_or_fail, once, train_args
from powernorm_fairseq.norms import build_norm, kernels

pytestmark = pytest.mark.slow

T, C = 6, 8
# three steps; per step the sentences each worker gets (worker 1 has no real
# tokens in step 1: its sentences are all padding), and the sentence lengths
SPLITS = [([0, 1], [2, 3, 4]), ([0, 1, 2], [3, 4]), ([0], [1, 2, 3, 4])]
LENGTHS = [[6, 2, 5, 1, 3], [4, 6, 3, 0, 0], [1, 6, 6, 2, 4]]
#: bn and pn with unit-offset gains (the synced A, B and nu read 1 + gamma), pn-v and rbn without
OPTIONS = {"bn": dict(unit_offset=True), "pn-v": {},
           "pn": dict(warmup_updates=1, layer_scale=True, groups=2, unit_offset=True)}
#: rbn: bn's kernels, and a penalty whose statistics are the global batch's under sync batch
PENALIZED = {"rbn": dict(penalty_mean=0.3, penalty_var=0.2)}


def steps():
    g = torch.Generator().manual_seed(0)
    for lengths in LENGTHS:
        x = torch.randn(T, len(lengths), C, generator=g, dtype=torch.float64) * 2 + 0.7
        pad = torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]
        grad_y = torch.randn(T, len(lengths), C, generator=g, dtype=torch.float64)
        grad_y[pad.t()] = 0
        yield x, pad, grad_y


def make(kind, sync):
    torch.manual_seed(0)
    norm = build_norm(kind, C, sync=sync, **{**OPTIONS, **PENALIZED}[kind]).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    return norm.train()


def run(norm, rows=None):
    """Per step: output, input gradient and buffers, on ``rows`` (a worker's sentences) or all. An
    rbn penalty enters the loss as fairseq's trainer adds it: 1 / workers of it on each worker."""
    from powernorm_fairseq.norms.rbn import regularization

    out = []
    for t, (x, pad, grad_y) in enumerate(steps()):
        if rows is not None:
            idx = rows[t]
            x, pad, grad_y = x[:, idx], pad[idx], grad_y[:, idx]
        x = x.clone().requires_grad_(True)
        y = norm(x, pad)
        loss, penalty = (y * grad_y).sum(), regularization(norm)
        (loss if penalty is None else loss + penalty / (1 if rows is None else 2)).backward()
        out.append((y.detach(), x.grad, {k: v.clone() for k, v in norm.named_buffers()}))
    return out


#: every (kind, sync, backend) the tests below run on two workers; None: the automatic backend
RUNS = [(kind, sync, backend) for backend in kernels.BACKENDS for sync in ("batch", "running") for kind in OPTIONS]
RUNS += [("rbn", "batch", backend) for backend in kernels.BACKENDS] + [("bn", "none", None)]


def available(backend):
    k = {"cpu": kernels.cpu, "triton": kernels.gpu}.get(backend)
    return k is None or k.available()


def count(norm, backend):
    """After a first step, one training step's all-reduces and host waits, per direction."""
    from powernorm_fairseq.measure import launches

    x, pad, grad_y = next(steps())
    x.requires_grad_(True)
    with kernels.use(backend):
        norm(x, pad).backward(grad_y)
        with launches.counting() as forward:
            y = norm(x, pad)
        with launches.counting() as backward:
            y.backward(grad_y)
    reduces = [sum(op.startswith("allreduce") for op in s.launches) for s in (forward, backward)]
    return {"reduces": reduces, "waits": forward.waits + backward.waits}


def worker(rank, port, path):
    """Every run of RUNS on this worker's sentences, then the kernels' collective counts."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        runs, counts = {}, {}
        for kind, sync, backend in RUNS:
            if available(backend):
                with kernels.use(backend):
                    runs[f"{kind}/{sync}/{backend}"] = run(make(kind, sync), [split[rank] for split in SPLITS])
                if backend in ("cpu", "triton") and sync != "none" and kind in OPTIONS:
                    counts[f"{kind}/{sync}/{backend}"] = count(make(kind, sync), backend)
        torch.save({"runs": runs, "counts": counts}, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """What each of two gloo workers gave, per rank: one start for the module.
    Forks of this process (its imports made, one thread each: OMP_NUM_THREADS
    in conftest.py), not fresh interpreters: 12 CPU-seconds less."""
    def make_all(root):
        import time

        workers = mp.start_processes(worker, args=(free_port(), str(root / "result")), nprocs=2, join=False,
                                     start_method="fork")
        deadline = time.time() + 300  # a fork that inherits a held lock waits for ever: fail, not hang
        while not workers.join(timeout=5):
            if time.time() > deadline:
                for p in workers.processes:
                    p.kill()
                raise AssertionError("the two forked workers did not finish within 300 s")

    root = once(tmp_path_factory, "two-workers", make_all)
    return [torch.load(root / f"result.{r}", weights_only=True) for r in (0, 1)]


def two_workers(spawned, kind, sync, backend=None):
    return [spawned[r]["runs"][f"{kind}/{sync}/{backend}"] for r in (0, 1)]


def close(a, b):
    return torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.fixture(params=kernels.BACKENDS)
def backend(request):
    """The synchronised statistics with each backend forced."""
    backend_or_fail(request.param)
    with kernels.use(request.param):
        yield request.param


@pytest.mark.parametrize("kind", ["bn", "pn-v", "pn", "rbn"])
def test_batch_sync_equals_one_process_on_the_whole_batch(kind, spawned, backend):
    whole = run(make(kind, "batch"))  # one process: no collectives
    halves = two_workers(spawned, kind, "batch", backend)
    for t, (y, grad, buffers) in enumerate(whole):
        (y0, g0, b0), (y1, g1, b1) = halves[0][t], halves[1][t]
        i0, i1 = SPLITS[t]
        assert close(y[:, i0], y0) and close(y[:, i1], y1), f"step {t}: outputs"
        assert close(grad[:, i0], g0) and close(grad[:, i1], g1), f"step {t}: input gradients"
        for name, value in buffers.items():
            assert torch.equal(b0[name], b1[name]), f"step {t}: {name} differs between workers"
            assert close(value.double(), b0[name].double()), f"step {t}: {name}"


@pytest.mark.parametrize("kind", ["bn", "pn-v"])
def test_running_sync_keeps_buffers_global_and_batches_local(kind, spawned, backend):
    whole = run(make(kind, "batch"))
    halves = two_workers(spawned, kind, "running", backend)
    for rank in (0, 1):
        local = run(make(kind, "none"), [split[rank] for split in SPLITS])
        for t in (0, 2):  # step 1: worker 1 has no real tokens and normalises with running statistics
            assert close(local[t][0], halves[rank][t][0]) and close(local[t][1], halves[rank][t][1])
    for t, (_, _, buffers) in enumerate(whole):
        for name, value in buffers.items():
            assert torch.equal(halves[0][t][2][name], halves[1][t][2][name])
            assert close(value, halves[0][t][2][name]), f"step {t}: {name}"


def test_pn_running_sync_keeps_identical_buffers(spawned, backend):
    halves = two_workers(spawned, "pn", "running", backend)
    for t in range(len(SPLITS)):
        for name, value in halves[0][t][2].items():
            assert torch.equal(value, halves[1][t][2][name]), f"step {t}: {name}"
    if backend != "plain":  # and the kernels compute what the plain path does
        plain = two_workers(spawned, "pn", "running", "plain")
        for rank in (0, 1):
            for t in range(len(SPLITS)):
                (y, g, b), (yp, gp, bp) = halves[rank][t], plain[rank][t]
                assert close(y, yp) and close(g, gp), f"rank {rank} step {t}"
                assert all(close(b[k].double(), bp[k].double()) for k in b), f"rank {rank} step {t}"


def test_unsynchronised_workers_drift_apart(spawned):
    """The control: without sync the buffers differ, so the tests above can fail."""
    halves = two_workers(spawned, "bn", "none")
    assert not torch.allclose(halves[0][0][2]["running_mean"], halves[1][0][2]["running_mean"])


@pytest.mark.fast
def test_reference_backward_refuses_sync():
    with pytest.raises(ValueError, match="use sync='none'"):
        build_norm("pn", C, backward="reference", sync="batch")
    assert build_norm("pn", C, backward="reference").sync == "none"
    with pytest.raises(ValueError, match="sync must be one of none, batch, running"):
        build_norm("bn", C, sync="all")


@pytest.mark.parametrize("norm", ["rbn", "pn"])
def test_two_worker_fairseq_train(toy_data, tmp_path, norm):
    """fairseq-train on two CPU processes: gloo, a TCP rendezvous, one process per rank.

    (fairseq's own launchers need CUDA: torchrun's path divides by the GPU
    count and spawning starts one process per GPU.)"""
    port = free_port()
    args = [*train_args(toy_data, tmp_path, "--norm-type", norm, max_update=6), "--cpu",
            "--distributed-world-size", "2", "--distributed-no-spawn", "--distributed-backend", "gloo",
            "--ddp-backend", "legacy_ddp", "--distributed-init-method", f"tcp://127.0.0.1:{port}"]
    import subprocess

    from support import Command

    procs = [Command("fairseq-train", [*args, "--distributed-rank", r], stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT) for r in (0, 1)]
    logs = [p.stdout.read() for p in procs]
    for p in procs:
        p.wait(timeout=300)
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "distributed init (rank 1)" in logs[1] and "num_updates\": \"6\"" in logs[0]
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["model"].norm_sync is None  # the default: batch for bn, rbn, pn-v and pn
    assert ('"rbn_penalty": ' in logs[0]) == (norm == "rbn")  # logged beside the loss


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("sync", ["batch", "running"])
@pytest.mark.parametrize("kind", list(OPTIONS))
def test_synchronised_kernels_reduce_once_per_direction_and_never_wait(kind, sync, backend, spawned):
    backend_or_fail(backend)
    for rank in (0, 1):
        seen = spawned[rank]["counts"][f"{kind}/{sync}/{backend}"]
        assert seen["waits"] == [], seen
        assert all(n <= 1 for n in seen["reduces"]) and seen["reduces"][0] == 1, seen
