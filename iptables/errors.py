"""The one exception type of the iptables layer."""


class IptablesError(RuntimeError):
    """An iptables/ipset operation failed or was refused; the message names the thing and the fix."""
