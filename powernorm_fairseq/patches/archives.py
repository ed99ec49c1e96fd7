"""fairseq's model archives (``from_pretrained("model.tar.gz")``), extracted safely,
whatever a process imports first.

fairseq's ``file_utils.load_archive_file`` extracts a ``.tar.*`` with no
filter, into a temporary folder, then deletes the archive it was given and
moves the extracted folder into its place. An archive with a ``../`` member,
an absolute path, a link or a hard link writes outside that folder; and the
user's archive is gone. Here a model archive (tar or zip) may hold regular
files and directories only: every member is checked before anything is
written (no absolute path, no ``..``, no link of any kind, no device or FIFO,
no NUL in a name), so safety does not rest on the interpreter's tarfile
version (its ``data`` filter has been bypassed, e.g. CVE-2025-4517's PATH_MAX
link chain). A refusal names the archive and the member (shortened) in one
line; the archive is extracted into a folder of its own, removed at exit,
never in the archive's place; a folder left by a process that was killed is
removed by the next extraction.

**Whatever is imported first.** ``from_pretrained(..., user_dir=...)``
extracts the archive before it imports the user dir, so the plugin's import
comes too late. The plugin's installation puts ``powernorm_fairseq-archives.pth``
in site-packages (``setup.py``); Python runs it at start-up in every process
of that environment, and it loads this module alone (standard library only,
no torch, no fairseq, nothing imported at module level but ``sys``), which
puts :class:`Guard` on ``sys.meta_path``: when ``fairseq.file_utils`` is
first imported, its ``load_archive_file`` is replaced. ``tests/test_loaders.py``
finds every archive extraction in fairseq's source and checks that each is
this one or out of a user's reach, in a fresh interpreter that never imports
the plugin, and measures the start-up cost.
"""

import sys

PREFIX = "powernorm-archive-"  # each extraction's folder: PREFIX<pid>-<random>, in the temporary directory
SHOWN = 80  # the characters of a member's name a refusal shows


def _refuse(message):
    """One line, as the plugin's InputFileError (imported here: this module is loaded alone at start-up)."""
    from powernorm_fairseq.common.errors import InputFileError

    raise InputFileError(message) from None


def _shown(name):
    name = name.replace("\0", "\\0")
    return repr(name if len(name) <= SHOWN else name[:SHOWN] + "...")


def _check_name(archive, name):
    """A member's name is a relative path inside the folder: no NUL, not absolute, no ``..``."""
    import os

    if "\0" in name:
        _refuse(f"{archive}: refused: its member {_shown(name)} has a NUL byte in its name; nothing was extracted")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        _refuse(f"{archive}: refused: its member {_shown(name)} has an absolute path; nothing was extracted")
    if ".." in name.replace("\\", "/").split("/"):
        _refuse(f"{archive}: refused: its member {_shown(name)} would be written outside the folder it is "
                "extracted to; nothing was extracted")


def _tar_members(archive, name):
    import tarfile

    members = archive.getmembers()
    for m in members:  # all of them before anything is written
        _check_name(name, m.name)
        if m.issym() or m.islnk():
            _refuse(f"{name}: refused: its member {_shown(m.name)} is a link (a model archive holds files and "
                    "folders only); nothing was extracted")
        if not (m.isreg() or m.isdir()):
            _refuse(f"{name}: refused: its member {_shown(m.name)} is a device file or a FIFO (a model archive "
                    "holds files and folders only); nothing was extracted")
    return members, lambda folder: archive.extractall(folder, members=members, filter=_plain(tarfile))


def _plain(tarfile):
    """tarfile's data filter, where the interpreter has one (a second line of defence)."""
    return "data" if hasattr(tarfile, "data_filter") else None


def _zip_members(archive, name):
    import stat

    members = archive.infolist()
    for m in members:
        _check_name(name, m.filename)
        kind = stat.S_IFMT(m.external_attr >> 16)
        if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
            _refuse(f"{name}: refused: its member {_shown(m.filename)} is a link or a special file (a model "
                    "archive holds files and folders only); nothing was extracted")
    return members, lambda folder: archive.extractall(folder, members=members)


