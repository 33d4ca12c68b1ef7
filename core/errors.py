"""The one error base of netagent's own packages (tc/ and iptables/ keep their own)."""
from __future__ import annotations


class NetagentError(Exception):
    """An error netagent raises on purpose; its message names the input or fact and, where it can, the fix."""


class ConfigError(NetagentError, ValueError):
    """A flag or a combination of flags that cannot work; the message names the flag."""
