"""No file runs code through fairseq, by any loader: every call in the
installed fairseq's source that can unpickle a file is found here, and each
is either read weights only by the plugin's guard
(``patches.checkpoints.weights_only_in_fairseq``) or named below as out of a
user's reach, with the reason. A fairseq that adds a loading call fails
:func:`test_every_loading_call_in_fairseq_is_guarded_or_out_of_reach` until
it is classified."""

import ast
import os
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from support import cli, train_args
from test_faults import UNSAFE, malicious_checkpoint, one_line_error

pytestmark = pytest.mark.fast

#: functions that unpickle what they are given, by module and name
UNPICKLERS = {"torch": {"load"}, "torch.serialization": {"load"}, "torch.hub": {"load", "load_state_dict_from_url"},
              "torch.jit": {"load"}, "pickle": {"load", "loads"}, "dill": {"load", "loads"},
              "numpy": {"load"}, "joblib": {"load"}}
#: calls the guard does not reach, by (file under site-packages, enclosing function, callee), with why a user's
#: path cannot reach them
OUT_OF_REACH = {
    ("fairseq/distributed/utils.py", "_broadcast_object_slow", "torch.load"):
        "bytes one distributed worker sends another, in memory (io.BytesIO), never a file",
    ("fairseq/distributed/utils.py", "all_gather_list", "pickle.loads"):
        "bytes one distributed worker sends another, in memory, never a file",
    ("fairseq/models/speech_to_text/hub_interface.py", "get_prediction", "torch.hub.load"):
        "fetches and runs a GitHub repository's hubconf.py by design (a TTS model named in the checkpoint's own "
        "config); needs the network, and no command of this plugin's models reaches it",
}
#: fairseq's examples are programs of their own: scripts run with python, or the --user-dir of a run, which is
#: then not this plugin's; no command of this plugin reaches them (their torch.load calls, were they imported
#: into a run with this plugin, would be guarded all the same)
ELSEWHERE = "fairseq/examples/"


def enclosing(tree):
    """Each call node of ``tree`` with the name of the function around it."""
    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                yield child, where
            yield from walk(child, name)
    yield from walk(tree, "<module>")


class Call(NamedTuple):
    rel: str  # the file, under site-packages
    where: str  # the enclosing function
    callee: str  # "module.function"
    line: int
    keywords: dict
    by_name: bool  # a name imported from the module (bound when imported), not looked up on it when called

    @property
    def key(self):
        return self.rel, self.where, self.callee


