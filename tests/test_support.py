"""The suite's own machinery (``support/``): a command run through the fork
server behaves as the same console script started afresh, and the toy
corpora are what the tests take them to be."""

import os
import signal
import subprocess
import sys
import time

import pytest
from support import (BIN, ROOT, Command, cli, commands, interpreter, lm_corpus, norm_query, processes_mentioning,
                     stand_ins, toy_corpus)

from powernorm_fairseq.norms import NORM_TYPES

pytestmark = pytest.mark.slow


def fresh(tool, *args, cwd, env=None):
    return subprocess.run([str(BIN / tool), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args", [("--format", "markdown"), ("--format", "html")], ids=["ok", "bad-flag"])
def test_a_forked_command_is_the_fresh_one(args, tmp_path):
    """Output, errors and exit status of a fork equal those of a fresh process."""
    forked, started = cli("powernorm-flags", *args, check=False, cwd=tmp_path), fresh("powernorm-flags", *args,
                                                                                       cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (started.returncode, started.stdout, started.stderr)
    assert forked.returncode == (0 if args[1] == "markdown" else 2)


def test_a_forked_fairseq_command_logs_where_a_fresh_one_does(tmp_path):
    """Importing fairseq gives the root logger a handler on stderr, so
    fairseq_cli's logging goes there, not to the stdout its own basicConfig
    names; the fork server imported fairseq before the fork, and a fork keeps
    that handler, on the command's stderr."""
    runs = []
    for name, run in (("forked", cli), ("fresh", fresh)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.txt").write_text("a b c\nb c d\n")
        proc = run("fairseq-preprocess", "--only-source", "--trainpref", "train.txt", "--destdir", "bin",
                   "--workers", "1", cwd=tmp_path / name, env={"PYTHONWARNINGS": "ignore"})
        runs.append((proc.returncode, proc.stdout, proc.stderr))
    assert runs[0] == runs[1] and "INFO:fairseq_cli.preprocess:Wrote preprocessed data to bin" in runs[0][2]


ENDINGS = {
    "returns-none": "return None",
    "returns-3": "return 3",
    "exit-message": "raise SystemExit('no such file: x')",
    "exception": "raise ValueError('bad value')",
    "interrupt": "raise KeyboardInterrupt",
    "atexit-and-thread": ("import atexit, threading, time\n"
                          "    atexit.register(print, 'at exit', flush=False)\n"
                          "    threading.Thread(target=lambda: (time.sleep(0.2), print('thread', end=''))).start()\n"
                          "    print('partial line', end='')\n    return 0"),
}


@pytest.mark.parametrize("ending", ENDINGS.values(), ids=ENDINGS.keys())
def test_a_forked_command_ends_as_the_interpreter_ends(ending, tmp_path):
    """The fork server's ending (support/forkserver.py), against a fresh
    interpreter's own ``sys.exit(main())``: exit status or signal, the
    standard streams, atexit callbacks and threads; a traceback's last line."""
    script = tmp_path / "command.py"
    script.write_text(f"import sys\n\ndef main():\n    print('started', file=sys.stderr)\n    {ending}\n\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    server = commands.Path(commands.__file__).with_name("forkserver.py")
    ended = (f"import runpy, sys\nsys.path.insert(0, {str(server.parent)!r})\nimport forkserver\n"
             f"forkserver.exit_as_the_interpreter(runpy.run_path({str(script)!r}, run_name='command')['main'])\n")
    runs = [subprocess.run([commands.sys.executable, *argv], capture_output=True, text=True, timeout=60)
            for argv in ([str(script)], ["-c", ended])]
    (fresh, forked) = [(r.returncode, r.stdout, r.stderr.strip().splitlines()[-1]) for r in runs]
    assert forked == fresh
    assert fresh[0] == {"returns-3": 3, "exit-message": 1, "exception": 1, "interrupt": -signal.SIGINT}.get(
        next(k for k, v in ENDINGS.items() if v == ending), 0)


def test_a_forked_command_takes_its_directory_and_environment(tmp_path):
    log = "S-0\tdas ist ein haus\nT-0\tthis is a house\nH-0\t-0.1\tthis is a house\n"
    (tmp_path / "gen.out").write_text(log)
    proc = cli("powernorm-score", "gen.out", "--bleu", "iwslt14", "--json", "s.json", cwd=tmp_path)
    assert "100.00" in proc.stdout and (tmp_path / "s.json").is_file()
    bad = cli("powernorm-score", "missing.out", "--bleu", "iwslt14", check=False, cwd=tmp_path)
    assert bad.returncode == 2 and "missing.out" in bad.stderr
    narrow, wide = (cli("powernorm-flags", "--help", env={"COLUMNS": c}).stdout for c in ("40", "200"))
    assert narrow != wide and narrow == fresh("powernorm-flags", "--help", cwd=tmp_path, env={"COLUMNS": "40"}).stdout


@pytest.mark.parametrize("code", [
    "import os, sys\nprint(sys.argv, repr(sys.path[0]), os.environ.get('KEPT'), os.environ.get('DROPPED'))\n"
    "print(__name__, file=sys.stderr)\nsys.exit(int(sys.argv[1]))",
    "import sys\nprint('started')\nraise ValueError('bad value: ' + sys.argv[1])"], ids=["exit-3", "exception"])
def test_a_forked_python_c_is_the_fresh_one(code, tmp_path, monkeypatch):
    """``python -c`` in a fork (tool ``python``): its arguments, sys.path,
    environment (the whole of it given: a variable of this process's left
    out is absent), output and exit status, and a traceback's last line, as
    a fresh interpreter's."""
    monkeypatch.setenv("DROPPED", "dropped")
    environ = {**{k: v for k, v in os.environ.items() if k != "DROPPED"}, "KEPT": "kept"}
    forked = cli("python", "-c", code, "3", check=False, cwd=tmp_path, environ=environ)
    started = subprocess.run([sys.executable, "-c", code, "3"], capture_output=True, text=True, cwd=tmp_path,
                             env=environ)
    assert (forked.returncode, forked.stdout) == (started.returncode, started.stdout)
    assert forked.stderr.strip().splitlines()[-1] == started.stderr.strip().splitlines()[-1]
    assert started.returncode == 3 and started.stdout == "['-c', '3'] '' kept None\n" or (
        started.returncode == 1 and started.stdout == "started\n")


def test_a_forked_python_m_is_the_fresh_one(tmp_path):
    """``python -m MODULE`` in a fork (tool ``python``): the module run as ``__main__`` (its spec, the file
    as sys.argv[0], the working directory first on sys.path), an import beside it, its output and exit
    status, as a fresh interpreter's."""
    package = tmp_path / "pk"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("VALUE = 7\n")
    (package / "__main__.py").write_text(
        "import sys\nfrom pk.helper import VALUE\nmain = sys.modules['__main__']\n"
        "print(sys.argv, repr(sys.path[0]), __name__, __spec__.name, main.__spec__.name, VALUE)\n"
        "if sys.argv[1] != '0':\n    sys.exit(int(sys.argv[1]))\n")
    for code in ("3", "0"):  # its own exit, and the end of the module
        forked = cli("python", "-m", "pk", code, "x", check=False, cwd=tmp_path)
        started = subprocess.run([sys.executable, "-m", "pk", code, "x"], capture_output=True, text=True,
                                 cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == \
            (started.returncode, started.stdout, started.stderr)
        assert started.returncode == int(code) and started.stdout == (
            f"[{str(package / '__main__.py')!r}, {code!r}, 'x'] {str(tmp_path)!r} __main__ pk.__main__ pk.__main__ 7\n")


def test_a_stand_in_is_the_console_script_it_stands_in_for(tmp_path):
    """A recipe's stand-in (support.commands.stand_ins) runs its command in a
    fork with the caller's streams, directory and environment, exits with its
    status, passes a signal on, and ends by it; its ``python`` answers the
    registry query of scripts/lib.sh, runs ``python -m`` of the plugin's
    table and study commands in a fork (as the fresh interpreter would:
    the same refusal), and runs anything else."""
    path = f"{stand_ins(tmp_path / 'bin')}:{BIN}:{os.environ['PATH']}"
    (tmp_path / "gen.out").write_text("H-0\t-0.1\tthis is a house\n")
    sh = "cd {0} && sacremoses -q -l en tokenize < gen.out > tok.out; echo $? $PWD; sacremoses -l en bad-command"
    proc = subprocess.run(["bash", "-c", sh.format(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "PATH": path})
    assert proc.stdout == f"0 {tmp_path}\n" and proc.returncode == 2 and "No such command" in proc.stderr
    assert (tmp_path / "tok.out").read_text() == "H-0 -0.1 this is a house\n"
    answer = subprocess.run(["bash", "-c", f'python -c "{norm_query()}"; python -c "print(6 * 7)"'], text=True,
                            capture_output=True, env={**os.environ, "PATH": path})
    from powernorm_fairseq.norms.placement import PLACEMENTS
    from powernorm_fairseq.norms.qk_norm import QK_KINDS

    assert answer.stdout.split("\n")[:4] == [*map(" ".join, (NORM_TYPES, PLACEMENTS, QK_KINDS)), "42"]
    refusal = ["-m", "powernorm_fairseq.cli.study", "--task", "classification", "--norms", "layernorm", "--data",
               str(tmp_path), "--out", str(tmp_path / "s")]
    forked, started = (subprocess.run([python, *refusal], capture_output=True, text=True, cwd=ROOT,
                                      env={**os.environ, "PATH": path}) for python in ("python", sys.executable))
    assert (forked.returncode, forked.stdout) == (started.returncode, started.stdout) == (2, "")
    assert forked.stderr.splitlines()[-1] == started.stderr.splitlines()[-1] and "layernorm" in started.stderr
    sacremoses = commands._fork_server(commands._server_of("sacremoses"))
    server = processes_mentioning(sacremoses)  # the fork server, then its forks too
    waiting = subprocess.Popen(["bash", "-c", "exec sacremoses -l en tokenize"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PATH": path})
    while len(processes_mentioning(sacremoses)) < len(server) + 2:  # its watcher and command
        time.sleep(0.05)
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=60) == -signal.SIGTERM
    assert waiting.stdout.read() == ""  # and the command has ended: no one holds its stdout open


def test_a_signal_ends_a_forked_command_as_it_ends_a_process(tmp_path):
    read, write = os.pipe()  # a stdin that never ends: the command waits on it
    try:
        command = Command("powernorm-score", ["/dev/stdin", "--bleu", "iwslt14"], cwd=tmp_path, stdin=read)
        command.send_signal(signal.SIGKILL)
        assert command.wait(timeout=60) == -signal.SIGKILL
    finally:
        os.close(read), os.close(write)


def test_the_toy_corpora_are_word_for_word_and_repeatable():
    src, tgt = toy_corpus(50, seed=1)
    assert (src, tgt) == toy_corpus(50, seed=1) and src != toy_corpus(50, seed=2)[0]
    lexicon = {}
    for s, t in zip(src, tgt):
        a, b = s.split(), t.split()
        assert len(a) == len(b) and 3 <= len(a) <= 12
        for x, y in zip(a, b):
            assert lexicon.setdefault(x, y) == y  # one translation per word
    lines = lm_corpus(50, seed=4)
    follows = {}
    for line in lines:
        words = line.split()
        for x, y in zip(words, words[1:]):
            assert follows.setdefault(x, y) == y  # each next word is determined


def test_the_toy_data_is_binarized_with_one_dictionary(toy_data):
    assert (toy_data / "dict.de.txt").read_text() == (toy_data / "dict.en.txt").read_text()
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            assert (toy_data / f"{split}.de-en.{lang}.bin").stat().st_size > 0


def test_the_interpreter_computes_the_same_without_its_repeated_patching():
    """support/interpreter.py skips Triton's second patching of the language
    for a kernel's own helpers: the kernels' outputs, gradients and running
    statistics are bit for bit those of Triton's own interpreter, and the
    skip happens (a third or more of the interpreter's time here)."""
    import torch
    from triton.runtime import interpreter as triton_interpreter

    from powernorm_fairseq.norms import build_norm, kernels

    def run():
        torch.manual_seed(0)
        norm = build_norm("pn", 16, warmup_updates=1, layer_scale=True, groups=2).train()
        out = []
        with kernels.use("triton"):
            for _ in range(2):  # the warmup step, then one with the running statistics
                x = torch.randn(5, 3, 16, requires_grad=True)
                pad = torch.zeros(3, 5, dtype=torch.bool)
                pad[1, 3:] = True
                y = norm(x, pad)
                y.backward(torch.randn_like(y))
                out += [y.detach(), x.grad, *(p.grad.clone() for p in norm.parameters()),
                        *(b.clone() for b in norm.buffers())]  # each step's running statistics
        return out

    patched = []
    original = triton_interpreter._patch_lang
    triton_interpreter._patch_lang = lambda fn: patched.append(fn) or original(fn)
    try:
        assert interpreter.install()  # installed by conftest.py
        quick, quick_patches = run(), len(patched)
        interpreter.uninstall()
        patched.clear()
        own, own_patches = run(), len(patched)
    finally:
        interpreter.install()
        triton_interpreter._patch_lang = original
    assert len(quick) == len(own) and all(torch.equal(a, b) for a, b in zip(quick, own))
    assert 0 < quick_patches < own_patches / 2, (quick_patches, own_patches)


def test_a_helpers_first_call_into_another_module_patches_it_in_a_fresh_process():
    """In a process where no kernel ran before, a kernel helper's call of a
    Triton library function (RMSNorm's wide-row sum calls ``tl.zeros`` first)
    patches that library's module as Triton does: the skip is the helper's
    own patch only. (Earlier launches leave modules patched, so only a fresh
    process can show it.)"""
    from pathlib import Path

    from powernorm_fairseq.norms.kernels import gpu

    C = 2 * gpu.WIDEST_ROW  # walked in blocks
    code = ("import sys, torch\nsys.path.insert(0, sys.argv[1])\nfrom support import interpreter\n"
            "assert interpreter.install()\nfrom powernorm_fairseq.norms import build_norm, kernels\n"
            "with kernels.use('triton'):\n"
            f"    print(build_norm('rmsnorm', {C}).train()(torch.ones(2, 1, {C})).sum().item())\n")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert proc.returncode == 0 and float(proc.stdout) == pytest.approx(2 * C, rel=1e-4), proc.stderr[-2000:]
