"""What nemo_memlog said within a block: its notices (records of the "nemo_memlog" logger) and
its warnings (misuse), as text, for tests in this process and in the ranks they launch."""

import contextlib
import logging
import warnings


class _Kept(logging.Handler):
    def __init__(self, said: list):
        super().__init__(logging.DEBUG)
        self.said = said

    def emit(self, record):
        self.said.append(record.getMessage())


@contextlib.contextmanager
def said(*, notices: bool = True, warned: bool = True):
    """A list that holds, once the block ends, every notice logged and every warning issued in it
    (notices as they come; warnings, all of them shown, appended at the end)."""
    texts: list[str] = []
    handler = _Kept(texts)
    logger = logging.getLogger("nemo_memlog")
    if notices:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield texts
    finally:
        logger.removeHandler(handler)
    if warned:
        texts.extend(str(w.message) for w in caught)
