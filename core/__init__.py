"""The shared core: what the agent and the controller must agree on.

Kubernetes objects as read from the API or from files (`objects`, `files`), rates
(`quantity`), policy resolution (`policy`), the allocation engine (`engine`), the
agent <-> controller wire format (`wire`), the API client and the reflector
(`kubeapi`, `reflector`), addresses (`address`), logging (`logsetup`) and the one
error base (`errors`). Nothing here touches the kernel; only the reflector and the
file source run a loop, and they are driven by their caller. Both processes sit
above this package; it imports neither of them (checked by import-linter).
"""
