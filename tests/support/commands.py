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

    def __init__(self, tool, args, cwd=ROOT, env=None, stdin=None, stdout=None, stderr=None):
        import socket

        self.args = [str(BIN / tool), *map(str, args)]
        self.returncode = None
        request = json.dumps({"tool": tool, "argv": self.args, "cwd": str(cwd),
                              "env": {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}}).encode()
        streams = [stdin or subprocess.DEVNULL, stdout, stderr]
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
            self._conn.connect(_fork_server("fairseq" if tool.startswith("fairseq-") else "torch"))
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


_servers = {}
SOCKETS = None  # the directory of the fork servers' sockets: the session's temporary one (conftest.py)


def _fork_server(modules):
    """The socket of this session's fork server that has imported ``modules``
    ("fairseq": torch and fairseq, for fairseq's commands; "torch": torch
    alone, for the plugin's tools), started on first use."""
    if modules not in _servers:
        import atexit

        path = os.path.join(SOCKETS, f"{modules}.socket")
        imports = ["torch", "fairseq"] if modules == "fairseq" else ["torch"]
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), path, *imports],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit status {proc.wait()})")
        atexit.register(proc.kill)
        _servers[modules] = path
    return _servers[modules]


def cli(tool, *args, check=True, cwd=ROOT, timeout=600, input=None, env=None):
    """Run a console script of this environment (fairseq's or the plugin's) in
    a process of its own; return it as ``subprocess.run`` would."""
    import tempfile

    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin.write((input or "").encode())
        stdin.seek(0)
        command = Command(tool, args, cwd=cwd, env=env, stdin=stdin, stdout=out, stderr=err)
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
