"""Error types: every user-facing failure raises a MoestreamError subclass with a message that says what to do."""


class MoestreamError(Exception):
    """Base class for errors shown to users without a traceback."""


class CheckpointError(MoestreamError):
    """A checkpoint is missing, truncated, corrupt or inconsistent."""


class UnsupportedModelError(MoestreamError):
    """The checkpoint's model_type (or a feature of it) is not supported."""


class BudgetError(MoestreamError):
    """The RAM budget is too small for what was asked."""


class TokenizerError(MoestreamError):
    """The tokenizer or chat template is missing or malformed."""


class RequestError(MoestreamError):
    """A generation request has invalid parameters."""
