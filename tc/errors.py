"""The one exception type of the tc layer."""


class TcError(RuntimeError):
    """A traffic-control operation failed or was refused; the message names the thing and the fix."""
