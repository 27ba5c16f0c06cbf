"""The HuggingFace Hub when it cannot be reached: huggingface_hub retries a failed request five times
with a growing pause (about 25 s, printing a "Retrying in 8s" line each time) before `datasets` or
`snapshot_download` fail. When the Hub's host does not even resolve (no network, the usual case on a
cluster's compute nodes), `cache_only_without_network` switches both libraries to their offline mode
first: a dataset or model already in the local cache loads from it, anything else fails at once, and
the error can say why."""

from __future__ import annotations

import socket
from urllib.parse import urlparse


def cache_only_without_network() -> str | None:
    """None when the Hub's host resolves (or offline mode is already on: HF_HUB_OFFLINE=1); otherwise,
    after switching huggingface_hub and datasets (if installed) to offline mode for this process, the
    reason in words, for the error a missing cache entry then raises."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
        return None
    except OSError:
        pass
    constants.HF_HUB_OFFLINE = True
    try:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
    except ImportError:
        pass
    return f"no network: {host} does not resolve, so only the local HuggingFace cache was searched"