def loading_calls(path: Path, rel: str):
    """A :class:`Call` for every call in ``path`` that
    unpickles: ``torch.load(...)`` and the other ``UNPICKLERS`` through any
    alias of their module, or a name imported from one (``from torch import load``)."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    modules, names = {}, {}  # local name -> module; local name -> "module.function"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in UNPICKLERS:
                    modules[a.asname or a.name] = full
                elif a.name in UNPICKLERS.get(node.module, ()):
                    names[a.asname or a.name] = full
    aliases = {"np": "numpy"}
    for call, where in enclosing(tree):
        f, callee = call.func, None
        if isinstance(f, ast.Name) and f.id in names:
            callee = names[f.id]
        elif isinstance(f, ast.Attribute):
            parts, base = [f.attr], f.value
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                module = ".".join([aliases.get(modules[base.id], modules[base.id]), *reversed(parts[1:])])
                if f.attr in UNPICKLERS.get(module, ()):
                    callee = f"{module}.{f.attr}"
        if callee:
            yield Call(rel, where, callee, call.lineno, {k.arg: k.value for k in call.keywords},
                       isinstance(f, ast.Name))


def fairseq_sources(pattern=rb"\bload"):
    """fairseq's and fairseq_cli's files (outside its examples) that can hold ``pattern``."""
    import fairseq
    import fairseq_cli

    site = Path(fairseq.__file__).parent.parent
    for package in (fairseq, fairseq_cli):
        for path in sorted(Path(package.__file__).parent.rglob("*.py")):
            text = path.read_bytes()
            # parse only the files that can hold such a call
            if not str(path).startswith(str(site / ELSEWHERE)) and re.search(pattern, text):
                yield path, str(path.relative_to(site))


def every_loading_call():
    return [call for path, rel in fairseq_sources() for call in loading_calls(path, rel)]


def guarded(call):
    """Whether the guard reads this call weights only: a torch.load of fairseq's
    own code, looked up on the torch module when it runs; numpy's load reads no
    pickle unless a call asks (``allow_pickle=True``)."""
    if call.callee == "numpy.load":
        flag = call.keywords.get("allow_pickle")
        return flag is None or (isinstance(flag, ast.Constant) and flag.value is False)
    return (call.callee in ("torch.load", "torch.serialization.load") and not call.by_name
            and call.key not in OUT_OF_REACH)


def test_the_scanner_finds_every_spelling_of_a_loading_call(tmp_path):
    """The enumeration can fail: each way of writing a loading call is found."""
    source = tmp_path / "m.py"
    source.write_text("import torch as th\nimport pickle\nfrom torch import load as L\nimport numpy as np\n"
                      "from torch import serialization\n"
                      "def a(p):\n    return th.load(p)\n"
                      "def b(p):\n    return L(p)\n"
                      "def c(p):\n    return pickle.loads(p)\n"
                      "def d(p):\n    return np.load(p, allow_pickle=True)\n"
                      "def e(p):\n    return serialization.load(p)\n"
                      "def f(p):\n    return th.hub.load_state_dict_from_url(p)\n"
                      "def g(p):\n    return json.load(p), th.save(p)\n")
    found = [(c.where, c.callee) for c in loading_calls(source, "m.py")]
    assert found == [("a", "torch.load"), ("b", "torch.load"), ("c", "pickle.loads"), ("d", "numpy.load"),
                     ("e", "torch.serialization.load"), ("f", "torch.hub.load_state_dict_from_url")]
    calls = list(loading_calls(source, "m.py"))
    assert [guarded(c) for c in calls] == [True, False, False, False, True, False]


@pytest.mark.slow  # parses a hundred of fairseq's files: two seconds
def test_every_loading_call_in_fairseq_is_guarded_or_out_of_reach():
    calls = every_loading_call()
    assert len(calls) > 15  # fairseq 0.12.3: checkpoint_utils, the quantization, speech and data loaders
    assert ("fairseq/checkpoint_utils.py", "load_ema_from_checkpoint", "torch.load") in {c.key for c in calls}
    unclassified = [f"{c.rel}:{c.line} {c.callee} in {c.where}" for c in calls
                    if not guarded(c) and c.key not in OUT_OF_REACH]
    assert unclassified == [], "loading calls neither guarded nor out of reach: " + "; ".join(unclassified)
    stale = sorted(set(OUT_OF_REACH) - {c.key for c in calls})
    assert stale == [], f"listed as out of reach but no longer in fairseq: {stale}"


def test_every_fairseq_loader_reads_weights_only_under_the_unsafe_variable(tmp_path, monkeypatch):
    """A call from each file that holds a guarded torch.load, under
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, whatever it passes: the pickle's code
    does not run, and the refusal names the file. The same call from
    elsewhere is loaded as torch loads it; an in-memory buffer (another
    worker's object) as torch's own broadcast unpickles it."""
    import io

    import powernorm_fairseq  # noqa: F401  (installs the patches)
    from powernorm_fairseq.common.errors import InputFileError
    from powernorm_fairseq.patches.checkpoints import fairseq_roots

    marker = tmp_path / "marker"
    bad = malicious_checkpoint(tmp_path / "evil.pt", marker)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    site = Path(fairseq_roots()[0]).parent
    files = sorted({c.rel for c in every_loading_call() if guarded(c) and c.callee.startswith("torch")})
    assert "fairseq/checkpoint_utils.py" in files and "fairseq/data/codedataset.py" in files
    for rel in files:
        for call in ("torch.load(path)", "torch.load(open(path, 'rb'), weights_only=False)",
                     "torch.serialization.load(path, map_location='cpu', weights_only=False)"):
            with pytest.raises(InputFileError, match=f"^{re.escape(str(bad))}: refused"):
                exec(compile(call, str(site / rel), "eval"), {"torch": torch, "path": str(bad)})
    assert not marker.exists()
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        torch.load(bad)  # this file is not fairseq's: torch's own rules, which the variable turns off
    assert marker.exists()
    marker.unlink()
    buffer = io.BytesIO(bad.read_bytes())
    exec(compile("torch.load(buffer, weights_only=False)", str(site / "fairseq/distributed/utils.py"), "eval"),
         {"torch": torch, "buffer": buffer})
    assert marker.exists()  # what one worker sends another is not a user's file: left to torch
    # the checkpoint state a resuming run's first worker sends the others, its configuration a DictConfig
    from omegaconf import OmegaConf

    buffer = io.BytesIO()
    torch.save({"cfg": OmegaConf.create({"model": {"norm_sync": "batch"}})}, buffer)
    buffer.seek(0)
    state = eval(compile("torch.load(buffer, map_location='cpu')", str(site / "fairseq/distributed/utils.py"),
                         "eval"), {"torch": torch, "buffer": buffer})
    assert state["cfg"].model.norm_sync == "batch"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_ema_seed_model_refuses_code_in_one_line(toy_data, tmp_path, fmt):
    marker = tmp_path / "marker"
    bad = malicious_checkpoint(tmp_path / "evil.pt", marker, fmt)
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path / "run", "--store-ema", "--ema-seed-model", bad,
                                            "--cpu", max_update=1), check=False, env=UNSAFE)
    one_line_error(proc, bad, "fairseq-train")
    assert "refused" in proc.stderr.strip().splitlines()[-1] and not marker.exists()
    plain = tmp_path / "no-ema.pt"
    torch.save({"model": {}, "extra_state": {}}, plain)
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path / "run2", "--store-ema", "--ema-seed-model", plain,
                                            "--cpu", max_update=1), check=False)
    one_line_error(proc, plain, "fairseq-train")
    assert "holds no EMA weights" in proc.stderr


@pytest.mark.slow
def test_without_the_plugin_fairseq_runs_the_pickle_under_the_unsafe_variable(tmp_path):
    """What docs/robustness.md says holds without the plugin imported: fairseq's
    own reader, under the variable, runs a pickle's code (do not set it)."""
    import subprocess
    import sys

    marker = tmp_path / "marker"
    bad = malicious_checkpoint(tmp_path / "evil.pt", marker)
    program = ("from fairseq import checkpoint_utils\ntry:\n    checkpoint_utils.load_checkpoint_to_cpu("
               f"{str(bad)!r})\nexcept Exception:\n    pass\n")
    env = {**os.environ, **UNSAFE, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, timeout=120, cwd=tmp_path)
    assert marker.exists()
    marker.unlink()
    program = "import powernorm_fairseq\n" + program.replace("except Exception", "except ValueError")
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0 and not marker.exists(), proc.stderr[-2000:]


# ---------------------------------------------------------------- the plugin's own loaders

#: loading calls of the plugin's own source, by (file under the package, enclosing function, callee), and why each
#: reads no code
OWN_LOADERS = {
    ("powernorm_fairseq/common/checkpoints.py", "load", "torch.load"): "weights_only=True",
    ("powernorm_fairseq/patches/savedir.py", "saved_updates", "torch.load"): "weights_only=True",
}


def own_sources():
    import powernorm_fairseq

    root = Path(powernorm_fairseq.__file__).parent
    for path in sorted(root.rglob("*.py")):
        yield path, str(path.relative_to(root.parent))


@pytest.mark.slow
def test_the_plugin_itself_unpickles_no_file():
    """The plugin's own source, enumerated as fairseq's is: every loading call
    reads weights only, literally (``weights_only=True``); a new one fails here
    until it is listed. The SLURM launcher's wait reads why a job ended as
    plain text, never submitit's pickles in OUT/slurm."""
    calls = [c for path, rel in own_sources() for c in loading_calls(path, rel)]
    weights_only = {c.key for c in calls if c.callee == "torch.load" and isinstance(c.keywords.get("weights_only"),
                                                                                   ast.Constant)
                    and c.keywords["weights_only"].value is True}
    assert {c.key for c in calls} == set(OWN_LOADERS) == weights_only


# ---------------------------------------------------------------- archive extraction

#: functions that extract an archive's members to disk: a method of any archive object, or shutil's
EXTRACTORS = {"extractall", "extract", "unpack_archive"}
#: extractions in fairseq, by (file, enclosing function, callee), and how each is kept inside its folder
EXTRACTIONS = {
    ("fairseq/file_utils.py", "load_archive_file", "extractall"):
        "replaced whole by patches.archives.safe_archives (the hub's from_pretrained, its model and its data)",
}


def extraction_calls(path: Path, rel: str):
    """(file, enclosing function, extractor) for every call in ``path`` that
    extracts an archive: ``x.extractall(...)``/``x.extract(...)`` on any object
    (tarfile's, zipfile's), and ``unpack_archive`` under any alias of shutil
    or imported by any name."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    names = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "shutil" for a in node.names}
    for call, where in enclosing(tree):
        f = call.func
        name = f.attr if isinstance(f, ast.Attribute) else names.get(f.id) if isinstance(f, ast.Name) else None
        if name in EXTRACTORS:
            yield rel, where, name


def test_the_scanner_finds_every_spelling_of_an_extraction(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import tarfile, zipfile, shutil as sh\nfrom shutil import unpack_archive as ua\n"
                      "def a(p):\n    tarfile.open(p).extractall('x')\n"
                      "def b(p):\n    with zipfile.ZipFile(p) as z:\n        z.extract('m')\n"
                      "def c(p):\n    sh.unpack_archive(p)\n"
                      "def d(p):\n    ua(p)\n"
                      "def e(p):\n    return p.extract_features(), re.match(p)\n")
    assert [w for _, w, _ in extraction_calls(source, "m.py")] == ["a", "b", "c", "d"]


@pytest.mark.slow
def test_every_archive_extraction_in_fairseq_and_the_plugin_is_guarded():
    """Every extraction in the installed fairseq (outside its examples) and in the
    plugin is listed with how it is kept inside its folder, and the listed
    fairseq one is the plugin's safe replacement at run time; a new or stale
    site fails here."""
    from fairseq import file_utils

    from powernorm_fairseq.patches import archives

    found = {key for path, rel in fairseq_sources(rb"extract|unpack_archive")
             for key in extraction_calls(path, rel)}
    assert found == set(EXTRACTIONS), f"unlisted: {found - set(EXTRACTIONS)}; stale: {set(EXTRACTIONS) - found}"
    assert file_utils.load_archive_file.__module__ == archives.__name__  # installed (AT_IMPORT)
    own = {key for path, rel in own_sources() for key in extraction_calls(path, rel)}
    assert own == {("powernorm_fairseq/patches/archives.py", "_tar_members", "extractall"),
                   ("powernorm_fairseq/patches/archives.py", "_zip_members", "extractall")}


def tar_with(path, *members):
    """A .tar.gz holding ``members``: (TarInfo, bytes or None)."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def member(name, kind=None, link=None, data=b"x"):
    """A tar member: a file, or ``kind`` dir, symlink, hardlink, device or fifo (to ``link``)."""
    import tarfile

    info = tarfile.TarInfo(name.replace("\0", ""))
    if "\0" in name:  # only a PAX header keeps a NUL in a name
        info.pax_headers = {"path": name}
    if kind is not None:
        info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "device": tarfile.CHRTYPE,
                     "fifo": tarfile.FIFOTYPE, "dir": tarfile.DIRTYPE}[kind]
        info.linkname, data = link or "", None
    return info, data


