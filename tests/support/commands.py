"""Console scripts run as the suite runs them: each in a fork of a server
that has imported torch (and fairseq) once (``forkserver.py``), a process of
its own, driven through the parts of ``subprocess`` the tests use."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def processes_mentioning(text):
    """Pids of running processes whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry) != os.getpid():
                found.append(int(entry))
    return found


class Command:
    """A console script running in a fork of the suite's fork server
    (``forkserver.py``): a process of its own, with the parts of
    ``subprocess.Popen`` the tests use."""

    def __init__(self, tool, args, cwd=ROOT, env=None, stdin=None, stdout=None, stderr=None, server=None,
                 environ=None):
        import socket

        self.args = [str(BIN / tool), *map(str, args)]
        self.returncode = None
        environ = {**os.environ, "PYTHONWARNINGS": "ignore"} if environ is None else environ  # the base, or all
        request = json.dumps({"tool": tool, "argv": self.args, "cwd": str(cwd),
                              "env": {**environ, **(env or {})}}).encode()
        streams = [subprocess.DEVNULL if stdin is None else stdin, stdout, stderr]
        self.stdout = None  # with stdout=subprocess.PIPE: the read end, as text
        with contextlib.ExitStack() as opened:
            fds = []
            for i, stream in enumerate(streams):
                if stream == subprocess.PIPE and i == 1:
                    read, write = os.pipe()
                    self.stdout = open(read, "r")
                    stream = opened.enter_context(open(write, "wb"))
                elif stream == subprocess.STDOUT and i == 2:
                    stream = fds[1]
                elif stream is None or stream == subprocess.DEVNULL:
                    stream = opened.enter_context(open(os.devnull, "rb" if i == 0 else "wb"))
                fds.append(stream if isinstance(stream, int) else stream.fileno())
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._conn.connect(server or _fork_server(_server_of(tool)))
            socket.send_fds(self._conn, [len(request).to_bytes(8, "big")], fds)
            self._conn.sendall(request)
        self._buffer = b""
        self.pid = self._reply()["pid"]

    def _reply(self):
        while b"\n" not in self._buffer:
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the fork server lost {self.args[0]}: see its stderr above")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self):
        return self.wait(timeout=0)

    def _ended(self, timeout):
        import select

        return b"\n" in self._buffer or bool(select.select([self._conn], [], [], timeout)[0])

    def wait(self, timeout=None):
        if self.returncode is None:
            if not self._ended(timeout):
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._reply()["returncode"]
            self._conn.close()
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        import signal

        self.send_signal(signal.SIGKILL)


def _server_of(tool):
    """The fork server (a key of IMPORTS) that runs console script ``tool``: fairseq's server for fairseq's
    commands and for powernorm-average, which imports fairseq (its models' settings) whenever it runs."""
    if tool.startswith("fairseq-") or tool == "powernorm-average":
        return "fairseq"
    return "sacremoses" if tool == "sacremoses" else "torch"


#: what each fork server imports before it forks
IMPORTS = {"fairseq": ["torch", "fairseq", "torch._dynamo"], "torch": ["torch"], "sacremoses": ["sacremoses.cli"]}


_servers = {}
SOCKETS = None  # the directory of the fork servers' sockets: the session's temporary one (conftest.py)


def _fork_server(modules):
    """The socket of this session's fork server that has imported ``modules``
    ("fairseq": torch and fairseq for fairseq's commands and the plugin's
    that import fairseq whenever they run, and torch._dynamo, which
    torch.optim imports as a training builds its optimizer, 3 s of every
    fairseq-train; "torch": torch alone, for the plugin's other tools;
    "sacremoses": its command line, whose import compiles the tokenizer's
    patterns, 0.3-0.7 s of each of the recipes' many calls), started on first use."""
    if modules not in _servers:
        import atexit

        path = os.path.join(SOCKETS, f"{modules}.socket")
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), path,
                                 *IMPORTS[modules]],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit status {proc.wait()})")
        atexit.register(proc.kill)
        _servers[modules] = path
    return _servers[modules]


