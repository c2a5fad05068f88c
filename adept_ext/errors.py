"""The library's error types (every layer may raise them; they import nothing of the library)."""


class RunError(Exception):
    """A problem with the inputs of a run, reported as one line."""


class InputError(RunError, ValueError):
    """Input the library cannot use (a model, corpus, task file or argument), raised by the
    library's own checks: one `adept-ext: error:` line in the CLI, a ValueError for code that
    calls the library directly. Any other exception keeps its traceback: it is a bug."""


class MethodError(InputError):
    """An input a method cannot work with (an unknown name, a sequence it does not learn, an option
    or a k that does not fit the model): one `adept-ext: error:` line in the CLI, and a ValueError
    for code that calls the methods directly. Any other exception inside a method is a bug and
    keeps its traceback."""