def symlink_chain(depth=16, step=247):
    """CVE-2025-4517's members: a chain of directories and links whose resolved path overflows PATH_MAX,
    then a link through it and a file written through that link (tarfile's data filter passes them on
    Python 3.11.7)."""
    members, path = [], ""
    for i in range(depth):
        d = chr(ord("a") + i) * step
        members += [member(f"{path}{d}", "dir"), member(f"{path}{chr(ord('a') + i)}", "symlink", d)]
        path += f"{chr(ord('a') + i)}/"
    chain = "/".join(chr(ord("a") + i) for i in range(depth))
    return members + [member("escape", "symlink", chain + "/" + "../" * depth + "../../../outside"),
                      member("escape/pwned.pth")]


@pytest.mark.parametrize("members, why", [
    ([member("model/../../escaped.txt")], "would be written outside the folder"),
    ([member("/tmp/powernorm-absolute-escape.txt")], "has an absolute path"),
    ([member("model/link", "symlink", "../.."), member("model/link/escaped.txt")], "is a link"),
    ([member("model/hard", "hardlink", "/etc/passwd")], "is a link"),
    ([member("model/hard", "hardlink", "../../outside")], "is a link"),
    ([member("model/inside", "symlink", "model.pt")], "is a link"),  # even one that stays inside
    (symlink_chain(), "is a link"),
    ([member("model/dev", "device")], "is a device file or a FIFO"),
    ([member("model/fifo", "fifo")], "is a device file or a FIFO"),
    ([member("model/a\0b")], "has a NUL byte in its name"),
    ([member("model/" + "x" * 5300, "symlink", "model.pt")], "is a link"),  # its name shown shortened
])
def test_an_archive_that_would_write_outside_its_folder_is_refused(tmp_path, members, why):
    """from_pretrained("model.tar.gz"): each member is checked before anything
    is written; the refusal names the archive and the member; nothing lands
    outside, and the user's archive is left where it was."""
    from fairseq.models.transformer import TransformerModel

    from powernorm_fairseq.common.errors import InputFileError

    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    archive = tar_with(work / "model.tar.gz", member("model/model.pt", data=b"not a model"), *members)
    before = archive.read_bytes()
    with pytest.raises(InputFileError, match=f"model.tar.gz: refused: its member .* {why}") as refused:
        TransformerModel.from_pretrained(str(archive), checkpoint_file="model.pt")
    assert len(str(refused.value)) < 400 and "\n" not in str(refused.value)
    assert archive.read_bytes() == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "model.tar.gz"]
    assert not Path("/tmp/powernorm-absolute-escape.txt").exists()


