"""A fork server for the console scripts the tests run.

Every ``fairseq-train`` spends seconds importing torch, fairseq and what
fairseq imports (scikit-learn among them) before it reads a flag: the same
seconds in every one of the suite's many runs. This server imports them once
(torch and fairseq for fairseq's commands and for the plugin's commands
that import fairseq whenever they run: powernorm-average, the table's and
the study's; torch alone for its other tools, which import fairseq only
where they need it; sacremoses's command line for sacremoses). Each
command is then a fork of it that runs the console script as the script
itself does, ``sys.exit(main())`` at the top level of
``__main__``, in a process of its own: its own pid, file descriptors,
environment, working directory, signal dispositions, exit status, excepthook
and interpreter exit (:func:`exit_as_the_interpreter`). The plugin is never
imported here; a command imports it through ``--user-dir`` as a fresh process
would.

One connection per command. The client sends an 8-byte length and a JSON
request ``{"tool", "argv", "cwd", "env"}`` (tool ``python``: ``python -c`` or ``-m``),
with its stdin, stdout and stderr as three file descriptors (SCM_RIGHTS);
the server answers with a line ``{"pid": ...}`` once the command runs, then
``{"returncode": ...}`` (negative for a signal, as ``subprocess`` reports it)
once it has ended.

    python tests/forkserver.py SOCKET MODULE...   # prints "ready" when it accepts
"""

import gc
import importlib
import io
import json
import logging
import os
import signal
import socket
import sys


def _receive(conn):
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    while len(head) < 8:
        head += conn.recv(8 - len(head))
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("the client went away mid-request")
        body += chunk
    return json.loads(body), fds


def _send(conn, **message):
    conn.sendall((json.dumps(message) + "\n").encode())


def _stream(fd, mode, unbuffered):
    """A fresh sys.stdin/stdout/stderr on ``fd``, buffered as the interpreter
    would buffer it at start-up (line-buffered stderr and terminals; none at
    all under PYTHONUNBUFFERED)."""
    old = (sys.__stdin__, sys.__stdout__, sys.__stderr__)[fd]  # the encoding this interpreter chose
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=old.encoding, errors=old.errors)
    buffered = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors,
                            line_buffering=fd == 2 or raw.isatty(), write_through=unbuffered)


_IMPORTED = ([], logging.WARNING)  # the root logger's handlers and level after the server's imports


def _fresh_logging(streams):
    """The root logger as a fresh process of the command has it. Importing
    fairseq configures it (a basicConfig in one of its model modules), and
    in a fresh process that holds unless the command's own basicConfig runs
    before its first import of fairseq (fairseq_cli.train's does; generate's
    and preprocess's run after). Here fairseq was imported before the fork:
    the root starts bare, and whichever comes first decides, the command's
    first import of fairseq (the configuration the server's imports made,
    its handlers moved to the command's streams, ``streams``: server's id ->
    command's) or its first basicConfig (its own)."""
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    handlers, level = _IMPORTED
    if not handlers:
        return
    import builtins

    original_import, original_config = builtins.__import__, logging.basicConfig

    def first_event():
        builtins.__import__, logging.basicConfig = original_import, original_config

    def importing(name, globals=None, locals=None, fromlist=(), depth=0):
        if depth == 0 and (name == "fairseq" or name.startswith("fairseq.")):
            first_event()
            for handler in handlers:
                if isinstance(handler, logging.StreamHandler) and id(handler.stream) in streams:
                    handler.setStream(streams[id(handler.stream)])
                logging.root.addHandler(handler)
            logging.root.setLevel(level)
        return original_import(name, globals, locals, fromlist, depth)

    def basic_config(**kwargs):
        first_event()
        return original_config(**kwargs)

    builtins.__import__, logging.basicConfig = importing, basic_config


def _become(request, fds):
    """In the command's process: take its descriptors, directory, environment
    and signals, and return its console script's entry point."""
    from importlib.metadata import entry_points

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at an interpreter's start
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    servers = (sys.__stdout__, sys.__stderr__)
    sys.stdin = sys.__stdin__ = _stream(0, "r", unbuffered)
    sys.stdout = sys.__stdout__ = _stream(1, "w", unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, "w", unbuffered)
    _fresh_logging({id(server): mine for server, mine in zip(servers, (sys.stdout, sys.stderr))})
    if request["tool"] == "python" and request["argv"][1] == "-m":  # ``python -m MODULE [ARG...]``: the module
        import runpy  # as __main__ (sys.argv[0] its file), the working directory first on sys.path

        module = request["argv"][2]
        sys.argv, sys.path[0] = [module, *request["argv"][3:]], os.getcwd()
        return lambda: runpy.run_module(module, run_name="__main__", alter_sys=True) and None  # not its globals
    if request["tool"] == "python":  # ``python -c CODE [ARG...]``: the code as __main__, '' first on sys.path
        code = request["argv"][2]
        sys.argv, sys.path[0] = ["-c", *request["argv"][3:]], ""
        return lambda: exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    sys.argv = list(request["argv"])
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == request["tool"]]
    return script.load()


def serve(path, modules):
    """Import ``modules``, then accept commands on ``path`` forever; return
    only in a command's process, with the entry point it is to run."""
    global _IMPORTED
    for module in modules:  # the imports every command shares
        importlib.import_module(module)
    _IMPORTED = (list(logging.root.handlers), logging.root.level)
    # the imports' objects out of the cyclic collector's reach, as gc.freeze's
    # documentation advises a server that forks: a command's collections, its
    # last one at exit included, walk only its own objects (exit took ~1.9 s)
    gc.freeze()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the server never waits: its children are reaped
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the suite ends it through its client
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (EOFError, OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:  # the watcher: starts the command, waits for it, reports
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                return _become(request, fds)
            for fd in fds:
                os.close(fd)
            try:
                _send(conn, pid=pid)
                _, status = os.waitpid(pid, 0)
                _send(conn, returncode=os.waitstatus_to_exitcode(status))
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def exit_as_the_interpreter(main):
    """End as ``sys.exit(main())`` at the top of ``__main__`` ends a fresh
    interpreter, up to what a command can observe (CPython's Py_FinalizeEx):
    the exit status of a SystemExit, or an uncaught exception through
    sys.excepthook and status 1 (KeyboardInterrupt: death by SIGINT, after
    the clean-up); then the non-daemon threads joined, the atexit callbacks
    (logging's shutdown and weakref finalizers among them) and the standard
    streams flushed (status 120 where that fails). Then ``os._exit``: the
    rest of finalization tears down every module, and in a fork that writes
    to every inherited object's page, 0.45 s of each command here."""
    import atexit
    import threading

    interrupted = False
    try:
        raise SystemExit(main())
    except SystemExit as end:
        code = end.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException as error:  # noqa: BLE001 (what the interpreter itself reports)
        interrupted = isinstance(error, KeyboardInterrupt)
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            code = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    exit_as_the_interpreter(serve(sys.argv[1], sys.argv[2:]))
