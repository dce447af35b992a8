"""The base of every error that is the user's to fix (a config, a file, a device choice), as opposed to a
bug. ``primus`` prints these as one ``error: ...`` line and exits 2, without a traceback; backends raise
subclasses (or this) for refusals they can only make at run time."""


class UserError(Exception):
    pass
