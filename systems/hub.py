"""Reaching the Hugging Face hub, and failing fast with a useful message when it cannot be reached.

`transformers` retries an unreachable hub for about a minute before it gives up with a generic
OSError. We probe the hub's host once (a TCP connect, three seconds at most) and, when it is down,
raise `HubUnreachable` at once with a message that names the offline alternative.
"""
import os
import socket
from urllib.parse import urlparse


class HubUnreachable(RuntimeError):
    """The hub is needed for `name` and cannot be reached; the message says what to use instead."""


def hub_reachable(timeout=3.0):
    """True when the hub's host accepts a TCP connection (and HF_HUB_OFFLINE is not set)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def require_hub(name, alternative):
    """Raise HubUnreachable naming `name` and `alternative` unless the hub can be reached."""
    if not hub_reachable():
        raise HubUnreachable(
            f"'{name}' is not a local path and the Hugging Face hub cannot be reached "
            f"(offline?); {alternative}"
        )
