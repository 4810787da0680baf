"""Hub ids on a host that cannot reach the hub.

transformers asks the hub for a hub id's files before it looks in the local cache, and
huggingface_hub retries a connection that fails: on a host without the network a cached model loaded
after ~45 s of "Retrying in 8s", and one that is not cached failed only then. Here one short request
tells whether the hub answers; where it does not, the id becomes its cached snapshot (a local folder,
loaded at once) or a clear error naming the cache, at once. Where the hub answers, the id passes
through (transformers downloads and revalidates as usual); huggingface_hub's own settings (its endpoint,
proxies, HF_HUB_OFFLINE, the cache's place) hold throughout.

Knows nothing of models' aliases, sessions or RPC.
"""

from __future__ import annotations

import functools

PROBE_TIMEOUT = 3.0  # seconds the hub has to answer one request before it counts as out of reach


@functools.cache  # asked once a process: a service resolves its model for the tokenizer, the weights, the config
def reachable(endpoint: str | None = None, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the hub answers one HEAD request (any HTTP status) within `timeout`, through
    huggingface_hub's own session (its proxies); False at once where HF_HUB_OFFLINE is set."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(endpoint or constants.ENDPOINT, timeout=timeout)
    except Exception:  # noqa: BLE001 - any failure to get an answer (DNS, refused, timed out, TLS) is "no"
        return False
    return True


def local(model: str, cache_dir: str | None = None) -> str:
    """`model` (a hub id) as transformers should load it here: itself where the hub answers, else the
    folder of its cached snapshot; FileNotFoundError naming the id and the cache where neither."""
    if reachable():
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(model, local_files_only=True, cache_dir=cache_dir)
    except HFValidationError:  # not a hub id at all: transformers says so, as it would with the hub
        return model
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {model!r}: the hub ({constants.ENDPOINT}) does not answer from this host and the model is "
            f"not in its cache ({cache_dir or constants.HF_HUB_CACHE}); download it where the hub answers "
            f"(`hf download {model}`, with HF_HUB_CACHE pointing at this host's cache) or pass a local path"
        ) from None