#: a program that never imports the plugin: from_pretrained with user_dir alone (fairseq extracts the
#: archive before it imports the user dir)
FRESH = """
import sys
from fairseq.models.transformer import TransformerModel
try:
    TransformerModel.from_pretrained(sys.argv[1], checkpoint_file="model.pt", user_dir=sys.argv[2])
except Exception as err:
    print(f"{type(err).__name__}: {err}")
"""


@pytest.mark.slow  # a fresh interpreter
def test_the_guard_holds_in_a_fresh_interpreter_that_never_imports_the_plugin(tmp_path):
    """The .pth the installation puts in site-packages guards fairseq's extraction in every process, and
    loads nothing but the guard at start-up (no torch, no fairseq, not the plugin's package)."""
    import subprocess
    import sys

    from support import USER_DIR

    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    archive = tar_with(work / "model.tar.gz", member("model/model.pt", data=b"not a model"),
                       member(str(outside)), member("model/hard", "hardlink", "../../../outside-hard"))
    before = archive.read_bytes()
    proc = subprocess.run([sys.executable, "-c", FRESH, str(archive), str(USER_DIR)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == f"InputFileError: {archive}: refused: its member {str(outside)[1:]!r} has an " \
        "absolute path; nothing was extracted" or "has an absolute path" in proc.stdout, proc.stdout + proc.stderr
    assert archive.read_bytes() == before and not outside.exists() and not (tmp_path / "outside-hard").exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "model.tar.gz"]
    started = subprocess.run([sys.executable, "-c", "import sys; print(*sorted(sys.modules))"], cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout.split()
    assert "powernorm_fairseq.patches.archives" in started
    assert not {"powernorm_fairseq", "torch", "fairseq", "tarfile", "zipfile"} & set(started)


@pytest.mark.slow  # a process that has ended
def test_a_fifo_an_unreadable_archive_and_a_dead_process_s_folder(tmp_path):
    """A FIFO given as the archive is one line, never a hang; so is a file that is not an archive; the
    folder a killed process left is removed by the next extraction."""
    import subprocess
    import tempfile

    from powernorm_fairseq.common.errors import InputFileError
    from powernorm_fairseq.patches import archives

    fifo = tmp_path / "model.tar.gz"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match=f"^{fifo}: not a regular file"):
        archives.extract_safely(str(fifo))
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"\0" * 10)
    with pytest.raises(InputFileError, match=f"^{junk}: not a readable archive"):
        archives.extract_safely(str(junk))
    import stat
    import zipfile

    link = tmp_path / "model.zip"  # a zip's link member: refused as a tar's
    with zipfile.ZipFile(link, "w") as z:
        z.writestr("model/model.pt", b"x")
        info = zipfile.ZipInfo("model/escape")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(info, "../../outside")
    with pytest.raises(InputFileError, match=f"^{link}: refused: its member 'model/escape' is a link"):
        archives.extract_safely(str(link))
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = Path(tempfile.mkdtemp(prefix=f"{archives.PREFIX}{dead.pid}-"))
    (left / "model.pt").write_bytes(b"x")
    mine = Path(tempfile.mkdtemp(prefix=f"{archives.PREFIX}{os.getpid()}-"))  # a live process's: kept
    folder = archives.extract_safely(str(tar_with(tmp_path / "ok.tar.gz", member("model/model.pt"),
                                                  member("model/dict.txt"))))
    assert not left.exists() and mine.is_dir() and Path(folder, "model.pt").is_file()
    mine.rmdir()


