"""The one exception type users see from the data layer.

Every message says what is wrong and what to do about it; the CLI prints it as one line.
"""


class OpdError(Exception):
    """A user-facing error: bad input, a missing dataset, a corrupted shard."""


class DatasetNotFound(OpdError):
    pass


class CorruptDataset(OpdError):
    pass