def _remove_dead_folders(tmp):
    """Remove the extraction folders of processes that no longer run (killed before their exit handler)."""
    import os
    import shutil

    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for entry in names:
        if not entry.startswith(PREFIX):
            continue
        pid = entry[len(PREFIX):].split("-", 1)[0]
        path = os.path.join(tmp, entry)
        try:
            if not pid.isdigit() or os.lstat(path).st_uid != os.getuid() or os.path.islink(path):
                continue
            os.kill(int(pid), 0)  # alive (or not ours to signal): kept
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def extract_safely(archive_file, name=None) -> str:
    """Extract the tar or zip archive ``archive_file`` (``name``: what its user called it) into a new
    temporary folder, every member checked first; the folder of its contents."""
    import atexit
    import os
    import shutil
    import stat
    import tarfile
    import tempfile
    import zipfile

    name = name or archive_file
    try:
        kind = os.stat(archive_file).st_mode
    except OSError as err:
        _refuse(f"{name}: not a readable archive ({err.strerror})")
    if not stat.S_ISREG(kind):  # a FIFO would block the read for ever
        _refuse(f"{name}: not a regular file (a FIFO, a device or a socket); give the archive's file")
    tmp = tempfile.gettempdir()
    _remove_dead_folders(tmp)
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmp)
    atexit.register(shutil.rmtree, folder, True)
    try:
        if zipfile.is_zipfile(archive_file):
            with zipfile.ZipFile(archive_file) as archive:
                members, extract = _zip_members(archive, name)
                extract(folder)
                names = [m.filename.rstrip("/") for m in members]
        else:
            with tarfile.open(archive_file, "r:*") as archive:
                members, extract = _tar_members(archive, name)
                extract(folder)
                names = [m.name for m in members]
        top = os.path.commonprefix(names)
    except (tarfile.TarError, zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        shutil.rmtree(folder, ignore_errors=True)
        if type(err).__module__.startswith("powernorm_fairseq"):
            raise
        _refuse(f"{name}: not a readable archive ({type(err).__name__}: {_shown(str(err))[1:-1]})")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return os.path.join(folder, top)


def _load_archive_file(original):
    """fairseq's ``load_archive_file`` through :func:`extract_safely`: a folder, or a name fairseq
    does not resolve, is left to fairseq."""
    def load_archive_file(archive_file):
        import os

        from fairseq import file_utils

        try:
            resolved = file_utils.cached_path(archive_file, cache_dir=None)
        except EnvironmentError:
            return original(archive_file)  # not found: fairseq logs it and returns None
        if os.path.isdir(resolved):
            return resolved
        return extract_safely(resolved, str(archive_file))

    load_archive_file.powernorm_guard = True
    return load_archive_file


def safe_archives():
    """Replace ``fairseq.file_utils.load_archive_file``, once (fairseq imported)."""
    from fairseq import file_utils

    if not getattr(file_utils.load_archive_file, "powernorm_guard", False):
        file_utils.load_archive_file = _load_archive_file(file_utils.load_archive_file)
    safe_archives.installed = True


safe_archives.installed = False  # as patches.base.installs_once: whether the plugin's import installed it


class Guard:
    """On ``sys.meta_path``: replaces fairseq's archive extraction as soon as ``fairseq.file_utils`` is
    imported, in a process that has not imported the plugin (start-up, through the .pth)."""

    TARGET = "fairseq.file_utils"

    def find_spec(self, name, path=None, target=None):
        if name != self.TARGET:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # fairseq's own spec, then step aside for good
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if not getattr(module.load_archive_file, "powernorm_guard", False):
                module.load_archive_file = _load_archive_file(module.load_archive_file)

        spec.loader.exec_module = exec_module
        return spec

    def invalidate_caches(self):
        pass


def guard():
    """What the .pth runs at start-up: the guard on ``sys.meta_path`` (at once, if fairseq's file_utils is
    already imported)."""
    if "fairseq.file_utils" in sys.modules:
        safe_archives()
    elif not any(type(f).__name__ == "Guard" and getattr(f, "TARGET", None) == Guard.TARGET
                 for f in sys.meta_path):
        sys.meta_path.insert(0, Guard())


def _pth():
    """The line of ``powernorm_fairseq-archives.pth``: this file loaded alone, under its own name (its
    package is imported only when the plugin is), and :func:`guard` run. Python's site module reports a
    failure here and goes on: a broken guard must not stop every Python program of the environment."""
    return ("import sys, importlib.util as u; s = u.find_spec('powernorm_fairseq'); "
            "p = s and s.submodule_search_locations and s.submodule_search_locations[0] + '/patches/archives.py'; "
            "m = p and 'powernorm_fairseq.patches.archives' not in sys.modules and "
            "u.spec_from_file_location('powernorm_fairseq.patches.archives', p); "
            "x = m and u.module_from_spec(m); "
            "x and (sys.modules.setdefault(m.name, x), m.loader.exec_module(x), x.guard())\n")
