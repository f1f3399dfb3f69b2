"""User-facing errors. Anything raised as a LadleError is the user's to fix: the CLI prints its
message (no traceback) and exits with status 2."""


class LadleError(Exception):
    """A problem with the user's input: config, paths, data. The message names the field, file or
    line and says how to fix it."""


class ConfigError(LadleError):
    pass


class DataError(LadleError):
    pass


class CheckpointError(LadleError):
    pass