def cli(tool, *args, check=True, cwd=ROOT, timeout=600, input=None, env=None, environ=None):
    """Run a console script of this environment (fairseq's or the plugin's),
    or ``python -c`` (tool ``python``), in a process of its own; return it
    as ``subprocess.run`` would. ``environ``: its whole environment (else
    this process's, with ``env`` over it)."""
    import tempfile

    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin.write((input or "").encode())
        stdin.seek(0)
        command = Command(tool, args, cwd=cwd, env=env, stdin=stdin, stdout=out, stderr=err, environ=environ)
        try:
            command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            raise
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(command.args, command.returncode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


#: the console scripts the recipes call that a stand-in runs in a fork (each imports torch, or is called
#: many times); the scripts the recipes signal or kill run as they are (tests pass no stand-ins there)
STAND_IN_TOOLS = ("fairseq-preprocess", "fairseq-train", "fairseq-generate", "fairseq-interactive", "fairseq-eval-lm",
                  "powernorm-average", "powernorm-score", "sacremoses")
#: the plugin's commands that scripts/reproduce.sh and norm-study.sh run as ``python -m MODULE``: each imports
#: fairseq to check the flags after ``--``, and trains in its own process (one cell at a time) or its forks
STAND_IN_MODULES = ("powernorm_fairseq.cli.reproduce", "powernorm_fairseq.cli.study")


def norm_query():
    """The registry query of scripts/lib.sh's registry (its one ``python -c``)."""
    import re

    return re.search(r'python -c "([^"]+)"', (ROOT / "scripts" / "lib.sh").read_text()).group(1)


_stand_ins = {}


def stand_ins(directory=None, modules=True):
    """A directory of stand-ins for a recipe run, to put first on its PATH
    (``directory``, or once per process one beside the fork servers'
    sockets): each tool of STAND_IN_TOOLS runs as that console script in a
    fork of the fork server (:func:`stand_in`), and ``python`` answers
    lib.sh's registry query with the registry as this process reads it
    (a query that changed in lib.sh reaches the real interpreter: slower,
    never wrong), runs ``python -m`` each of STAND_IN_MODULES in a fork of
    the fairseq server where ``modules`` is true, and runs the real
    interpreter for anything else. A forked command is not in its caller's
    process group: its client passes on the signals a group receives, its
    children receive only what the command sends them (a test of a Ctrl-C
    to the whole group runs the command itself)."""
    import shlex

    from powernorm_fairseq.norms import NORM_TYPES
    from powernorm_fairseq.norms.placement import PLACEMENTS
    from powernorm_fairseq.norms.qk_norm import QK_KINDS

    if directory is None:
        if modules not in _stand_ins:
            _stand_ins[modules] = stand_ins(Path(SOCKETS) / ("stand-ins-m" if modules else "stand-ins"), modules)
        return _stand_ins[modules]
    directory.mkdir(parents=True, exist_ok=True)
    def script(name, tool, server):
        """A stand-in, ``directory/name``, that runs ``tool`` with its arguments in a fork of ``server``."""
        path = directory / name
        path.write_text(f"#!{sys.executable}\nimport importlib.util, sys\n"
                        f"spec = importlib.util.spec_from_file_location('commands', {str(Path(__file__))!r})\n"
                        "commands = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(commands)\n"
                        f"commands.stand_in({tool!r}, sys.argv[1:], {_fork_server(server)!r})\n")
        path.chmod(0o755)
        return path

    for tool in STAND_IN_TOOLS:
        script(tool, tool, _server_of(tool))
    module = script("python-m", "python", "fairseq")  # python -m MODULE, for the shim below
    names = shlex.quote("\n".join(map(" ".join, (NORM_TYPES, PLACEMENTS, QK_KINDS))))
    python = shlex.quote(sys.executable)
    forked = " || ".join(f"$2 == {m}" for m in STAND_IN_MODULES) if modules else "false"
    shim = directory / "python"
    shim.write_text(f"#!/usr/bin/env bash\nif [[ $# == 2 && $1 == -c && $2 == {shlex.quote(norm_query())} ]]; then\n"
                    f"  echo {names}\nelif [[ $# -ge 2 && $1 == -m && ( {forked} ) ]]; then\n"
                    f"  exec {shlex.quote(str(module))} \"$@\"\nelse\n  exec {python} \"$@\"\nfi\n")
    shim.chmod(0o755)
    return directory


def stand_in(tool, args, server):
    """Be console script ``tool``: run it in a fork of the fork server at
    socket ``server`` with this process's standard streams, directory and
    environment, pass on SIGTERM, SIGINT, SIGHUP and SIGUSR2 (SLURM's warning
    before a time limit, sent to every process of a job), and end as it ends
    (its exit status, or its signal)."""
    import signal

    started, arrived = [], []  # a signal that comes while the command starts is passed on once it runs

    def forward(number, _):
        if started:
            started[0].send_signal(number)
        else:
            arrived.append(number)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, forward)
    command = Command(tool, args, cwd=os.getcwd(), env=dict(os.environ), stdin=0, stdout=1, stderr=2, server=server)
    started.append(command)
    for number in arrived:
        command.send_signal(number)
    code = command.wait()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)
