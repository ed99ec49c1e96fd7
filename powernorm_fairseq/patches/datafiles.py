"""fairseq's binarized data (``.idx`` + ``.bin``) checked when it is opened.

A truncated ``.bin`` or ``.idx``, or an ``.idx`` of another split or
language, otherwise surfaces later as a traceback that names no file (an
offset error, a buffer-length error, an assertion about example counts). The
index says exactly how many bytes its data file holds, so every such
mismatch is caught at open, in one line naming the files.
"""

import os

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

    cls._do_init = _do_init
    cls.__del__ = __del__