@pytest.mark.slow  # a trained model
def test_a_model_archive_loads_and_is_left_in_place(toy_data, trained, tmp_path):
    import tarfile

    from fairseq.models.transformer import TransformerModel

    archive = tmp_path / "model.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(trained("pn") / "checkpoint_last.pt", "pn/model.pt")
        for name in ("dict.de.txt", "dict.en.txt"):
            tar.add(toy_data / name, f"pn/{name}")
    before = archive.read_bytes()
    hub = TransformerModel.from_pretrained(str(archive), checkpoint_file="model.pt", data_name_or_path=".",
                                           source_lang="de", target_lang="en")
    assert hub.translate("haus katze", beam=1)
    assert archive.is_file() and archive.read_bytes() == before and sorted(tmp_path.iterdir()) == [archive]


# ---------------------------------------------------------------- every reader of a file

#: reads in the plugin's source whose function neither calls check_regular_file nor asks is_file(), with why
#: the file cannot be a user's FIFO, directory or device
READS_ELSEWHERE_CHECKED = {
    ("powernorm_fairseq/norms/kernels/compiled.py", "source_digest"): "the package's own C++ source",
    ("powernorm_fairseq/norms/kernels/compiled.py", "installed"): "/proc/cpuinfo",
    ("powernorm_fairseq/patches/savedir.py", "saved_updates"):
        "called by newest_complete on each checkpoint after check_regular_file",
}


