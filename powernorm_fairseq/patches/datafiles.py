"""fairseq's data files (``.idx`` + ``.bin``, ``dict.*.txt``) checked when opened.

A truncated ``.bin`` or ``.idx``, or an ``.idx`` of another split or
language, otherwise surfaces later as a traceback that names no file (an
offset error, a buffer-length error, an assertion about example counts). The
index says exactly how many bytes its data file holds, so every such
mismatch is caught at open, in one line naming the files. An index that is
empty, random bytes or of no known format, and a dictionary with a line
without its count or bytes that are not UTF-8, are named in one line too.
"""

import os
import struct

from ..common.errors import InputFileError
from .base import installs_once


def _expected_bytes(index) -> int:
    if len(index) == 0:
        return 0
    return int(index._pointers[-1]) + int(index._sizes[-1]) * index.dtype().itemsize


@installs_once
def check_binarized_data():
    """Install the check into fairseq's ``MMapIndexedDataset``."""
    from fairseq.data import indexed_dataset

    cls = indexed_dataset.MMapIndexedDataset
    do_init, delete = cls._do_init, cls.__del__

    def _do_init(self, path):
        idx, bin_ = indexed_dataset.index_file_path(path), indexed_dataset.data_file_path(path)
        try:
            index = self.Index(idx)
        except (AssertionError, ValueError, OSError, EOFError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise InputFileError(f"{idx}: not a readable fairseq index (truncated or corrupt; "
                                 "binarize the data again with fairseq-preprocess)") from None
        have = os.path.getsize(bin_) if os.path.exists(bin_) else None
        want = _expected_bytes(index)
        del index
        if have is not None and have != want:
            raise InputFileError(
                f"{bin_} holds {have} bytes, its index {idx} describes {want}: a truncated file, or "
                "an index of another split or language; binarize the data again with fairseq-preprocess")
        do_init(self, path)

    def __del__(self):
        if "_bin_buffer_mmap" in self.__dict__:  # an instance whose opening failed has nothing to close
            delete(self)

    def index_del(self):
        if "_bin_buffer_mmap" in self.__dict__:  # an index whose reading failed has nothing to close
            index_delete(self)

    index_delete = cls.Index.__del__
    cls._do_init = _do_init
    cls.__del__ = __del__
    cls.Index.__del__ = index_del

    # an index in no known format is read as fairseq's oldest one, whose reader asserts its magic
    legacy = indexed_dataset.IndexedDataset
    read_index = legacy.read_index

    def checked_read_index(self, path):
        try:
            read_index(self, path)
        except (AssertionError, KeyError, ValueError, struct.error) as exc:
            raise InputFileError(f"{indexed_dataset.index_file_path(path)}: not a fairseq index (empty, "
                                 "corrupt or another kind of file; binarize the data again with "
                                 "fairseq-preprocess)") from exc

    legacy.read_index = checked_read_index

    from fairseq.data import dictionary

    add_from_file = dictionary.Dictionary.add_from_file

    def checked_add_from_file(self, f):
        if not isinstance(f, str):
            return add_from_file(self, f)
        try:
            return add_from_file(self, f)
        except FileNotFoundError:
            raise
        except Exception as exc:  # fairseq's ValueError (a line without its count) or bare Exception (encoding)
            text = " ".join(str(exc).split())
            if "encoding" in text:
                text = "not UTF-8 text"
            raise InputFileError(f"{f}: not a fairseq dictionary ({text}); each line is '<token> <count>', "
                                 "as fairseq-preprocess writes it") from exc

    dictionary.Dictionary.add_from_file = checked_add_from_file
