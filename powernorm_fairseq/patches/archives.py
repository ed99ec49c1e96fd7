"""fairseq's model archives (``from_pretrained("model.tar.gz")``), extracted safely.

fairseq's ``file_utils.load_archive_file`` extracts a ``.tar.*`` with no
filter, into a temporary folder, then deletes the archive it was given and
moves the extracted folder into its place. An archive with a ``../`` member,
an absolute path, or a link followed by a file written through it, writes
outside that folder; and the user's archive is gone. Here every member is
checked before anything is written (tarfile's ``data`` filter, PEP 706:
no absolute path, no ``..``, no link or hard link that leaves the folder, no
device file), a refusal names the archive and the member in one line, and the
archive is extracted into a folder of its own, removed at exit, never in the
archive's place. ``tests/test_loaders.py`` finds every archive extraction in
fairseq's source and checks that each is this one or out of a user's reach.
"""

import atexit
import os
import shutil
import tarfile
import tempfile

from ..common.errors import InputFileError
from .base import installs_once


def extract_safely(archive_file, name=None) -> str:
    """Extract the tar archive ``archive_file`` (``name``: what its user called
    it, which gives the compression by its extension) into a new temporary
    folder, every member checked first; the folder of its contents."""
    name = name or archive_file
    ext = os.path.splitext(name)[1][1:]
    mode = "r:" + ext if ext in ("gz", "bz2", "xz") else "r:*"
    tempdir = tempfile.mkdtemp(prefix="powernorm-archive-")
    atexit.register(shutil.rmtree, tempdir, True)
    try:
        with tarfile.open(archive_file, mode) as archive:
            members = archive.getmembers()
            for member in members:  # all of them before anything is written
                try:
                    if os.path.isabs(member.name) or member.name.startswith(("/", "\\")):
                        raise tarfile.AbsolutePathError(member)  # the data filter would strip the slash
                    tarfile.data_filter(member, tempdir)
                except tarfile.FilterError as err:
                    raise InputFileError(f"{name}: refused: its member {member.name!r} {_why(err)}; "
                                         "nothing was extracted") from None
            archive.extractall(tempdir, members=members, filter="data")
            top = os.path.commonprefix(archive.getnames())
    except (tarfile.TarError, OSError) as err:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise InputFileError(f"{name}: not a readable archive ({err})") from None
    except BaseException:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise
    return os.path.join(tempdir, top)


def _why(err) -> str:
    return {tarfile.AbsolutePathError: "has an absolute path",
            tarfile.OutsideDestinationError: "would be written outside the folder it is extracted to",
            tarfile.AbsoluteLinkError: "is a link to an absolute path",
            tarfile.LinkOutsideDestinationError: "is a link that leads outside the folder",
            tarfile.SpecialFileError: "is a device file or a FIFO",
            }.get(type(err), str(err))


@installs_once
def safe_archives():
    """fairseq's ``load_archive_file`` (the hub's ``from_pretrained``, for the
    model and for its data) through :func:`extract_safely`: a folder or a name
    that fairseq does not resolve is left to fairseq."""
    from fairseq import file_utils

    original = file_utils.load_archive_file

    def load_archive_file(archive_file):
        try:
            resolved = file_utils.cached_path(archive_file, cache_dir=None)
        except EnvironmentError:
            return original(archive_file)  # not found: fairseq logs it and returns None
        if os.path.isdir(resolved):
            return resolved
        return extract_safely(resolved, str(archive_file))

    file_utils.load_archive_file = load_archive_file