def file_reads(path: Path, rel: str):
    """(file, enclosing function, whether the function checks the file) for every call in ``path`` that reads a
    file: ``open(...)`` in a read mode, ``.read_text()``, ``.read_bytes()``, ``json.load``, ``torch.load``."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    functions = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = ast.get_source_segment(source, node)
    for call, where in enclosing(tree):
        f = call.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name == "open" and isinstance(f, ast.Name):
            mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"),
                                                                None)
            if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                continue
        elif not (name in ("read_text", "read_bytes") or (name == "load" and isinstance(f, ast.Attribute)
                                                           and isinstance(f.value, ast.Name)
                                                           and f.value.id in ("json", "torch"))):
            continue
        body = functions.get(where, source)
        yield rel, where, "check_regular_file(" in body or ".is_file()" in body or "_regular(" in body


def test_the_scanner_finds_every_read(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import json, torch\nfrom pathlib import Path\n"
                      "def a(p):\n    return open(p).read()\n"
                      "def b(p):\n    return Path(p).read_text()\n"
                      "def c(p):\n    check_regular_file(p)\n    return json.load(open(p, 'rb'))\n"
                      "def d(p):\n    return torch.load(p) if Path(p).is_file() else None\n"
                      "def e(p):\n    open(p, 'w').write('x'); Path(p).write_text('y')\n")
    assert sorted(set(file_reads(source, "m.py"))) == [("m.py", "a", False), ("m.py", "b", False),
                                                        ("m.py", "c", True), ("m.py", "d", True)]


@pytest.mark.slow
def test_every_reader_of_a_file_checks_it_is_a_regular_one():
    """Each read in the plugin's source is in a function that refuses anything
    but a regular file (``common.files.check_regular_file``, or an ``is_file()``
    that treats anything else as absent), or is listed with why its file cannot
    be a user's; a new read fails here until it is one or the other."""
    reads = {(rel, where) for path, rel in own_sources() for rel, where, checked in file_reads(path, rel)
             if not checked}
    assert reads == set(READS_ELSEWHERE_CHECKED), f"unchecked: {reads - set(READS_ELSEWHERE_CHECKED)}; " \
                                                  f"stale: {set(READS_ELSEWHERE_CHECKED) - reads}"
